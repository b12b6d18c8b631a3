"""Where a unit-test sweep's time goes: the tests' tiny Qwen2 pair on torch, the entropy policy, verification at
1 nat, 4 prompts of 24 tokens batched and each alone, a few rounds under cProfile; prints ms per token and the
functions that took the most time of their own.

    .venv/bin/python scripts/profile-tiny-sweep.py [ROUNDS]
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from tiny import tiny_model, tiny_tokenizer  # noqa: E402

from roads_to_rome.backends.torch_backend import TorchBackend  # noqa: E402
from roads_to_rome.core.engine import Engine  # noqa: E402
from roads_to_rome.core.sampling import SamplingParams  # noqa: E402
from roads_to_rome.routing.policies import EntropyPolicy  # noqa: E402

PROMPTS = ["What is 48 / 2?", "def add(a, b):", "Bonjour! Paris is the capital of which country? Explain.",
           "Natalia sold clips to 48 of her friends in April."]  # test_defer's

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
tokenizer = tiny_tokenizer()
slm = TorchBackend(tiny_model(tokenizer, hidden=32, seed=0), name="tiny-slm")
llm = TorchBackend(tiny_model(tokenizer, hidden=64, seed=1), name="tiny-llm")
engine = Engine(slm, llm, tokenizer, EntropyPolicy(4.0), verify=1.0)
prompts = [engine.prompts.chat(p) for p in PROMPTS]
params = SamplingParams(max_new_tokens=24)
engine.generate(prompts, params)  # warm-up
tokens, profile, start = 0, cProfile.Profile(), time.perf_counter()
profile.enable()
for _ in range(rounds):
    tokens += sum(len(g.token_ids) for g in engine.generate(prompts, params))
    tokens += sum(len(engine.generate([p], params)[0].token_ids) for p in prompts)
profile.disable()
seconds = time.perf_counter() - start
print(f"{tokens} tokens in {seconds:.2f} s: {1000 * seconds / tokens:.1f} ms a token (under cProfile)")
pstats.Stats(profile).sort_stats("tottime").print_stats(14)
