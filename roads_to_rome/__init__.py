"""R2R (Roads to Rome): token-level routing between a small and a large language model.

The SLM writes; a router sends the tokens where the SLM would go astray to the LLM. One example,
on the default pair (`r2r models prepare` first):

    from roads_to_rome import SamplingParams, load_engine

    engine = load_engine()  # the default pair, the shipped router, verification at 1 nat
    prompt = engine.prompts.chat("What is 17 * 23? Finish with 'The answer is N'.")
    result = engine.generate([prompt], SamplingParams(max_new_tokens=128))[0]
    print(result.text, f"{result.llm_rate:.0%} of the tokens from the LLM")

The names below load on first use, so importing the package (and `r2r --help`) costs no torch import.
"""

from __future__ import annotations

import importlib

from roads_to_rome import hardware

hardware.prefer_reproducible_mkl_on_amd()  # (read by MKL when torch loads: so before anything here imports torch)

_PUBLIC = {
    "Engine": "roads_to_rome.core.engine",
    "Generation": "roads_to_rome.core.request",
    "Request": "roads_to_rome.core.request",
    "SamplingParams": "roads_to_rome.core.sampling",
    "Deferral": "roads_to_rome.core.llm_calls",
    "load_engine": "roads_to_rome.models",
    "EngineConfig": "roads_to_rome.models",
    "load_pair": "roads_to_rome.models",
    "load_model": "roads_to_rome.models",
    "RoutingPolicy": "roads_to_rome.routing.policies",
    "NeuralPolicy": "roads_to_rome.routing.policies",
    "EntropyPolicy": "roads_to_rome.routing.policies",
    "RandomPolicy": "roads_to_rome.routing.policies",
    "AlwaysSLM": "roads_to_rome.routing.policies",
    "AlwaysLLM": "roads_to_rome.routing.policies",
    "R2RError": "roads_to_rome.errors",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'roads_to_rome' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__():
    return __all__
