#!/usr/bin/env bash
# Grouped LLM calls with the LLM on torch (bf16, oneDNN's AMX kernels) on a 2-core AMX Xeon; each after the last,
# nothing else running. Run from the repository root with the project's virtualenv on PATH.
set -euo pipefail
here=docs/results/2026-11-27-grouped-torch-amx
lscpu > "$here/lscpu.txt"
r2r bench shapes --llm-shape qwen2.5-coder-7b --llm-share 0.15 --batch 4 --prompts 4 --tokens 128 \
  --verify "" --spec-k "" --new-tokens 1,2,4,8,16,32 --backend torch --out "$here/shapes-7b.json"
r2r bench serve --clients 4,8 --requests 8 --tokens 128 --defer off,continue --rounds 2 \
  --backend slm=llamacpp,llm=torch --out "$here/serve.json"
