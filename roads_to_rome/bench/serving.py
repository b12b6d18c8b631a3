"""The OpenAI-compatible server under load: its own module, so that the other benchmarks need no serving
dependencies (a GPU box may have torch and transformers and nothing else).

For each deferral mode (lockstep routing first) and each number of clients, that many clients send the same
GSM8K dev prompts back to back until all are answered: aggregate throughput, each request's latency, and how
the LLM's calls were grouped. Greedy decoding gives every mode the same tokens, so the modes do the same work."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import numpy as np
import openai

from roads_to_rome.bench.measure import kernels
from roads_to_rome.core.engine import DEFAULT_VERIFY, Counters
from roads_to_rome.core.llm_calls import Deferral
from roads_to_rome.eval.tasks import gsm8k, gsm8k_prompt
from roads_to_rome.models import load_pair, systems
from roads_to_rome.models.loading import choose_policy
from roads_to_rome.progress import QUIET
from roads_to_rome.routing import policies
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.server import Limits, create_app


def serving(slm: str | None, llm: str | None, device: str, dtype: str, clients: list[int], n_tokens: int,
            requests: int, modes: list[str], rule: Deferral = Deferral(), backend: str = "auto",
            threshold: float | None = None, rounds: int = 1, progress=QUIET) -> dict:
    """The server with the pair's default policy (the shipped router for the default pair) and verification: for
    each of `modes` and each count in `clients`, `requests` GSM8K dev prompts sent by that many clients; `rounds`
    times over, the modes taking turns (a machine's speed drifts between minutes: alternating spreads the drift
    over all of them)."""
    rows = max(clients)
    slm_backend, llm_backend, tokenizer = load_pair(slm, llm, device, dtype=dtype, backend=backend,
                                                    llama={"max_rows": rows, "n_ctx": rows * 4096})
    kind, router_path = choose_policy(None, None, slm)
    policy = policies.build(kind, slm_backend, threshold, router_path)
    prompts = [gsm8k_prompt(item) for item in gsm8k()[:requests]]
    engines = {mode: systems.routed(slm_backend, llm_backend, tokenizer, policy, verify=DEFAULT_VERIFY,
                                    defer=dataclasses.replace(rule, mode=mode)) for mode in modes}
    answered: dict[str, list] = {}  # "mode xN" -> per round: (answers, seconds, what the engine counted)
    task = progress.add_task("serving", total=rounds * len(modes) * len(clients) * requests)
    for _ in range(rounds):
        for mode, engine in engines.items():
            with BackgroundServer(create_app(engine, "r2r", Limits(max_batch=rows))) as server:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=3600)

                def ask(prompt):
                    start = time.perf_counter()
                    out = client.chat.completions.create(model="r2r", temperature=0, max_tokens=n_tokens,
                                                         messages=[{"role": "user", "content": prompt}])
                    progress.advance(task)
                    return out.usage.completion_tokens, out.usage.model_extra["llm_tokens"], \
                        time.perf_counter() - start

                ask(prompts[0][:50])  # warm-up
                for count in clients:
                    before = dataclasses.replace(engine.counters)
                    start = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(count) as pool:
                        answers = list(pool.map(ask, prompts))
                    answered.setdefault(f"{mode} x{count}", []).append(
                        (answers, time.perf_counter() - start, engine.counters - before))
    runs = {}
    for key, per_round in answered.items():
        mode, count = key.split(" x")
        counted = sum((r[2] for r in per_round), Counters())
        runs[key] = {"defer": mode, "clients": int(count),
                     **load_figures([a for r in per_round for a in r[0]], sum(r[1] for r in per_round)),
                     "tokens_per_s_rounds": [sum(a[0] for a in r[0]) / r[1] for r in per_round],
                     "llm_calls": counted.llm_calls, "steps": counted.steps,
                     "routed_rows_per_call": counted.routed_rows_per_call}
    baseline = modes[0]
    for run in runs.values():
        base = runs[f"{baseline} x{run['clients']}"]
        run["x_throughput"] = run["tokens_per_s"] / base["tokens_per_s"]
        run["x_p95"] = run["p95_s"] / base["p95_s"]
    return {"clients": clients, "requests": requests, "tokens": n_tokens, "rounds": rounds, "dtype": dtype,
            "backend": backend, "device": str(slm_backend.device),
            "kernels": kernels(slm=slm_backend, llm=llm_backend), "policy": policy.name, "verify": DEFAULT_VERIFY,
            "defer_group": rule.group, "defer_steps": rule.steps, "baseline": baseline, "runs": runs}


def load_figures(answers: list[tuple[int, int, float]], seconds: float) -> dict:
    """Aggregate throughput of (tokens, LLM tokens, latency) per request over `seconds`, and the latencies'
    median and 95th percentile."""
    tokens = sum(a[0] for a in answers)
    latencies = np.array([a[2] for a in answers])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "llm_rate": sum(a[1] for a in answers) / max(tokens, 1),
            "p50_s": float(np.percentile(latencies, 50)), "p95_s": float(np.percentile(latencies, 95))}
