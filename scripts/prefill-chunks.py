"""Prompt-reading (prefill) rate of each default model on llama.cpp at several chunk sizes: the measurement behind
the server's --prefill-chunk default.  python scripts/prefill-chunks.py"""
import time

import torch

from roads_to_rome.models import load_pair

slm, llm, tok = load_pair(None, None, "cpu", backend="llamacpp")
ids = torch.tensor([list(range(1000, 2024))])
for name, m in (("slm", slm), ("llm", llm)):
    for chunk in (16, 32, 64, 128, 256, 512):
        cache, t = m.new_cache(), time.perf_counter()
        for lo in range(0, 1024, chunk):
            m.forward(cache, ids[:, lo:lo+chunk], torch.ones(1, lo+chunk, dtype=torch.long))
        dt = time.perf_counter() - t
        print(name, chunk, f"{1024/dt:.0f} tok/s, {dt/(1024/chunk)*1000:.0f} ms per chunk", flush=True)
