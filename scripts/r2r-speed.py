"""Plain R2R's tokens/s, and with verification at 1 nat (llama.cpp, the shipped router, GSM8K dev prompts one at a
time, greedy) at whatever commit of the package is importable: for before/after checks of the decode loop, e.g.

    git worktree add /tmp/before <commit>
    for i in 1 2 3; do
      PYTHONPATH=/tmp/before python scripts/r2r-speed.py; PYTHONPATH=. python scripts/r2r-speed.py
    done

Commits before the package was renamed `roads_to_rome` (the `r2r` layout) work too. Alternating runs in one session
give the noise band; nothing else should run meanwhile."""

import argparse
import importlib.util
import json
import time

if importlib.util.find_spec("r2r") is not None:  # a commit of the flat `r2r` package on PYTHONPATH
    import r2r as package
    from r2r import policies
    from r2r.engine import Engine, SamplingParams
    from r2r.models import load_pair
    from r2r.policies import router_path_for
    from r2r.tasks import gsm8k, gsm8k_prompt
else:  # the layout in sub-packages
    import roads_to_rome as package
    from roads_to_rome.core.engine import Engine
    from roads_to_rome.core.sampling import SamplingParams
    from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
    from roads_to_rome.models import load_pair, router_path_for
    from roads_to_rome.routing import policies

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=4)
parser.add_argument("--tokens", type=int, default=128)
parser.add_argument("--verify", default="off,1", help="comma-separated verification settings, one run each")
parser.add_argument("--backend", action="append", help="the pair's backends, as r2r's --backend (llamacpp, torch, "
                    "slm=llamacpp,llm=torch...); repeat it for several, each run in turn (default: llamacpp)")
args = parser.parse_args()

prompts, pairs = None, {}
for backend, verify in [(b, v) for b in args.backend or ["llamacpp"] for v in args.verify.split(",")]:
    if backend not in pairs:
        pairs = {backend: load_pair(None, None, "cpu", backend=backend)}  # (the last pair goes)
    slm, llm, tokenizer = pairs[backend]
    policy = policies.build("router", slm, None, router_path_for(None, None))
    engine = Engine(slm, llm, tokenizer, policy, verify=verify)
    prompts = prompts or [engine.prompts.chat(gsm8k_prompt(item)) for item in gsm8k()[: args.prompts]]
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
    tokens = llm_tokens = rollbacks = discarded = calls = steps = slm_s = llm_s = 0
    start = time.perf_counter()
    for p in prompts:
        gen = engine.generate([p], SamplingParams(max_new_tokens=args.tokens))[0]
        tokens, llm_tokens = tokens + len(gen.token_ids), llm_tokens + gen.llm_tokens
        rollbacks, discarded = rollbacks + gen.rollbacks, discarded + gen.discarded
        calls += gen.timings.llm_calls
        steps, slm_s, llm_s = steps + gen.timings.steps, slm_s + gen.timings.slm_s, llm_s + gen.timings.llm_s
    seconds = time.perf_counter() - start
    print(json.dumps({"package": package.__file__, "backend": backend, "verify": verify, "tokens": tokens,
                      "llm_rate": round(llm_tokens / tokens, 4), "llm_calls": calls, "rollbacks": rollbacks,
                      "discarded": discarded, "steps": steps,
                      "slm_s": round(slm_s, 2), "llm_s": round(llm_s, 2), "seconds": round(seconds, 2),
                      "tokens_per_s": round(tokens / seconds, 2)}),
          flush=True)
