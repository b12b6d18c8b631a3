"""What random weights cannot give a shape's run, stood in for: a backend that records what each forward reads
(`Recorded`), the writer's proposals (`Proposals`), an LLM that agrees with them at a measured rate
(`AgreesAtRate`: verification's and speculative decoding's acceptance) and a router that sends a fixed share of
tokens (`RouterAtShare`). bench/shapes.py runs the shapes with them."""

from __future__ import annotations

import numpy as np
import torch

from roads_to_rome.routing import policies


class Recorded:
    """A backend that records how many new tokens each forward reads, and how many columns its cache has read after
    the last (everything else is the backend's)."""

    def __init__(self, inner):
        self.inner, self.calls, self.columns = inner, [], 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, cache, new_ids, attention_mask):
        self.calls.append(new_ids.shape[1])
        out = self.inner.forward(cache, new_ids, attention_mask)
        self.columns = cache.length
        return out

    def forward_all(self, cache, new_ids, attention_mask, n, row_keep=None):
        self.calls.append(new_ids.shape[1])
        out = self.inner.forward_all(cache, new_ids, attention_mask, n, row_keep)
        self.columns = cache.length
        return out

    def read(self, cache, new_ids, attention_mask):
        self.calls.append(new_ids.shape[1])
        self.inner.read(cache, new_ids, attention_mask)
        self.columns = cache.length


class Proposals:
    """The SLM's proposed tokens (one per row) by the column they are for, as the policy saw them: what an LLM that
    agrees at a rate needs where its read stops just short of the token it checks (an overlapped call's)."""

    KEPT = 256  # columns back: more than any read of a call in flight reaches

    def __init__(self, slm: Recorded):
        self.slm, self.by_column = slm, {}

    def record(self, tokens: torch.Tensor) -> None:
        column = self.slm.columns  # the SLM's proposal from reading columns 0..c-1 is for column c
        self.by_column[column] = tokens
        self.by_column.pop(column - self.KEPT, None)

    def at(self, column: int) -> torch.Tensor | None:
        return self.by_column.get(column)


class AgreesAtRate:
    """A random-weight LLM that, at each column whose next token it knows, prefers that token with probability
    `rate` (else its own choice stands): a deferred routed token is then kept at the rate a real pair keeps it,
    at the real cost of every forward. It knows the tokens its read includes, and with `proposals` the SLM's
    token for the column just past its read."""

    def __init__(self, inner, rate: float, seed: int = 0, proposals: Proposals | None = None):
        self.inner, self.rate, self.rng, self.proposals = inner, rate, np.random.default_rng(seed), proposals

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, cache, new_ids, attention_mask):
        logits, hidden = self.inner.forward(cache, new_ids, attention_mask)
        following = self._next(cache, logits.shape[0])
        if following is not None:
            self._prefer(logits[:, None], following[:, None])  # (a view: written in place)
        return logits, hidden

    def forward_all(self, cache, new_ids, attention_mask, n, row_keep=None):
        logits = self.inner.forward_all(cache, new_ids, attention_mask, n, row_keep)
        rows, width = new_ids.shape
        kept = logits.shape[1] - 1  # columns whose next token the read includes
        written = new_ids[:, width - kept:].to(logits.device)  # what logits[:, k] predicts, k < kept
        following = self._next(cache, rows)  # what the last column predicts, where the SLM proposed it
        if following is not None:
            self._prefer(logits, torch.cat([written, following.to(written.device)[:, None]], dim=1))
        elif kept:
            self._prefer(logits[:, :kept], written)
        return logits

    def _next(self, cache, rows: int) -> torch.Tensor | None:
        """The SLM's tokens for the column after the read, where known for every row."""
        tokens = self.proposals.at(cache.length) if self.proposals is not None else None
        return tokens if tokens is not None and len(tokens) == rows else None

    def _prefer(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Make tokens[r, k] the top choice of logits[r, k] [rows, k, V] with probability `rate`, in place."""
        rows, columns = tokens.shape
        # a few whole-tensor operations, not one per position: on a GPU each indexing op would wait for the device
        agree = torch.from_numpy(np.ascontiguousarray(self.rng.random((columns, rows)).T < self.rate))
        agree, tokens = agree.to(logits.device), tokens.to(logits.device)[..., None]
        with torch.inference_mode():  # torch's logits are inference tensors: written in place only in this mode
            preferred = torch.where(agree, logits.amax(-1) + 1, logits.gather(-1, tokens)[..., 0])
            logits.scatter_(-1, tokens, preferred[..., None])


class RouterAtShare(policies.RoutingPolicy):
    """Runs the router every step, as R2R does, then routes a fixed share of tokens at random: the router's cost is
    real, its choices are what random weights cannot give."""

    name = "random"
    threshold_is_rate = True

    def __init__(self, router: policies.NeuralPolicy, share: float, seed: int = 0, proposals: Proposals | None = None):
        self.router, self.draws, self.proposals = router, policies.RandomPolicy(share, seed), proposals
        self.threshold, self.num_params = share, router.num_params

    def check_threshold(self, value: float) -> float:
        return self.draws.check_threshold(value)

    def route(self, logits, hidden, tokens, thresholds=None):
        self.router.route(logits, hidden, tokens)
        if self.proposals is not None:
            self.proposals.record(tokens)
        return self.draws.route(logits, hidden, tokens, thresholds)
