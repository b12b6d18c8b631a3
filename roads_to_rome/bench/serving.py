"""The OpenAI-compatible server under load: its own module, so that the other benchmarks need no serving
dependencies (a GPU box may have torch and transformers and nothing else)."""

from __future__ import annotations

import concurrent.futures
import time

import openai

from roads_to_rome.bench.measure import kernels, phase
from roads_to_rome.core.engine import Engine
from roads_to_rome.eval.tasks import gsm8k, gsm8k_prompt
from roads_to_rome.models import load_pair
from roads_to_rome.routing import policies
from roads_to_rome.serving.server import BackgroundServer, Limits, create_app


def serving(slm: str | None, llm: str | None, device: str, dtype: str, threshold: float, clients: int,
            n_tokens: int, backend: str = "auto") -> dict:
    """The server on GSM8K dev prompts: `clients` requests one at a time, then the same ones concurrently."""
    slm_backend, llm_backend, tokenizer = load_pair(slm, llm, device, dtype=dtype, backend=backend)
    engine = Engine(slm_backend, llm_backend, tokenizer, policies.build("entropy", threshold=threshold))
    prompts = [gsm8k_prompt(item) for item in gsm8k()[:clients]]
    with BackgroundServer(create_app(engine, "r2r", Limits(max_batch=clients))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=3600)

        def ask(prompt):
            out = client.chat.completions.create(model="r2r", messages=[{"role": "user", "content": prompt}],
                                                 temperature=0, max_tokens=n_tokens)
            return out.usage.completion_tokens, out.usage.model_extra["llm_tokens"]

        ask(prompts[0][:50])  # warm-up
        phases = {}
        for name, workers in (("one_at_a_time", 1), ("concurrent", clients)):
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(ask, prompts))
            phases[name] = phase(results, time.perf_counter() - start)
    return {"clients": clients, "dtype": dtype, "backend": backend, "device": str(slm_backend.device),
            "kernels": kernels(slm=slm_backend, llm=llm_backend), "threshold": threshold,
            **phases, "speedup": phases["concurrent"]["tokens_per_s"] / phases["one_at_a_time"]["tokens_per_s"]}
