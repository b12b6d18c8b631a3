"""What a label run says about itself: the dataset's rates by domain beside the paper's (`report`), and how two
judges (or a judge and the margin rule) agree on the same positions (`agreement`, `margin_fit`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import torch

from roads_to_rome.data.stats import roc_auc
from roads_to_rome.errors import R2RError
from roads_to_rome.pipeline import judges
from roads_to_rome.pipeline.labels import Parts, prefill_rows

PAPER_RATES = {"math": (0.068, 0.028), "code": (0.103, 0.047), "qa": (0.202, 0.097), "overall": (0.108, 0.049)}


def report(dataset: Path) -> dict:
    """The paper's statistics table: per domain and overall, different and divergent rates, entropy by label.
    Before the judge has run (no labels.parquet yet), the prefill step gives everything but the
    divergent figures, which are then null."""
    path = dataset / "labels.parquet" if dataset.is_dir() else dataset
    if path.exists():
        rows, judged = pq.read_table(path).to_pylist(), True
    else:
        rows, judged = (prefill_rows(dataset) if dataset.is_dir() else []), False
        if not rows:
            raise R2RError(f"{path} does not exist: run `r2r label` first")

    def stats(subset):
        tokens = len(subset)
        different = sum(r["label"] != "identical" for r in subset)
        divergent = sum(r["label"] == "divergent" for r in subset)
        out = {"queries": len({r["id"] for r in subset}), "tokens": tokens,
               "different_rate": different / tokens if tokens else 0.0,
               "divergent_rate": (divergent / tokens if tokens else 0.0) if judged else None,
               "unparseable": sum(r["label"] == "unparseable" for r in subset)}
        for label in ("identical", "neutral", "divergent", "different"):
            # "different": every token where the SLM's argmax is not the LLM's, whatever the verdict.
            values = [r["entropy"] for r in subset if (r["label"] != "identical" if label == "different"
                                                       else r["label"] == label)]
            out[f"mean_entropy_{label}"] = sum(values) / len(values) if values else None
        return out

    domains = sorted({r["domain"] for r in rows})
    return {"judged": judged,
            "paper": {k: {"different_rate": d, "divergent_rate": v} for k, (d, v) in PAPER_RATES.items()},
            "domains": {d: stats([r for r in rows if r["domain"] == d]) for d in domains},
            "overall": stats(rows)}


def verdicts(directory: Path, step: str = "judgements") -> dict[tuple[str, int], tuple[str, str]]:
    """A label directory's verdict and the judge's raw answer per differing position (id, position): from its <step>/
    parts, or, for a committed dataset that keeps only its labels (data/labels/default), from labels.parquet, where a
    differing position's label is its verdict."""
    parts = Parts(directory, step).rows() if (directory / step).exists() else []  # reading creates no directory
    found = {(j["id"], j["position"]): (j["verdict"], j["raw"]) for j in parts}
    if not found and (directory / "labels.parquet").exists():
        found = {(r["id"], r["position"]): (r["label"], r["judge_raw"])
                 for r in pq.read_table(directory / "labels.parquet").to_pylist() if r["label"] != "identical"}
    return found


def entropies(directory: Path) -> dict[tuple[str, int], float]:
    """The SLM's next-token entropy per response position (id, position), from labels.parquet or the prefill step."""
    path = directory / "labels.parquet"
    rows = pq.read_table(path).to_pylist() if path.exists() else prefill_rows(directory)
    return {(r["id"], r["position"]): r["entropy"] for r in rows}


# The margins `r2r label agree` tries when the other directory was labelled by the margin judge (nats).
AGREE_MARGINS = (0.5, 1.0, 2.0, 3.0, 4.0)


def margin_fit(keys: list, verdict: dict, gap: dict, entropy: dict) -> dict:
    """How well the LLM's margin tells the positions a judge calls divergent from those it calls neutral, with the
    SLM's entropy (what a router without the LLM sees) beside it: ROC-AUC of each, and for each margin the positions
    it calls divergent, the share of the judge's divergent positions among them (precision) and the share of those
    it catches (recall). Which --margin follows the judge best, and whether any does."""
    target = torch.tensor([verdict[k] == "divergent" for k in keys], dtype=torch.float64)
    gaps = torch.tensor([gap[k] for k in keys], dtype=torch.float64)
    result = {"positions": len(keys), "divergent": int(target.sum()), "roc_auc_margin": roc_auc(gaps, target),
              "roc_auc_entropy": (roc_auc(torch.tensor([entropy[k] for k in keys], dtype=torch.float64), target)
                                  if all(k in entropy for k in keys) else None)}
    by_margin = {}
    for margin in AGREE_MARGINS:
        called = gaps > margin
        hits = int((called & (target > 0.5)).sum())
        by_margin[str(margin)] = {"called_divergent": int(called.sum()),
                                  "precision": hits / int(called.sum()) if called.any() else None,
                                  "recall": hits / result["divergent"] if result["divergent"] else None}
    return {**result, "by_margin": by_margin}


def agreement(out: Path, other: str = "judgements", other_dir: Path | None = None) -> dict:
    """How often the verdicts in OUT/<other>/ (or, with `other_dir`, in that label directory's <other>/, else its
    labels.parquet) agree with OUT's pipeline judge on the same positions; `judged` leaves out those `unparseable` on
    either side (as are the positions an answer-label run did not roll out). Between two directories that share
    responses but branched with different --rejoin-tokens it measures early stopping: `rejoined` covers the
    positions whose branch stopped early in OUT, where a longer branch could have reached another answer. Against a
    directory labelled by the margin judge, `margins` says how well the LLM's margin, at each setting, and the SLM's
    entropy follow OUT's verdicts (`margin_fit`): whether any --margin stands in for OUT's judge."""
    second_raw = verdicts(other_dir or out, other)
    first, second = {k: v for k, (v, _) in verdicts(out).items()}, {k: v for k, (v, _) in second_raw.items()}
    rejoined = {(c["id"], c["position"]) for c in Parts(out, "continuations").rows() if c.get("rejoined")}

    def compare(keys: list) -> dict:
        same = sum(first[k] == second[k] for k in keys)
        return {"positions": len(keys), "agreement": same / len(keys) if keys else 0.0,
                "confusion (pipeline judge/other judge)": dict(Counter(f"{first[k]}/{second[k]}" for k in keys))}

    both = [k for k in first if k in second]
    judged = [k for k in both if "unparseable" not in (first[k], second[k])]
    result = {**compare(both), "judged": compare(judged)}
    if rejoined:
        result["rejoined"] = compare([k for k in both if k in rejoined])
    gaps = {k: judges.MarginJudge.gap(second_raw[k][1]) for k in judged}
    if judged and None not in gaps.values():  # the other directory's judge is the margin judge
        result["margins"] = margin_fit(judged, first, gaps, entropies(out))
    return result
