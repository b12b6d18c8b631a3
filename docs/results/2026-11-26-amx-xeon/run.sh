#!/bin/bash
# The measurements of docs/results/2026-11-26-amx-xeon.md, one after another, nothing else running (a 2-vCPU Xeon
# with AMX; the checkout's .venv from `make demo`). Results land beside this script; logs in $LOGS.
set -u
cd "$(dirname "$0")/../../.."
here=docs/results/2026-11-26-amx-xeon
LOGS=${LOGS:-/tmp/amx}
mkdir -p "$LOGS"
r2r=.venv/bin/r2r
lscpu > "$LOGS/lscpu.txt"
# Step costs of the real pair on each backend (llama.cpp: set-up's AMX-less build); torch in both dtypes.
$r2r bench steps --backend llamacpp --device cpu --new-tokens 1,2,4,8,16,32,64 --out $here/steps-llamacpp.json \
  > "$LOGS/steps-llamacpp.txt" 2>&1
for dtype in bfloat16 float32; do
  $r2r bench steps --backend torch --device cpu --dtype $dtype --new-tokens 1,2,4,8,16,32,64 \
    --out $here/steps-torch-$dtype.json > "$LOGS/steps-torch-$dtype.txt" 2>&1
done
# R2R as users run it (the shipped router, GSM8K dev prompts, greedy), the LLM on llama.cpp and on torch.
.venv/bin/python scripts/r2r-speed.py --prompts 4 --tokens 128 --verify off,1 --backend llamacpp \
  --backend slm=llamacpp,llm=torch > $here/r2r-speed.jsonl 2> "$LOGS/r2r-speed.err"
# A 7B-shaped LLM beside the real SLM: on llama.cpp (a random Q4_K_M file, built once), and on torch (bf16).
for backend in llamacpp torch; do
  $r2r bench shapes --backend $backend --device cpu --llm-shape qwen2.5-coder-7b --llm-share 0.1,0.15 --prompts 1 \
    --tokens 128 --verify "" --spec-k "" --new-tokens 1,2,4,8,16 --out $here/shapes-7b-$backend.json \
    > "$LOGS/shapes-7b-$backend.txt" 2>&1
done
# The repacked layouts on and off, alternating (the A/B on the results page).
.venv/bin/python $here/repack-ab.py > $here/repack-ab.json 2> "$LOGS/repack-ab.err"
