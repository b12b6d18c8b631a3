#!/bin/bash
# The answer-label issue's end task (llama.cpp, batch 4, 512 tokens): R2R with the shipped router and entropy
# routing, each with verification off and at 1 nat, then the SLM and the LLM alone, on GSM8K dev items (or
# HumanEval/0-119 with BENCHMARK=humaneval, the check that code did not get worse). Entropy aims at a fixed LLM
# share (R2R's share on items 0-49 of the same benchmark, or $ENTROPY_RATE), so that every chunk runs one
# configuration. Run it in 50-item chunks, in the activated venv: `scripts/eval-end-task.sh 50-99`, or
# `BENCHMARK=humaneval scripts/eval-end-task.sh 0-49`.
#
# The per-item results live in runs/eval-end/BENCHMARK/; after each system they are also copied, slim (id,
# grade, counts, times and the per-token routes, but no outputs or token ids), to data/evals/BENCHMARK/, which
# is committed: a fresh checkout resumes from there, and `python scripts/paired.py data/evals/gsm8k A B`
# compares any two systems.
set -euxo pipefail
IDS=${1:-0-49}
BENCHMARK=${BENCHMARK:-gsm8k}
OUT=runs/eval-end
SLIM=data/evals/$BENCHMARK
mkdir -p $OUT/$BENCHMARK $SLIM
for f in $SLIM/*.jsonl $SLIM/*.config.json; do  # resume from the committed rows where this machine has none
    [ -e "$f" ] && [ ! -e "$OUT/$BENCHMARK/$(basename "$f")" ] && cp "$f" $OUT/$BENCHMARK/
done
slim() {
    python -c "import json, shutil, sys
from pathlib import Path
from roads_to_rome.eval.evaluate import read_results
for path in Path(sys.argv[1]).glob('*.jsonl'):
    rows = [{k: v for k, v in r.items() if k not in ('output', 'token_ids')} for r in read_results(path)]
    (Path(sys.argv[2]) / path.name).write_text(''.join(json.dumps(r) + '\\n' for r in rows))
    shutil.copy(path.with_suffix('.config.json'), sys.argv[2])" $OUT/$BENCHMARK $SLIM
}
R="--benchmark $BENCHMARK --ids $IDS --backend llamacpp --max-new-tokens 512 --batch-size 4 --out $OUT"
r2r eval $R --systems r2r --verify off,1; slim
# Entropy's target: R2R's LLM share on items 0-49 (verify off), the same for every chunk.
ENTROPY_RATE=${ENTROPY_RATE:-$(python -c "from pathlib import Path
from roads_to_rome.eval.evaluate import read_results, summarize
rows = [r for r in read_results(Path('$OUT/$BENCHMARK/r2r.jsonl')) if int(r['id']) < 50]
assert len(rows) == 50, 'run items 0-49 first: entropy aims at the LLM share R2R reaches on them'
print(round(summarize(rows)['llm_rate'], 4))")}
r2r eval $R --systems entropy --verify off,1 --llm-rate "$ENTROPY_RATE"; slim
r2r eval $R --systems slm,llm; slim
