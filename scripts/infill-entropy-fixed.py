"""Entropy routing at a fixed threshold on humaneval-infill 0-119, for scripts/infill-router.sh: `python
scripts/infill-entropy-fixed.py RATE`. Its lines are shorter than the rate control's warm-up (`rate.WARMUP_TOKENS`),
so `r2r eval`'s rate-matched entropy routes them at its fixed warm-up threshold instead; this routes at the SLM's
entropy quantile at RATE on its own lines for these items ($OUT/test-infill/labels.parquet). Results go beside
the eval's, as entropy-fixed@RATE."""
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data import benchmarks
from roads_to_rome.eval.evaluate import run_system
from roads_to_rome.models import systems
from roads_to_rome.models.loading import load_pair
from roads_to_rome.routing.rate import threshold_at_rate

out = Path(os.environ.get("OUT", "runs/infill"))
rate = float(sys.argv[1])
entropy = torch.tensor(pq.read_table(out / "test-infill" / "labels.parquet").column("entropy").to_pylist())
threshold = threshold_at_rate(entropy, rate)
print(f"threshold {threshold:.4f} nats for {rate:.1%} of the SLM's own tokens")
slm, llm, tok = load_pair(None, None, "cpu", need_llm=True, dtype="auto", backend="llamacpp")
items = benchmarks.select(benchmarks.load("humaneval-infill"), "0-119")
engine = systems.routed(slm, llm, tok, "entropy", threshold, seed=0)
spec = systems.System(f"entropy-fixed@{rate:g}", "entropy")
run_system("humaneval-infill", items, spec, engine, SamplingParams(max_new_tokens=64, stop=("\n",)),
           out / "eval" / "humaneval-infill", 1)
