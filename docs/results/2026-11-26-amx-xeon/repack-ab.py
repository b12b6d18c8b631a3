"""llama.cpp's repacked layouts (extra buffer types) on and off, alternating, with set-up's AMX-less build: the 1.5B's
step over k new tokens on a 300-token cache, as `r2r bench steps` measures it. One process; median of 5 per round."""

import json
import statistics
import time

import torch

from roads_to_rome.backends import llamacpp
from roads_to_rome.models import DEFAULT_LLM, gguf_path

results, default_params = {}, llamacpp.model_params
for _ in range(3):
    for extra in (True, False):
        params = default_params()
        params.use_extra_bufts = extra
        llamacpp.model_params = lambda params=params: params  # this round's setting for the backend's load
        backend = llamacpp.LlamaCppBackend(gguf_path(DEFAULT_LLM), name="llm", n_ctx=4096, max_rows=2)
        for k in (1, 4, 8):
            cache = backend.new_cache()
            ids = torch.randint(0, 1000, (1, 300 + k))
            mask = torch.ones_like(ids)
            backend.forward(cache, ids[:, :300], mask)
            times = []
            for _ in range(5):
                ids[:, 300:] = torch.randint(0, 1000, (1, k))
                start = time.perf_counter()
                backend.forward(cache, ids[:, 300:], mask)
                times.append((time.perf_counter() - start) * 1000)
                backend.truncate(cache, 300)
            results.setdefault(f"extra_bufts={extra} k={k}", []).append(round(statistics.median(times), 1))
        del backend
print(json.dumps(results, indent=1))
