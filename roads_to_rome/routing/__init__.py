"""Routing: which tokens the LLM writes. `policies` (the rules), `router` (the learned one's network).

The names below import no torch, so the command line can offer them before loading anything."""

POLICIES = ("router", "entropy", "random", "slm", "llm")
DEFAULT_ENTROPY_THRESHOLD = 0.8  # nats
DEFAULT_RANDOM_RATE = 0.1
