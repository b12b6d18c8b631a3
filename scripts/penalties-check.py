"""R2R on the default pair with and without penalties, side by side: GSM8K dev prompts one at a time, greedy,
each prompt run both ways in turn (the order alternating), with the shipped router and the engine's defaults
(verification at 1 nat). Prints, per system, tokens/s, seconds per decode step, the LLM rate, the share of repeated
4-grams in the outputs, outputs cut at the token limit and correct answers (with the exact sign test on the items
only one gets right); and the time spent applying the penalties, measured around each call.

    python scripts/penalties-check.py --prompts 20 --tokens 256 --out runs/penalties-check.json
"""

import argparse
import json
import time

from roads_to_rome.core import request as request_module
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data.answers import extract_math_answer, math_equal
from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
from roads_to_rome.data.stats import sign_test
from roads_to_rome.hardware import measured_on
from roads_to_rome.models import EngineConfig, load_engine

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=20, help="GSM8K items 0..N-1")
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--presence", type=float, default=0.5)
parser.add_argument("--frequency", type=float, default=0.3)
parser.add_argument("--repetition", type=float, default=1.1)
parser.add_argument("--backend", default="auto")
parser.add_argument("--out", help="JSON file for every row and the summary")
args = parser.parse_args()

penalty_seconds = [0.0]
adjust_logits = request_module.adjust_logits  # where a sequence's penalties are applied (`Sequence.logits_at`)


def timed_penalties(*a, **kw):
    start = time.perf_counter()
    out = adjust_logits(*a, **kw)
    penalty_seconds[0] += time.perf_counter() - start
    return out


request_module.adjust_logits = timed_penalties

engine = load_engine(EngineConfig(backend=args.backend))
systems = {"plain": SamplingParams(max_new_tokens=args.tokens),
           "penalised": SamplingParams(max_new_tokens=args.tokens, presence_penalty=args.presence,
                                       frequency_penalty=args.frequency, repetition_penalty=args.repetition)}
items = gsm8k()[: args.prompts]
engine.generate([engine.prompts.chat("Hi")], SamplingParams(max_new_tokens=4))  # warm-up


def repeated_share(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


rows = []
for k, item in enumerate(items):
    prompt = engine.prompts.chat(gsm8k_prompt(item))
    order = list(systems) if k % 2 == 0 else list(reversed(systems))
    for name in order:
        penalty_seconds[0] = 0.0
        start = time.perf_counter()
        gen = engine.generate([prompt], systems[name])[0]
        seconds = time.perf_counter() - start
        rows.append({"id": item["id"], "system": name, "tokens": len(gen.token_ids), "seconds": seconds,
                     "steps": gen.timings.steps, "llm_tokens": gen.llm_tokens, "finish_reason": gen.finish_reason,
                     "repeated_4grams": repeated_share(gen.token_ids), "penalty_seconds": penalty_seconds[0],
                     "correct": math_equal(extract_math_answer(gen.text), item["answer"])})
    print(f"item {item['id']}: " + ", ".join(f"{r['system']} {r['tokens']} tokens {r['seconds']:.1f} s "
                                            f"{'right' if r['correct'] else 'wrong'}" for r in rows[-2:]), flush=True)

summary = {}
for name in systems:
    mine = [r for r in rows if r["system"] == name]
    tokens, seconds, steps = (sum(r[key] for r in mine) for key in ("tokens", "seconds", "steps"))
    summary[name] = {"tokens": tokens, "tokens_per_s": tokens / seconds, "ms_per_step": 1000 * seconds / steps,
                     "llm_rate": sum(r["llm_tokens"] for r in mine) / tokens,
                     "repeated_4grams": sum(r["repeated_4grams"] for r in mine) / len(mine),
                     "cut_at_limit": sum(r["finish_reason"] == "length" for r in mine),
                     "correct": sum(r["correct"] for r in mine),
                     "penalty_share_of_time": sum(r["penalty_seconds"] for r in mine) / seconds,
                     "penalty_us_per_token": 1e6 * sum(r["penalty_seconds"] for r in mine) / tokens}
by_item = {(r["id"], r["system"]): r["correct"] for r in rows}
only_plain = sum(by_item[(i["id"], "plain")] and not by_item[(i["id"], "penalised")] for i in items)
only_penalised = sum(by_item[(i["id"], "penalised")] and not by_item[(i["id"], "plain")] for i in items)
summary["paired"] = {"items": len(items), "only_plain_right": only_plain, "only_penalised_right": only_penalised,
                     "sign_test_p": sign_test(only_plain, only_penalised),
                     "tokens_per_s_ratio": summary["penalised"]["tokens_per_s"] / summary["plain"]["tokens_per_s"],
                     "ms_per_step_ratio": summary["penalised"]["ms_per_step"] / summary["plain"]["ms_per_step"]}
summary["settings"] = {**vars(args), **measured_on(engine)}
print(json.dumps(summary, indent=1))
if args.out:
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
