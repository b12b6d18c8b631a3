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
    from r2r.datasets import gsm8k, gsm8k_prompt
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

    def summary(gens, seconds):
        tokens = sum(len(g.token_ids) for g in gens)
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "llm_rate": sum(g.llm_tokens for g in gens) / tokens}

    seq, bat = summary(one_by_one, sequential_s), summary(batched, batched_s)
    return {"batch_size": batch_size, "dtype": dtype, "device": str(slm_backend.device), "threshold": threshold,
            "sequential": seq, "batched": bat, "speedup": bat["tokens_per_s"] / seq["tokens_per_s"]}
