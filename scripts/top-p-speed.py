"""R2R sampling on the default pair with top-p (temperature 0.6, top-p 0.95, as Qwen suggests for its reasoning
models), top-p ranking a row's likeliest tokens (now) against sorting whole rows (before), side by side: GSM8K dev
prompts one at a time, each run both ways in turn (the order alternating) with the same seed, the shipped router and
the engine's defaults. Both ways keep the same tokens, so the outputs must be the same token for token (checked);
prints tokens/s of each and their ratio.

    python scripts/top-p-speed.py --prompts 10 --tokens 200 --out runs/top-p-speed.json
"""

import argparse
import json
import time

import torch

from roads_to_rome.core import sampling
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
from roads_to_rome.hardware import measured_on
from roads_to_rome.models import EngineConfig, load_engine

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=10, help="GSM8K items 0..N-1")
parser.add_argument("--tokens", type=int, default=200)
parser.add_argument("--verify", default=None, help="the engine's verification setting (default: its own)")
parser.add_argument("--out", help="JSON file for every row and the summary")
args = parser.parse_args()

ranked = sampling.top_p_cut


def sorted_rows(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p as it was: sort every row whole."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


engine = load_engine(EngineConfig(verify=args.verify))
engine.generate([engine.prompts.chat("Hi")], SamplingParams(max_new_tokens=4))  # warm-up
ways = {"sorting whole rows": sorted_rows, "ranking the likeliest": ranked}
rows = []
for k, item in enumerate(gsm8k()[: args.prompts]):
    prompt = engine.prompts.chat(gsm8k_prompt(item))
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.6, top_p=0.95, seed=k)
    outputs = {}
    for name in (list(ways) if k % 2 == 0 else list(reversed(ways))):
        sampling.top_p_cut = ways[name]
        start = time.perf_counter()
        gen = engine.generate([prompt], params)[0]
        seconds = time.perf_counter() - start
        outputs[name] = gen.token_ids
        rows.append({"id": item["id"], "way": name, "tokens": len(gen.token_ids), "seconds": seconds,
                     "llm_tokens": gen.llm_tokens})
    same = len(set(map(tuple, outputs.values()))) == 1
    rows[-1]["same_tokens"] = rows[-2]["same_tokens"] = same
    print(f"item {item['id']}: " + ", ".join(f"{r['way']} {r['tokens']} tokens {r['seconds']:.1f} s"
                                            for r in rows[-2:]) + ("" if same else "  OUTPUTS DIFFER"), flush=True)
sampling.top_p_cut = ranked

summary = {}
for name in ways:
    mine = [r for r in rows if r["way"] == name]
    tokens, seconds = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
    summary[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                     "llm_rate": sum(r["llm_tokens"] for r in mine) / tokens}
summary["speedup"] = summary["ranking the likeliest"]["tokens_per_s"] / summary["sorting whole rows"]["tokens_per_s"]
summary["same_tokens_everywhere"] = all(r["same_tokens"] for r in rows)
summary["settings"] = {**vars(args), "verify": engine.verify, **measured_on(engine)}
print(json.dumps(summary, indent=1))
if args.out:
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
