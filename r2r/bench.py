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


def overhead(slm: str | None, device: str, n_tokens: int, rounds: int) -> dict:
    from r2r.engine import Engine, SamplingParams
    from r2r.models import load_pair

    slm_backend, _, tokenizer = load_pair(slm, None, device, need_llm=False)
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
            "ratio": e / b}
