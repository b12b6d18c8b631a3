"""The statistics the reports quote, from scipy: intervals, rank measures and paired tests."""

from __future__ import annotations

import torch
from scipy import stats


def wilson(correct: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval for a proportion ((0, 0) for no trials)."""
    if n == 0:
        return 0.0, 0.0
    ci = stats.binomtest(correct, n).proportion_ci(confidence_level=0.95, method="wilson")
    return float(ci.low), float(ci.high)


def roc_auc(scores: torch.Tensor, target: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative, ties counting half (NaN without both):
    the Mann-Whitney U of the positives over the number of pairs."""
    scores, positive = scores.double().cpu().numpy(), (target > 0.5).cpu().numpy()
    pos, neg = scores[positive], scores[~positive]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(stats.mannwhitneyu(pos, neg).statistic / (len(pos) * len(neg)))


def sign_test(x: int, y: int) -> float:
    """Two-sided exact binomial test of x against y at p = 1/2: McNemar's test on discordant pairs."""
    return float(stats.binomtest(x, x + y, 0.5).pvalue) if x + y else 1.0


def cohen_kappa(said: list[str], gold: list[str]) -> float:
    """Agreement of two labellings beyond what their label frequencies give by chance (0 when chance is 1)."""
    n = len(gold)
    agreement = sum(s == g for s, g in zip(said, gold)) / n
    chance = sum((said.count(v) / n) * (gold.count(v) / n) for v in set(gold) | set(said))
    return (agreement - chance) / (1 - chance) if chance < 1 else 0.0
