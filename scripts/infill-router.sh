#!/bin/bash
# A router for fill in the middle: does one trained on FIM positions as well as on math route an editor's single-line
# completions better than the shipped router (math answers only) and than entropy, without losing on math?
# Run it in the activated venv: `scripts/infill-router.sh`; every step resumes where a killed run stopped.
#
# 1. Training labels: lines of code taken out of functions of Python's standard library (`r2r label prompts --recipe
#    infill`; the first 400 of 600 prompts), written by the SLM and read by the LLM (on-policy margin labels, as the
#    shipped router's math labels are).
# 2. A router trained on those and on the shipped router's math labels (data/labels/onpolicy), its threshold set
#    to send 12% of the math labels' tokens to the LLM, as the shipped router's does.
# 3. Test labels no router trained on, for measuring only: the SLM's own lines for HumanEval/0-119's infill items,
#    and its answers to 40 math prompts of data/labels/onpolicy/prompts.jsonl that were never labelled (241-280).
#    `r2r calibrate --all-prompts` measures the new router, the shipped one and entropy on each.
# 4. The end task: `r2r eval --benchmark humaneval-infill` with the new router, and entropy at its LLM rate.
# Everything lands in $OUT (default runs/infill).
set -euxo pipefail
OUT=${OUT:-runs/infill}
B="--backend llamacpp"
MARGIN="--writer slm --judge margin --margin 1.0 --batch-size 4"
mkdir -p $OUT

r2r label prompts --recipe infill --functions 600 --seed 0 --out $OUT/prompts.jsonl
head -400 $OUT/prompts.jsonl > $OUT/prompts-400.jsonl
r2r label run $OUT/prompts-400.jsonl --out $OUT/labels $MARGIN --max-new-tokens 48 $B

[ -f $OUT/router/router.json ] || r2r train data/labels/onpolicy $OUT/labels --out $OUT/router $B
# Its threshold where the shipped router's is on math: 12% of the math labels' tokens go to the LLM.
r2r calibrate $OUT/router data/labels/onpolicy --all-prompts --target-rate 0.12 --write $B

python -c "import json, sys
from roads_to_rome.data.benchmarks import load
rows = [{'id': i.id, 'domain': 'humaneval-infill', 'prompt': i.prompt, 'suffix': i.suffix, 'stop': ['\n']}
        for i in load('humaneval-infill')[:120]]
open(sys.argv[1], 'w').write(''.join(json.dumps(r) + '\n' for r in rows))" $OUT/test-infill-prompts.jsonl
r2r label run $OUT/test-infill-prompts.jsonl --out $OUT/test-infill $MARGIN --max-new-tokens 64 $B
sed -n 241,280p data/labels/onpolicy/prompts.jsonl > $OUT/test-math-prompts.jsonl
r2r label run $OUT/test-math-prompts.jsonl --out $OUT/test-math $MARGIN --max-new-tokens 512 $B

rm -rf $OUT/router-shipped && cp -r roads_to_rome/models/routers/qwen2.5-coder-0.5b-instruct $OUT/router-shipped
for router in router router-shipped; do
    for test in test-infill test-math; do
        r2r calibrate $OUT/$router $OUT/$test --all-prompts $B --json > $OUT/calibrate-$router-$test.json
    done
done

r2r eval --benchmark humaneval-infill --ids 0-119 --systems r2r,entropy --max-new-tokens 64 \
    --router-path $OUT/router --out $OUT/eval $B
# Entropy at the LLM rate R2R reached (the eval's rate-matched entropy cannot aim on lines this short).
RATE=$(python -c "import json; print(round(json.load(open('$OUT/eval/humaneval-infill/summary.json'))['systems']['r2r']['llm_rate'], 3))")
python scripts/infill-entropy-fixed.py $RATE
python scripts/paired.py $OUT/eval/humaneval-infill r2r "entropy-fixed@$RATE"
