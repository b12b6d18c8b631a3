#!/bin/bash
# GSM8K dev items, llama.cpp, batch 1: R2R with and without verification on catch-up, then the baselines
# (entropy aims at R2R's LLM share on the same items). Resumable: re-run to continue; pass other items
# as $1 (default 0-49), e.g. `scripts/eval-verify.sh 50-99`; the summary covers the items asked for.
set -ex
IDS=${1:-0-49}
R="--benchmark gsm8k --ids $IDS --backend llamacpp --max-new-tokens 512 --out runs/eval-verify"
r2r eval $R --systems r2r --verify off,1,2
r2r eval $R --systems llm,slm,entropy
