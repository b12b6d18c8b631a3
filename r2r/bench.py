"""Benchmarks: each compares things measured side by side in one run (absolute times drift here)."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

BENCH_PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Explain step by step."
)


@torch.inference_mode()
def bare_loop(model, prompt_ids: list[int], n_tokens: int) -> float:
    """The floor for any engine: the SLM's forward with its KV cache and argmax, nothing else. Returns tokens/s."""
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt_ids], device=model.device)
    start = time.perf_counter()
    for _ in range(n_tokens):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        ids = logits[:, -1].argmax(-1, keepdim=True)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return n_tokens / (time.perf_counter() - start)


def phase(results: list[tuple[int, int]], seconds: float) -> dict:
    """Aggregate throughput of (tokens, LLM tokens) per request over `seconds` of wall time."""
    tokens = sum(r[0] for r in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "llm_rate": sum(r[1] for r in results) / max(tokens, 1)}


def overhead(slm: str | None, device: str, dtype: str, n_tokens: int, rounds: int) -> dict:
    from r2r.engine import Engine, SamplingParams
    from r2r.models import load_pair

    slm_backend, _, tokenizer = load_pair(slm, None, device, need_llm=False, dtype=dtype)
    engine = Engine(slm_backend, None, tokenizer)
    prompt_ids = engine.encode_chat(BENCH_PROMPT)
    params = SamplingParams(max_new_tokens=n_tokens, ignore_eos=True)
    bare_loop(slm_backend.model, prompt_ids, 8)  # warm-up
    bare, eng = [], []
    for _ in range(rounds):  # alternate, so drift in machine speed hits both alike
        bare.append(bare_loop(slm_backend.model, prompt_ids, n_tokens))
        gen = engine.generate([prompt_ids], params)[0]
        eng.append(len(gen.token_ids) / gen.timings.total_s)
    b, e = statistics.median(bare), statistics.median(eng)
    return {"tokens": n_tokens, "rounds": rounds, "device": str(slm_backend.device),
            "bare_runs": bare, "engine_runs": eng, "bare_tokens_per_s": b, "engine_tokens_per_s": e,
            "dtype": dtype, "ratio": e / b}


def batching(slm: str | None, llm: str | None, device: str, dtype: str, threshold: float, batch_size: int,
             n_tokens: int) -> dict:
    """R2R (entropy routing) on `batch_size` GSM8K dev prompts: one at a time vs all in one batch."""
    from r2r.benchmarks import gsm8k, gsm8k_prompt
    from r2r.engine import Engine, SamplingParams
    from r2r.models import load_pair
    from r2r.policies import EntropyPolicy

    slm_backend, llm_backend, tokenizer = load_pair(slm, llm, device, dtype=dtype)
    engine = Engine(slm_backend, llm_backend, tokenizer, EntropyPolicy(threshold))
    prompts = [engine.encode_chat(gsm8k_prompt(item)) for item in gsm8k()[:batch_size]]
    params = SamplingParams(max_new_tokens=n_tokens)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
    start = time.perf_counter()
    one_by_one = [engine.generate([p], params)[0] for p in prompts]
    sequential_s = time.perf_counter() - start
    start = time.perf_counter()
    batched = engine.generate(prompts, params)
    batched_s = time.perf_counter() - start

    seq = phase([(len(g.token_ids), g.llm_tokens) for g in one_by_one], sequential_s)
    bat = phase([(len(g.token_ids), g.llm_tokens) for g in batched], batched_s)
    return {"batch_size": batch_size, "dtype": dtype, "device": str(slm_backend.device), "threshold": threshold,
            "sequential": seq, "batched": bat, "speedup": bat["tokens_per_s"] / seq["tokens_per_s"]}


def serving(slm: str | None, llm: str | None, device: str, dtype: str, threshold: float, clients: int,
            n_tokens: int) -> dict:
    """The server on GSM8K dev prompts: `clients` requests one at a time, then the same ones concurrently."""
    import concurrent.futures

    import openai

    from r2r.benchmarks import gsm8k, gsm8k_prompt
    from r2r.engine import Engine
    from r2r.models import load_pair
    from r2r.policies import EntropyPolicy
    from r2r.server import BackgroundServer, Limits, create_app

    slm_backend, llm_backend, tokenizer = load_pair(slm, llm, device, dtype=dtype)
    engine = Engine(slm_backend, llm_backend, tokenizer, EntropyPolicy(threshold))
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
    return {"clients": clients, "dtype": dtype, "device": str(slm_backend.device), "threshold": threshold,
            **phases, "speedup": phases["concurrent"]["tokens_per_s"] / phases["one_at_a_time"]["tokens_per_s"]}


@torch.inference_mode()
def step_costs(slm: str | None, llm: str | None, device: str, dtype: str, context: int, new_tokens: list[int],
               repeats: int = 3) -> dict:
    """Milliseconds of one forward step per model, for k new tokens on top of a `context`-token cache
    (the numbers behind DESIGN §3's cost model: an SLM step, and an LLM catch-up over k tokens)."""
    from r2r.models import load_pair

    slm_backend, llm_backend, _ = load_pair(slm, llm, device, dtype=dtype)
    table = {}
    for role, backend in (("slm", slm_backend), ("llm", llm_backend)):
        cache = backend.new_cache()
        ids = torch.randint(0, min(1000, backend.vocab_size), (1, context + max(new_tokens)), device=backend.device)
        mask = torch.ones_like(ids)
        backend.forward(cache, ids[:, :context], mask)
        row = {}
        for k in new_tokens:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                backend.forward(cache, ids[:, context:context + k], mask)
                if backend.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1000)
                backend.truncate(cache, context)
            row[k] = statistics.median(times)
        table[role] = row
    return {"dtype": dtype, "device": str(slm_backend.device), "context": context, "ms": table}
