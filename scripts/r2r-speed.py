"""Plain R2R's tokens/s (llama.cpp, the shipped router, GSM8K dev prompts one at a time, greedy) at whatever
commit of r2r is importable: for before/after checks of the decode loop, e.g.

    git worktree add /tmp/before <commit>
    for i in 1 2 3; do PYTHONPATH=/tmp/before python scripts/r2r-speed.py; python scripts/r2r-speed.py; done

Alternating runs in one session give the noise band; nothing else should run meanwhile."""

import argparse
import json
import time

import r2r

from roads_to_rome import models
from roads_to_rome.core.engine import Engine, SamplingParams
from roads_to_rome.models import load_pair

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=4)
parser.add_argument("--tokens", type=int, default=128)
args = parser.parse_args()

slm, llm, tokenizer = load_pair(None, None, "cpu", backend="llamacpp")
from roads_to_rome.routing import policies

if hasattr(policies, "build"):  # after the "One house" layout
    from roads_to_rome.eval.tasks import gsm8k, gsm8k_prompt

    policy = policies.build("router", slm, None, models.router_path_for(None, None))
else:  # before it
    from r2r.benchmarks import gsm8k, gsm8k_prompt

    from roads_to_rome.models import shipped_router

    policy = policies.router_policy(shipped_router(), slm, None)
engine = Engine(slm, llm, tokenizer, policy)
prompts = [engine.encode_chat(gsm8k_prompt(item)) for item in gsm8k()[: args.prompts]]
engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
tokens = llm_tokens = 0
start = time.perf_counter()
for p in prompts:
    gen = engine.generate([p], SamplingParams(max_new_tokens=args.tokens))[0]
    tokens, llm_tokens = tokens + len(gen.token_ids), llm_tokens + gen.llm_tokens
seconds = time.perf_counter() - start
print(json.dumps({"r2r": r2r.__file__, "tokens": tokens, "llm_rate": round(llm_tokens / tokens, 4),
                  "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2)}))
