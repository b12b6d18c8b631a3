#!/usr/bin/env bash
# R2R on a GPU box that has torch and transformers but no network and no prepared weights (the device tool's
# machines): the CUDA exactness tests, then `r2r bench shapes` on random-weight pairs of the paper's shapes.
#
# Needs beside the checkout .gpu/, which scripts/gpu-prepare.sh makes: the default pair's tokenizer files (no weights)
# and wheels of the [eval] dependencies the box lacks.
# Each results file is copied to $OUT (default runs/gpu) as soon as its pair is done, so a run cut short keeps what
# it measured; the tables and plots go there as one archive at the end, the log as log.txt, each pair's whole
# output, every line timed, as <part>.log.
#
# Parts, in this order, all but the r1-...compiled ones by default:
#   scripts/gpu-run.sh [tests] [r1-uncompiled] [r1-compiled] [r1] [r1-batched] [r1-grouped] [coder] [qwen3] [profile]
# profile: scripts/gpu-profile.py, where an R2R step's time goes at batch 1 (R1-Distill 1.5B; $PROFILE_VARIANTS,
# default graphs,compiled); r1-uncompiled and r1-compiled: the R1 pair at batch 1, no speculative rows, with the
# trunks as transformers runs them (--compile none), and with the SLM's compiled (the default).
# $TOKENS: new tokens a row in the bench shapes runs (default 512); $LIMIT_<part> (- as _): a part's time limit in
# seconds instead of its default (LIMIT_r1_grouped=300); $RESUME_FROM: a folder of an earlier run's results files
# (a results page's, say): a part whose file is there starts from it and measures only what it lacks.
set -u
parts=" ${*:-tests profile r1 r1-batched coder qwen3} "
want() { [[ "$parts" == *" $1 "* ]]; }
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT" runs/gpu
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" R2R_CACHE="$PWD/.gpu/cache"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
lscpu | grep -m1 "Model name"
git log -1 --format='commit %h %s' 2>/dev/null || true

export COLUMNS=160  # rich's tables unwrapped in the log
export TORCH_LOGS=${TORCH_LOGS-recompiles}  # why torch.compile compiled again, in each part's log
limit() { local name="LIMIT_${1//-/_}"; echo "${!name:-$2}"; }
want tests && timeout "$(limit tests 150)" python3 -m pytest -q -p no:cacheprovider -n 3 --tb=short -rf \
  tests/test_cuda.py 2>&1 | tail -60

stamped() { while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done; }  # (when compiles and runs end)
shapes() {  # one pair; killed at $1 seconds so that later pairs still run; its results file copied to $OUT
  local part=$1 limit=$2 out=$3; shift 3
  if [ -n "${RESUME_FROM:-}" ] && [ -f "$RESUME_FROM/$out" ] && [ ! -f "runs/gpu/$out" ]; then
    cp "$RESUME_FROM/$out" "runs/gpu/$out" && chmod u+w "runs/gpu/$out"
  fi
  timeout "$(limit "$part" "$limit")" python3 -m roads_to_rome bench shapes --backend torch --device cuda --verify "" \
    --real-from docs/results/2026-11-26-bench-shapes-xeon.json --tokens "${TOKENS:-512}" --prompts 1 \
    --out "runs/gpu/$out" "$@" \
    2>&1 | grep --line-buffered -v "━" | stamped | tee "$OUT/$part.log" | tail -45
  [ "$OUT" = runs/gpu ] || cp "runs/gpu/$out" "$OUT/" 2>/dev/null
}
r1=(--slm-shape r1-distill-qwen-1.5b --llm-shape r1-distill-qwen-32b --llm-share 0.11,0.15)
want r1-uncompiled && shapes r1-uncompiled 150 r1-32b-uncompiled.json "${r1[@]}" --spec-k "" --compile none
want r1-compiled && shapes r1-compiled 200 r1-32b-compiled.json "${r1[@]}" --spec-k ""
want r1 && shapes r1 180 r1-32b.json "${r1[@]}" --spec-k 4
want r1-batched && shapes r1-batched 170 r1-32b-batched.json "${r1[@]}" --spec-k "" --batch 4,8
# r1-grouped: the LLM alone, lockstep and grouped LLM calls (--defer continue, park) at batch 1 to 32, and at batch 1
# and 8 each of them with the LLM's calls on a stream of their own beside the SLM's steps (--overlap); the real
# pair's share of deferred routed tokens kept comes from the CPU run that measured it
want r1-grouped && shapes r1-grouped 400 r1-32b-grouped.json --slm-shape r1-distill-qwen-1.5b --llm-shape r1-distill-qwen-32b \
  --llm-share 0.11 --spec-k "" --batch 1,4,8,16,32 --overlap 1,8 \
  --real-from docs/results/2026-11-26-grouped-amx/shapes-7b.json
want coder && shapes coder 100 coder.json --slm-shape qwen2.5-coder-0.5b --llm-shape qwen2.5-coder-7b,qwen2.5-coder-14b \
  --llm-share 0.11,0.15 --spec-k ""
want qwen3 && shapes qwen3 70 qwen3-8b.json --slm-shape qwen3-0.6b --llm-shape qwen3-8b --llm-share 0.11,0.15 --spec-k ""
if want profile; then
  timeout "$(limit profile 240)" python3 scripts/gpu-profile.py --variants "${PROFILE_VARIANTS:-graphs,compiled}" \
    --out runs/gpu/profile.json 2>&1 | grep -v Warning | tail -40
  [ "$OUT" = runs/gpu ] || cp runs/gpu/profile* "$OUT/" 2>/dev/null
fi
tar czf "$OUT/tables-and-plots.tgz" -C runs/gpu --exclude '*.json' .
