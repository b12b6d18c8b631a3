"""Routing policies: given what the SLM just computed, which rows should the LLM produce?

Every policy answers `route(logits, hidden, tokens, thresholds) -> (to_llm, scores)` for a batch
of rows: `logits` [B, V] are the SLM's next-token logits, `hidden` [B, H] its last-layer hidden
state, `tokens` [B] the token it chose, `thresholds` [B] per-row thresholds (None: the policy's
own). `scores` [B] is the number the decision was made on (kept as provenance); `to_llm` [B] is
True where the LLM takes over this token.
"""

from __future__ import annotations

import hashlib

import torch

from r2r.errors import R2RError
from r2r.router import RouterCheckpoint


class RoutingPolicy:
    name = "policy"
    num_params = 0  # parameters the policy itself activates per token

    def route(self, logits, hidden, tokens, thresholds=None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class AlwaysSLM(RoutingPolicy):
    name = "slm"

    def route(self, logits, hidden, tokens, thresholds=None):
        zeros = torch.zeros(tokens.shape[0], device=tokens.device)
        return zeros.bool(), zeros


class AlwaysLLM(RoutingPolicy):
    name = "llm"

    def route(self, logits, hidden, tokens, thresholds=None):
        ones = torch.ones(tokens.shape[0], device=tokens.device)
        return ones.bool(), ones


class RandomPolicy(RoutingPolicy):
    """Route each token with probability `rate`: the cost-matched baseline that knows nothing."""

    name = "random"

    def __init__(self, rate: float, seed: int | None = None):
        if not 0.0 <= rate <= 1.0:
            raise R2RError(f"random routing rate must be in [0, 1], got {rate}")
        self.threshold = rate  # the rate is this policy's threshold: route when the draw is below it
        self.generator = torch.Generator().manual_seed(0 if seed is None else seed)

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
        if threshold < 0:
            raise R2RError(f"entropy threshold is in nats and must be >= 0, got {threshold}")
        self.threshold = threshold

    def route(self, logits, hidden, tokens, thresholds=None):
        scores = entropy(logits)
        return scores >= (self.threshold if thresholds is None else thresholds), scores


class NeuralPolicy(RoutingPolicy):
    """The learned router: sigmoid(router(hidden, embedding(token), logits)) >= threshold."""

    name = "router"

    def __init__(self, checkpoint: RouterCheckpoint, embed, threshold: float | None = None, device="cpu"):
        self.router = checkpoint.router.to(device).eval()
        self.embed = embed  # the SLM's own frozen token-embedding lookup
        self.threshold = checkpoint.threshold if threshold is None else threshold
        if not 0.0 <= self.threshold <= 1.0:
            raise R2RError(f"router threshold is a probability and must be in [0, 1], got {self.threshold}")
        self.num_params = sum(p.numel() for p in self.router.parameters())

    @property
    def identity(self) -> dict:
        """Which router this is, for results files that must not mix two routers' runs (hashed on
        demand: generating and serving never ask)."""
        weights = b"".join(t.detach().cpu().float().numpy().tobytes() for t in self.router.state_dict().values())
        return {"weights_sha256": hashlib.sha256(weights).hexdigest()[:16], "threshold": self.threshold}

    @torch.inference_mode()
    def route(self, logits, hidden, tokens, thresholds=None):
        scores = torch.sigmoid(self.router(hidden, self.embed(tokens), logits))
        return scores >= (self.threshold if thresholds is None else thresholds), scores


def router_policy(path, slm, threshold: float | None = None) -> NeuralPolicy:
    """The router checkpoint at `path` as a policy for the SLM backend `slm` (refused if trained for another)."""
    from r2r.router import load_router, slm_identity

    return NeuralPolicy(load_router(path, slm_identity(slm)), slm.embed, threshold, device=slm.device)
