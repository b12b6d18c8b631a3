#!/bin/bash
# Held-out recall of answer-divergent tokens (the answer-label issue): does a router trained on answer labels find
# the tokens that change the final answer better than entropy, and better than one trained on margin labels alone?
# Run it in the activated venv after scripts/label-onpolicy-answer.sh has finished: `scripts/answer-holdout.sh`.
#
# HOLD_OUT (default 40) of the 140 written word problems, picked by a seeded shuffle of their ids, are taken out of
# both label datasets; two routers train on the rest (answer labels first with margin labels for the other prompts,
# and margin labels alone), and `r2r calibrate --all-prompts` measures each, beside entropy, on the held-out
# problems' answer labels. Everything lands in runs/holdout/ (each router's calibrate result as calibrate-*.json).
set -euxo pipefail
OUT=runs/holdout
HOLD_OUT=${HOLD_OUT:-40}
B="--backend llamacpp"
rm -rf $OUT && mkdir -p $OUT
python -c "import random, shutil, sys
import pyarrow as pa, pyarrow.parquet as pq
from pathlib import Path
from roads_to_rome.pipeline.labels import Parts
out, n = Path(sys.argv[1]), int(sys.argv[2])
answer, margin = Path('data/labels/onpolicy-answer'), Path('data/labels/onpolicy')
written = sorted(Parts(answer, 'responses').done())
random.Random(0).shuffle(written)
test = set(written[:n])
def keep(src, dst, pick):
    Parts(dst, 'responses').write([r for r in Parts(src, 'responses').rows() if pick(r['id'])])
    rows = pq.read_table(src / 'labels.parquet').to_pylist()
    pq.write_table(pa.Table.from_pylist([r for r in rows if pick(r['id'])]), dst / 'labels.parquet')
keep(answer, out / 'answer-train', lambda i: i not in test)
keep(answer, out / 'answer-test', lambda i: i in test)
keep(margin, out / 'margin-train', lambda i: i not in test)
print(len(test), 'held-out problems of', len(written))" $OUT "$HOLD_OUT"
r2r train $OUT/answer-train $OUT/margin-train --out $OUT/router-answer $B --ablations
r2r train $OUT/margin-train --out $OUT/router-margin $B
# The shipped router as well (trained on the margin labels of every prompt, these held-out ones included).
cp -r roads_to_rome/models/routers/qwen2.5-coder-0.5b-instruct $OUT/router-shipped
for router in answer margin shipped; do
    r2r calibrate $OUT/router-$router $OUT/answer-test --all-prompts $B --json > $OUT/calibrate-$router.json
    cat $OUT/calibrate-$router.json
done
