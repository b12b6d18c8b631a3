"""Routing at a target LLM rate: the one place that turns a share of tokens into a threshold.

Training calibrates a router's threshold to a rate over a validation set (`threshold_at_rate`); a request that aims
at a rate (`Request.target_rate`: eval's cost-matched baselines, the server's `r2r_llm_rate`) gets its threshold
from its own recent scores at every step (`row_threshold`), aiming off to make up what it is behind or ahead."""

from __future__ import annotations

import torch

WARMUP_TOKENS = 16  # a request aiming at an LLM rate uses the fixed threshold for its first tokens
WINDOW_TOKENS = 128  # ... and then the top of its last this many scores (they drift as it goes on)
CATCH_UP_TOKENS = 16  # ... making up a shortfall over this many tokens


def threshold_at_rate(scores: torch.Tensor, rate: float) -> float:
    """The threshold that sends the top `rate` of `scores` to the LLM (a policy routes a score at or above it)."""
    if rate <= 0:
        return float(scores.max()) + 1e-6
    k = max(1, round(rate * len(scores)))
    return float(scores.topk(k).values[-1])


def row_threshold(policy, threshold: float | None, target_rate: float | None, written: int, llm_tokens: int,
                  scores: list[float]) -> float:
    """One request's threshold for its next token: its own (`threshold`, else the policy's), or with a
    `target_rate` the one that routes that share of its recent `scores`. Scores drift within an answer (the SLM
    grows surer as it goes on), so the top `rate` of the past alone under-routes: it aims off by what the request
    owes the LLM (`written` tokens so far, `llm_tokens` of them the LLM's), made up over `CATCH_UP_TOKENS`.

    A policy whose threshold is the rate itself (`policy.threshold_is_rate`: random draws) takes the aim as it is."""
    fixed = (policy.threshold or 0.0) if threshold is None else threshold
    if target_rate is None:
        return fixed
    behind = target_rate * written - llm_tokens  # tokens the request owes the LLM (< 0: ahead)
    aim = min(1.0, max(0.0, target_rate + behind / CATCH_UP_TOKENS))
    if policy.threshold_is_rate:
        return aim
    if len(scores) < WARMUP_TOKENS:
        return fixed
    return threshold_at_rate(torch.tensor(scores[-WINDOW_TOKENS:]), aim)
