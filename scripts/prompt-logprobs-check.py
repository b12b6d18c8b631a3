"""The prompt's log-probabilities on the default pair, as lm-evaluation-harness asks for them (its loglikelihood
request: token-id prompts, `echo`, `max_tokens: 1`, `logprobs: 1`), through the server in this process with the
openai client on loopback. For GSM8K dev items, the context `Question: ...\\nAnswer:` and the reference's worked
solution as the continuation (calculator notes `<<...>>` taken out); the SLM alone, the LLM alone and R2R (the
shipped router) score each, the order rotating. Prints, for each way, the continuation's negative log-likelihood
per token and its perplexity, the share of continuation tokens R2R's router sent to the LLM, the items whose
continuation is each way's greedy choice throughout (lm-eval's `is_greedy`) and seconds per request; and paired
over items, the Wilcoxon signed-rank test of R2R's per-token NLL against each model's alone.

    python scripts/prompt-logprobs-check.py --items 100 --out runs/prompt-logprobs.json
    python scripts/prompt-logprobs-check.py --items 20 --llm http://127.0.0.1:8000   # `make vllm-server`
"""

import argparse
import json
import math
import re
import time

import openai
from scipy.stats import wilcoxon

from roads_to_rome.data.benchmarks import gsm8k
from roads_to_rome.hardware import measured_on
from roads_to_rome.models import EngineConfig, load_engine
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app

parser = argparse.ArgumentParser()
parser.add_argument("--items", type=int, default=100, help="GSM8K items 0..N-1")
parser.add_argument("--out", help="JSON file for every row and the summary")
parser.add_argument("--llm", help="the LLM: a model spec, or a vLLM server's address (default: the pair's own)")
args = parser.parse_args()

engine = load_engine(EngineConfig(llm=args.llm))
tokenizer = engine.tokenizer
ways = {"slm": {"r2r_policy": "slm"}, "llm": {"r2r_policy": "llm"}, "r2r": {}}
rows = []
with BackgroundServer(create_app(engine, "r2r", Limits(max_batch=1))) as server:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    for k, item in enumerate(gsm8k()[: args.items]):
        context = tokenizer.encode(f"Question: {item['question']}\nAnswer:", add_special_tokens=False)
        solution = re.sub(r"<<[^>]*>>", "", item["solution"])
        continuation = tokenizer.encode(" " + solution, add_special_tokens=False)
        names = list(ways)
        for name in names[k % len(names):] + names[: k % len(names)]:
            start = time.perf_counter()
            out = client.completions.create(model="r2r", prompt=[context + continuation], echo=True, max_tokens=1,
                                            logprobs=1, temperature=0, extra_body=ways[name])
            seconds = time.perf_counter() - start
            choice = out.choices[0]
            scores = choice.logprobs.token_logprobs[len(context): len(context) + len(continuation)]
            tops = choice.logprobs.top_logprobs[len(context): len(context) + len(continuation)]
            sources = out.model_extra["r2r"]["prompt_sources"][len(context) - 1:]  # (entry t scores token t + 1)
            rows.append({"k": k, "way": name, "tokens": len(continuation), "nll": -sum(scores),
                         "greedy": all(s >= max(top.values()) for s, top in zip(scores, tops)),
                         "llm_tokens": sources.count("llm"), "seconds": seconds})
        print(f"{k}: " + ", ".join(f"{r['way']} {r['nll'] / r['tokens']:.3f}" for r in rows[-len(ways):]), flush=True)

summary = {}
for name in ways:
    mine = [r for r in rows if r["way"] == name]
    tokens = sum(r["tokens"] for r in mine)
    nll = sum(r["nll"] for r in mine) / tokens
    summary[name] = {"nll_per_token": nll, "perplexity": math.exp(nll), "items": len(mine),
                     "greedy_items": sum(r["greedy"] for r in mine),
                     "llm_share": sum(r["llm_tokens"] for r in mine) / tokens,
                     "seconds_per_request": sum(r["seconds"] for r in mine) / len(mine)}
per_item = {name: [r["nll"] / r["tokens"] for r in sorted((r for r in rows if r["way"] == name), key=lambda r: r["k"])]
            for name in ways}
for other in ("slm", "llm"):
    lower = sum(a < b for a, b in zip(per_item["r2r"], per_item[other]))
    summary[f"r2r_vs_{other}"] = {"items_r2r_lower": lower, "items": len(per_item["r2r"]),
                                  "wilcoxon_p": float(wilcoxon(per_item["r2r"], per_item[other]).pvalue)}
summary["settings"] = {**vars(args), **measured_on(engine), "policy": engine.policy.name}
print(json.dumps(summary, indent=1))
if args.out:
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
