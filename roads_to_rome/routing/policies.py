"""Routing policies: given what the SLM just computed, which rows should the LLM produce?

Every policy answers `route(logits, hidden, tokens, thresholds) -> (to_llm, scores)` for a batch
of rows: `logits` [B, V] are the SLM's next-token logits, `hidden` [B, H] its last-layer hidden
state, `tokens` [B] the token it chose, `thresholds` [B] per-row thresholds (None: the policy's
own). `scores` [B] is the number the decision was made on (kept as provenance); `to_llm` [B] is
True where the LLM takes over this token.

Policies also answer what the engine needs to know about them (whether they ever route to the
LLM, whether their threshold is a rate: rate.py maps a target LLM rate to a threshold); `build`
makes one by name, and `choose` picks the default: a router when there is one for the SLM, else
entropy.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from roads_to_rome.backends.cuda_graphs import capture, recorded_or_none
from roads_to_rome.errors import R2RError
from roads_to_rome.routing import DEFAULT_ENTROPY_THRESHOLD, DEFAULT_RANDOM_RATE, POLICIES
from roads_to_rome.routing.router import RouterCheckpoint, load_router, slm_identity


class RoutingPolicy:
    name = "policy"
    num_params = 0  # parameters the policy itself activates per token
    threshold: float | None = None  # route when the score is at least this (None: the policy has no dial)
    threshold_is_rate = False  # whether the threshold is the share of tokens routed (random draws), not a score
    alone: str | None = None  # "slm" or "llm": the model it sends every token to, as a request forcing it would

    @property
    def routes_to_llm(self) -> bool:
        """Whether it ever sends a token to the LLM."""
        return self.alone != "slm"

    def route(self, logits, hidden, tokens, thresholds=None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def check_threshold(self, value: float) -> float:
        """`value`, if it can be this policy's threshold (the one it is built with, or one request's); else an error
        that says what can. A policy without a dial takes none from a request, which would think it routed by it."""
        raise R2RError(f"the {self.name!r} policy sends every token to one model and has no threshold: leave the "
                       "threshold out, or route with router, entropy or random")


class OneModel(RoutingPolicy):
    """Every token to one model (`alone`), scored 1 where that is the LLM."""

    def route(self, logits, hidden, tokens, thresholds=None):
        to_llm = torch.full((tokens.shape[0],), self.alone == "llm", dtype=torch.bool, device=tokens.device)
        return to_llm, to_llm.float()


class AlwaysSLM(OneModel):
    name = alone = "slm"


class AlwaysLLM(OneModel):
    name = alone = "llm"


class RandomPolicy(RoutingPolicy):
    """Route each token with probability `rate`: the cost-matched baseline that knows nothing."""

    name = "random"
    threshold_is_rate = True

    def __init__(self, rate: float, seed: int | None = None):
        self.rate = self.check_threshold(rate)
        self.generator = torch.Generator().manual_seed(0 if seed is None else seed)

    @property
    def threshold(self) -> float:
        """The contract's dial, which here is the rate: a token is routed when its draw falls below it."""
        return self.rate

    def check_threshold(self, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise R2RError(f"random routing's threshold is its LLM rate and must be in [0, 1], got {value}")
        return value

    def route(self, logits, hidden, tokens, thresholds=None):
        draws = torch.rand(tokens.shape[0], generator=self.generator).to(tokens.device)
        return draws < (self.threshold if thresholds is None else thresholds), draws


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits), per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


class EntropyPolicy(RoutingPolicy):
    """Route when the SLM is unsure: entropy of its next-token distribution >= threshold (nats)."""

    name = "entropy"

    def __init__(self, threshold: float):
        self.threshold = self.check_threshold(threshold)

    def check_threshold(self, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise R2RError(f"entropy threshold is in nats and must be a finite number >= 0, got {value}")
        return value

    def route(self, logits, hidden, tokens, thresholds=None):
        scores = entropy(logits)
        return scores >= (self.threshold if thresholds is None else thresholds), scores


class NeuralPolicy(RoutingPolicy):
    """The learned router: sigmoid(router(hidden, embedding(token), logits)) >= threshold.

    On CUDA the router runs as a CUDA graph per batch shape (`graphs`, default on CUDA): eager, its two dozen small
    kernels cost a quarter of a graphed SLM step in launches alone, for a few microseconds of work."""

    name = "router"

    def __init__(self, checkpoint: RouterCheckpoint, embed, threshold: float | None = None, device="cpu",
                 graphs: bool | None = None):
        self.router = checkpoint.router.to(device).eval()
        self.embed = embed  # the SLM's own frozen token-embedding lookup
        self.threshold = self.check_threshold(checkpoint.threshold if threshold is None else threshold)
        self.num_params = sum(p.numel() for p in self.router.parameters())
        self.graphs = torch.device(device).type == "cuda" if graphs is None else graphs
        self.captured: dict[tuple, tuple] = {}  # input shapes and dtypes -> (graph, input buffers, scores buffer)

    @property
    def identity(self) -> dict:
        """Which router this is, for results files that must not mix two routers' runs (hashed on
        demand: generating and serving never ask)."""
        weights = b"".join(t.detach().cpu().float().numpy().tobytes() for t in self.router.state_dict().values())
        return {"weights_sha256": hashlib.sha256(weights).hexdigest()[:16], "threshold": self.threshold}

    def check_threshold(self, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise R2RError(f"router threshold is a probability and must be in [0, 1], got {value}")
        return value

    @torch.inference_mode()
    def route(self, logits, hidden, tokens, thresholds=None):
        graphed = self.graphs and logits.is_cuda
        scores = self._graphed_scores(logits, hidden, tokens) if graphed else self._scores(logits, hidden, tokens)
        return scores >= (self.threshold if thresholds is None else thresholds), scores

    def _scores(self, logits, hidden, tokens):
        return torch.sigmoid(self.router(hidden, self.embed(tokens), logits))

    def _graphed_scores(self, logits, hidden, tokens):
        key = tuple((tuple(t.shape), t.dtype) for t in (logits, hidden, tokens))
        if key in self.captured:
            graph, inputs, scores = self.captured[key]
            for buffer, value in zip(inputs, (logits, hidden, tokens)):
                buffer.copy_(value)  # device to device: nothing waits for the host
            graph.replay()
            return scores.clone()  # the next replay overwrites the buffer
        inputs = tuple(t.clone() for t in (logits, hidden, tokens))
        recorded = recorded_or_none(lambda: capture(lambda: self._scores(*inputs)), "router")
        if recorded is None:
            self.graphs = False
            return self._scores(logits, hidden, tokens)
        graph, scores = recorded
        self.captured[key] = graph, inputs, scores
        return scores.clone()


def router_policy(path, slm, threshold: float | None = None) -> NeuralPolicy:
    """The router checkpoint at `path` as a policy for the SLM backend `slm` (refused if trained for another)."""
    return NeuralPolicy(load_router(path, slm_identity(slm)), slm.embed, threshold, device=slm.device)


def choose(kind: str | None, router_path: Path | None, given: bool) -> tuple[str, Path | None]:
    """The policy to run and its router checkpoint: as asked, else the router at `router_path` (the user's,
    `given`, or the one shipped for the SLM), else entropy."""
    kind = kind or ("router" if router_path is not None else "entropy")
    if kind not in POLICIES:
        raise R2RError(f"unknown routing policy {kind!r}: use one of {', '.join(POLICIES)}")
    if kind != "router" and given:
        raise R2RError(f"--router-path goes with --router router, not --router {kind}")
    if kind == "router" and router_path is None:
        raise R2RError("no router checkpoint given: pass --router-path DIR (a trained router, see `r2r train`), "
                       "or use --router entropy")
    return kind, router_path if kind == "router" else None


def build(kind: str, slm=None, threshold: float | None = None, router_path: Path | None = None,
          seed: int | None = None) -> RoutingPolicy:
    """A policy by name; `threshold` None means its default, `slm` is the backend a router reads."""
    if kind == "slm":
        return AlwaysSLM()
    if kind == "llm":
        return AlwaysLLM()
    if kind == "random":
        return RandomPolicy(DEFAULT_RANDOM_RATE if threshold is None else threshold, seed)
    if kind == "entropy":
        return EntropyPolicy(DEFAULT_ENTROPY_THRESHOLD if threshold is None else threshold)
    if kind == "router":
        if router_path is None:
            raise R2RError("the router policy needs a router checkpoint")
        return router_policy(router_path, slm, threshold)
    raise R2RError(f"unknown routing policy {kind!r}: use one of {', '.join(POLICIES)}")
