"""Systems by name: the one place that turns a way of decoding, and its settings, into an `Engine`.

Two vocabularies name them, and both end here:
- the systems `r2r eval --systems` and the benches compare (`System`): slm and llm (that model alone, writing every
  token), r2r (the router), entropy and random (at a target LLM rate), spec (the SLM drafts, the LLM checks every
  k tokens strictly: lossless speculative decoding);
- a routing policy as the command line and the server name it (`routed`): router, entropy, random, slm or llm in the
  pair, at a threshold, with verification and deferral settings.

Loading the models is `loading.py`'s; this module only puts loaded ones together."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.llm_calls import Deferral
from roads_to_rome.core.sampling import VERIFY_OFF, Verify, parse_verify
from roads_to_rome.errors import R2RError
from roads_to_rome.routing import policies
from roads_to_rome.routing.policies import RoutingPolicy

SYSTEMS = ("slm", "llm", "r2r", "entropy", "random", "spec")
ROUTED = ("r2r", "entropy", "random")  # the systems verification applies to
# The fixed threshold (nats) a request aiming at an LLM rate with entropy routing uses until it has scores enough to
# aim by (`rate.WARMUP_TOKENS`).
ENTROPY_WARMUP_THRESHOLD = 1.0


@dataclass(frozen=True)
class System:
    """One system of a comparison, named as in its results file: "slm", "r2r", "entropy@0.15", "r2r+verify=1",
    "spec+k=4"..."""

    name: str
    kind: str  # one of SYSTEMS
    value: float | None = None  # r2r: threshold; entropy/random: target LLM rate; spec: draft tokens per check
    # entropy aiming at a rate: its threshold (nats) until a request has scores enough to aim by, and for answers
    # shorter than that throughout (None: ENTROPY_WARMUP_THRESHOLD)
    warmup: float | None = None
    verify: Verify = VERIFY_OFF
    max_unverified: int | None = None

    def __post_init__(self):
        if self.kind not in SYSTEMS:
            raise R2RError(f"unknown system {self.kind!r}: use one of {', '.join(SYSTEMS)}")
        object.__setattr__(self, "verify", parse_verify(self.verify))

    @property
    def needs_llm(self) -> bool:
        return self.kind != "slm"

    @property
    def target_rate(self) -> float | None:
        """The LLM rate each request aims at (entropy: its threshold follows the request's own scores)."""
        return self.value if self.kind == "entropy" else None

    def with_verify(self, verify: Verify | str | float, max_unverified: int | None) -> System:
        """This routed system with verification on catch-up, named for it."""
        verify = parse_verify(verify)
        if not verify.on:
            return self
        suffix = f"+verify={verify}" + (f"+n={max_unverified}" if max_unverified else "")
        return dataclasses.replace(self, name=self.name + suffix, verify=verify, max_unverified=max_unverified)

    def engine(self, slm, llm, tokenizer, router_path: Path | None = None) -> Engine:
        """The engine for this system on loaded models (`llm` may be None for the SLM alone)."""
        if self.kind == "slm":
            return alone(slm, tokenizer, "slm")
        if self.kind == "llm":
            # The LLM alone, as the only model: its speed is the LLM's, not the LLM's plus an idle SLM's.
            return alone(llm, tokenizer, "llm")
        if self.kind == "spec":
            return routed(slm, llm, tokenizer, "slm", verify="strict", max_unverified=int(self.value))
        if self.kind == "r2r":
            if router_path is None:
                raise R2RError("the r2r system needs a trained router: pass --router-path (or leave r2r out of "
                               "--systems)")
            policy, threshold = "router", self.value
        elif self.kind == "entropy":
            policy, threshold = "entropy", ENTROPY_WARMUP_THRESHOLD if self.warmup is None else self.warmup
        else:  # random: its threshold is the rate it routes at
            policy, threshold = "random", self.value
        return routed(slm, llm, tokenizer, policy, threshold, router_path, seed=0, verify=self.verify,
                      max_unverified=self.max_unverified)


def routed(slm, llm, tokenizer, policy: str | RoutingPolicy, threshold: float | None = None,
           router_path: Path | None = None, seed: int | None = None, verify: Verify | str | float = "off",
           max_unverified: int | None = None, defer: Deferral | str = "off", overlap: bool = False,
           llm_threads: int | None = None) -> Engine:
    """The pair with a routing policy: by name (`policies.build`: router, entropy, random, slm, llm, at `threshold`,
    None: its own) or one already made. Without an LLM (the slm policy unverified), the SLM alone."""
    if not isinstance(policy, RoutingPolicy):
        policy = policies.build(policy, slm, threshold, router_path, seed)
    return Engine(slm, llm, tokenizer, policy, verify, max_unverified, defer, overlap, llm_threads)


def alone(model, tokenizer, role: str) -> Engine:
    """One model writing every token; its tokens count as `role`'s ("slm" or "llm")."""
    return Engine.alone(model, tokenizer, role)
