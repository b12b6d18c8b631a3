#!/bin/bash
# vLLM (CPU build) with its default 128-token KV blocks against 32-token blocks, alternating; r2r bench remote each.
cd /work/main
D=$(.venv/bin/python -c "from roads_to_rome.models import DEFAULT_LLM, converted_dir; print(converted_dir(DEFAULT_LLM))")
N=$(.venv/bin/python -c "from roads_to_rome.models import DEFAULT_LLM; print(DEFAULT_LLM.name)")
for round in 1 2; do
for block in 128 32; do
  VLLM_CPU_KVCACHE_SPACE=4 OMP_NUM_THREADS=2 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model $D \
    --served-model-name $N --dtype bfloat16 --max-model-len 4096 --enforce-eager --block-size $block --port 8000 \
    > /tmp/vb/server-$block-$round.log 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8000/v1/models >/dev/null; do sleep 2; done
  echo "== round $round block $block $(date +%T)"
  .venv/bin/r2r bench remote --llm http://127.0.0.1:8000 --out /tmp/vb/bench-$block-$round.json > /tmp/vb/bench-$block-$round.txt 2>&1
  tail -25 /tmp/vb/bench-$block-$round.txt
  kill $pid; wait $pid 2>/dev/null
done
done
