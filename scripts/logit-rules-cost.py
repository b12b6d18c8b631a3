"""What shaping a row's logits costs per call, on the default pair's SLM logits (151,936 ids) at each position of its
greedy answer to a GSM8K question, on one thread (the engine's thread shapes one row at a time):

- `adjust_logits` for each of a request's settings alone and all together, beside the call that changes nothing
  (it runs at every token a model writes and every token the LLM checks);
- `sampling_probs` (temperature 0.6, top-p 0.95, as Qwen suggests for its reasoning models) with and without min-p,
  beside top-p by sorting whole rows (what it did before ranking only the likeliest tokens), with the largest
  difference between the two distributions.

Median microseconds over the answer's positions, `--repeats` rounds.

    python scripts/logit-rules-cost.py --out runs/logit-rules-cost.json
"""

import argparse
import json
import statistics
import time

import torch

from roads_to_rome.core.sampling import LogitRules, SamplingParams, adjust_logits, sampling_probs
from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
from roads_to_rome.hardware import measured_on
from roads_to_rome.models import EngineConfig, load_engine

parser = argparse.ArgumentParser()
parser.add_argument("--positions", type=int, default=64, help="answer tokens whose logits are shaped")
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--out")
args = parser.parse_args()

engine = load_engine(EngineConfig())
prompt = engine.prompts.chat(gsm8k_prompt(gsm8k()[0]))
answer = engine.generate([prompt], SamplingParams(max_new_tokens=args.positions, ignore_eos=True))[0].token_ids
rows, _ = engine.slm.forward_sequence(prompt + answer[:-1], start=len(prompt) - 1)
rows = rows.float()
torch.set_num_threads(1)
eos = sorted(engine.eos_ids)
vocab = rows.shape[-1]
spread = tuple(range(0, vocab, vocab // 1000))[:1000]
settings = {
    "nothing": {},
    "logit_bias (10 tokens)": {"logit_bias": {t: -100.0 for t in range(10)}},
    "logit_bias (1000 tokens)": {"logit_bias": {t: 2.0 for t in spread}},
    "allowed_token_ids (1000)": {"allowed_token_ids": spread},
    "min_tokens (end tokens held back)": {"min_tokens": len(answer) + 1, "max_new_tokens": len(answer) + 1},
    "penalties (presence, frequency, repetition)": {"presence_penalty": 0.5, "frequency_penalty": 0.3,
                                                    "repetition_penalty": 1.1},
    "all of them": {"logit_bias": {t: 2.0 for t in range(10)}, "allowed_token_ids": spread,
                    "min_tokens": len(answer) + 1, "max_new_tokens": len(answer) + 1, "presence_penalty": 0.5,
                    "frequency_penalty": 0.3, "repetition_penalty": 1.1},
}


def median_us(call) -> float:
    """The median over rounds of the mean time of `call(i)` across the answer's positions."""
    for i in range(len(rows)):
        call(i)
    rounds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for i in range(len(rows)):
            call(i)
        rounds.append((time.perf_counter() - start) / len(rows))
    return 1e6 * statistics.median(rounds)


def sorted_top_p(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-p by sorting whole rows: the reference the ranked version is timed and checked against."""
    logits = logits / params.temperature
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= params.top_p
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf"))).softmax(-1)


results = {}
for name, fields in settings.items():
    params = SamplingParams(**fields)
    params.validate()
    rules = LogitRules.of(params, prompt, eos)
    results[name] = {"us": median_us(lambda i: adjust_logits(rows[i], rules, answer[:i]))}
nucleus = SamplingParams(temperature=0.6, top_p=0.95)
results["top-p by sorting whole rows"] = {"us": median_us(lambda i: sorted_top_p(rows[i : i + 1], nucleus))}
results["sampling_probs (top-p 0.95)"] = {
    "us": median_us(lambda i: sampling_probs(rows[i : i + 1], nucleus)),
    "max_difference": max(float((sampling_probs(rows[i : i + 1], nucleus) - sorted_top_p(rows[i : i + 1], nucleus))
                                .abs().max()) for i in range(len(rows)))}
with_min_p = SamplingParams(temperature=0.6, top_p=0.95, min_p=0.05)
results["sampling_probs (top-p 0.95, min-p 0.05)"] = {"us": median_us(lambda i: sampling_probs(rows[i : i + 1],
                                                                                               with_min_p))}
kept = [int((sampling_probs(rows[i : i + 1], nucleus) > 0).sum()) for i in range(len(rows))]
ratio = results["top-p by sorting whole rows"]["us"] / results["sampling_probs (top-p 0.95)"]["us"]
for name, row in results.items():
    print(f"{name:45s} {row['us']:9.1f} us" + (f"  (max difference {row['max_difference']:.1e})"
                                                  if "max_difference" in row else ""))
print(f"top-p: ranked {ratio:.1f}x faster than sorting whole rows; nucleus sizes: median "
      f"{statistics.median(kept)}, max {max(kept)}")
summary = {"results": results, "top_p_speedup": ratio, "nucleus_sizes": kept,
           "settings": {**vars(args), "vocab": vocab, "torch": torch.__version__, **measured_on(engine)}}
if args.out:
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
