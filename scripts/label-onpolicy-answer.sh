#!/bin/bash
# On-policy answer labels (the answer-label issue): the SLM's own responses of the shipped router's dataset
# (data/labels/onpolicy/responses) labelled by `--writer slm --judge answer`: at each position
# where the LLM's argmax differs from the SLM's token, the LLM writes to the end of the answer from each of the two
# tokens, and the position is divergent when the final answers differ. Run it in the activated venv:
# `scripts/label-onpolicy-answer.sh` (LIMIT=SECONDS stops the label run after that long and still saves what it did).
#
# The rollouts are the slow part (hours on 2 cores), so their parts are copied to
# data/labels/onpolicy-answer/continuations/ after every run, committed, and copied back before the next one: a
# fresh checkout resumes there. Once every position is rolled out, the judgements and labels steps run and the
# dataset (labels.parquet, responses/, report.json) lands in data/labels/onpolicy-answer/.
set -euxo pipefail
OUT=runs/onpolicy-answer
KEEP=data/labels/onpolicy-answer
PROMPTS=data/labels/onpolicy/prompts.jsonl
mkdir -p $OUT $KEEP/continuations
# The SLM's responses are the committed dataset's (the same prefixes as its margin labels: `r2r label agree`).
# ONLY picks them by id (default: the 140 word problems the LLM wrote in GSM8K's style; '' for all 240); the
# responses step never runs here. Rollouts to the end of the answer cost about 20 s a position on 2 cores, so
# PER_RESPONSE (default 4) differing positions of each response are rolled out, a fixed sample.
ONLY=${ONLY-math/written/}
[ -d $OUT/responses ] || python -c "import sys
from pathlib import Path
from roads_to_rome.pipeline.labels import Parts
rows = [r for r in Parts(Path('data/labels/onpolicy'), 'responses').rows() if sys.argv[2] in r['id']]
Parts(Path(sys.argv[1]), 'responses').write(rows)
(Path(sys.argv[1]) / 'responses.json').write_text('{\"writer\": \"slm\"}')" $OUT "$ONLY"
mkdir -p $OUT/continuations
for f in $KEEP/continuations/part-*.parquet; do
    [ -e "$f" ] && [ ! -e "$OUT/continuations/$(basename "$f")" ] && cp "$f" $OUT/continuations/
done
[ -e $KEEP/continuations.json ] && cp $KEEP/continuations.json $OUT/
L="r2r label run $PROMPTS --out $OUT --writer slm --judge answer --max-new-tokens 512 --batch-size 4 --backend llamacpp \
   --positions-per-response ${PER_RESPONSE:-4}"
status=0
timeout "${LIMIT:-0}" $L --steps prefill,continuations || status=$?
cp -n $OUT/continuations/part-*.parquet $KEEP/continuations/ 2>/dev/null || true
cp $OUT/continuations.json $KEEP/ 2>/dev/null || true
[ $status -eq 0 ] || exit $status
$L --steps judgements,labels
cp $OUT/labels.parquet $KEEP/
rm -rf $KEEP/responses && cp -r $OUT/responses $KEEP/
r2r label report $OUT --json > $KEEP/report.json
