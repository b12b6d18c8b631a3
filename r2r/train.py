"""Router training, evaluation and threshold calibration on a label dataset (see labels.py).

1. `features`: prefill every response with the SLM and keep, per response token, what the router
   sees at decode time: the last hidden state at the position that proposes the token, the SLM's
   proposed token, and its top-k log-probabilities. Cached next to the dataset per backend.
2. `train`: BCE (positives up-weighted by the class ratio), validation split by prompt, early
   stopping on validation ROC-AUC, a fixed seed.
3. `recall_at_rates` / `calibrate`: what fraction of divergent tokens a score catches when it sends a
   given share of tokens to the LLM, and the threshold that reaches a target rate or recall.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from r2r.errors import R2RError
from r2r.labels import Parts, prefill_rows
from r2r.router import Router, RouterCheckpoint, RouterConfig, slm_identity

OBJECTIVES = ("divergent", "different")
VAL_FRACTION = 0.15  # share of prompts held out for validation (training, calibration, reports)
FEATURE_KEYS = ("hidden", "tokens", "top_logprobs")  # the cached router inputs, per labelled token


@dataclass
class Features:
    """Per labelled token: router inputs, label, entropy, and the prompt it belongs to."""
    hidden: torch.Tensor  # [N, H] float32
    tokens: torch.Tensor  # [N] the SLM's proposed token
    top_logprobs: torch.Tensor  # [N, K] float32, sorted descending
    labels: list[str]  # identical / neutral / divergent / unparseable
    entropy: torch.Tensor  # [N] the SLM's entropy (nats), for the entropy baseline
    prompt: torch.Tensor  # [N] index of the prompt (the split unit)
    ids: list[str]  # prompt index -> prompt id

    def target(self, objective: str) -> torch.Tensor:
        if objective not in OBJECTIVES:
            raise R2RError(f"unknown objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
        if objective == "divergent" and "different" in self.labels:
            raise R2RError("this dataset is not judged yet (no labels.parquet): train --objective different, "
                           "or run the label pipeline's judgements and labels steps")
        bad = "identical" if objective == "different" else None
        return torch.tensor([(lab != bad) if bad else (lab == "divergent") for lab in self.labels], dtype=torch.float32)

    def subset(self, mask: torch.Tensor) -> Features:
        keep = mask.nonzero()[:, 0].tolist()
        return Features(self.hidden[mask], self.tokens[mask], self.top_logprobs[mask],
                        [self.labels[i] for i in keep], self.entropy[mask], self.prompt[mask], self.ids)


def load_dataset(dataset: Path) -> tuple[list[dict], dict[str, dict]]:
    """The labelled rows and the responses they come from (a label output directory).

    Before the judge has run, the prefill step alone gives rows labelled `identical` / `different`:
    enough for the "different" objective."""
    if not (dataset / "responses").exists():
        raise R2RError(f"{dataset} is not a label dataset: it needs responses/ and labels.parquet "
                       "(the output directory of `r2r label`)")
    responses = {r["id"]: r for r in Parts(dataset, "responses").rows()}
    if (dataset / "labels.parquet").exists():
        return pq.read_table(dataset / "labels.parquet").to_pylist(), responses
    rows = prefill_rows(dataset)
    if not rows:
        raise R2RError(f"{dataset} has no labels.parquet and no prefill step yet: run `r2r label` first")
    return rows, responses


def recall_measured_on(val: Features) -> str:
    """Which tokens recall is measured on: divergent ones once the judge has found some in these
    prompts; before the judge has run, or when it calls nothing divergent, different ones."""
    judged = "different" not in val.labels
    return "divergent" if judged and val.target("divergent").sum() > 0 else "different"


@torch.inference_mode()
def features(dataset: Path, slm, top_k: int = 100, progress=None, cache: Path | None = None,
             save_every: int = 16) -> Features:
    """Recompute the router's inputs for every labelled token by prefilling each response once.

    The cache next to the dataset holds them per prompt, so responses added to the dataset later
    cost only their own prefill, and a killed run keeps every prompt saved so far."""
    rows, responses = load_dataset(dataset)
    cache = cache or dataset / f"features-{type(slm).__name__}-k{top_k}.safetensors"
    by_id: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda x: x["position"]):
        by_id.setdefault(r["id"], []).append(r)
    ids = sorted(by_id)
    done = _read_cache(cache)
    todo = [rid for rid in ids if rid not in done or len(done[rid]["tokens"]) != len(by_id[rid])]
    task = progress.add_task("features (SLM prefill)", total=len(ids), completed=len(ids) - len(todo)) \
        if progress else None
    for count, rid in enumerate(todo, 1):
        r = responses.get(rid)
        if r is None:
            raise R2RError(f"labels.parquet has {rid!r} but responses/ does not: the dataset is incomplete")
        labelled = by_id[rid]
        # The state after reading token t-1 proposes token t: response token j is proposed at
        # len(prompt) - 1 + j, so outputs start there.
        start = len(r["prompt_ids"]) - 1
        logits, states = slm.prefill(r["prompt_ids"] + r["response_ids"][:-1], start)
        at = torch.tensor([x["position"] for x in labelled])
        done[rid] = {"hidden": states[at].float(), "tokens": torch.tensor([x["slm_token"] for x in labelled]),
                     "top_logprobs": torch.log_softmax(logits[at].float(), -1).topk(top_k, dim=-1).values}
        if count % save_every == 0 or count == len(todo):
            _write_cache(cache, done)
        if progress:
            progress.advance(task)
    ordered = [x for rid in ids for x in by_id[rid]]
    return Features(*(torch.cat([done[rid][key] for rid in ids]) for key in FEATURE_KEYS),
                    [x["label"] for x in ordered], torch.tensor([x["entropy"] for x in ordered]),
                    torch.cat([torch.full((len(by_id[rid]),), i) for i, rid in enumerate(ids)]), ids)


def _read_cache(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Cached features per prompt id (empty when there is no cache or it is from an older format)."""
    if not path.exists():
        return {}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "ids" not in meta:
        return {}
    saved, ids, counts = load_file(str(path)), json.loads(meta["ids"]), json.loads(meta["counts"])
    parts = {key: saved[key].split(counts) for key in FEATURE_KEYS}
    return {rid: {key: parts[key][i] for key in parts} for i, rid in enumerate(ids)}


def _write_cache(path: Path, done: dict[str, dict[str, torch.Tensor]]) -> None:
    ids = sorted(done)
    tensors = {key: torch.cat([done[rid][key] for rid in ids]).contiguous() for key in FEATURE_KEYS}
    counts = [len(done[rid]["tokens"]) for rid in ids]
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata={"ids": json.dumps(ids), "counts": json.dumps(counts)})
    partial.replace(path)  # whole or not at all: a kill mid-write leaves the previous cache


def split_by_prompt(data: Features, val_fraction: float, seed: int) -> tuple[Features, Features]:
    """Whole prompts go to validation, never single tokens (tokens of one answer are not independent)."""
    prompts = list(range(len(data.ids)))
    random.Random(seed).shuffle(prompts)
    n_val = max(1, round(val_fraction * len(prompts)))
    if n_val >= len(prompts):
        raise R2RError(f"the dataset has {len(prompts)} prompts: too few to split off a validation set")
    val = torch.isin(data.prompt, torch.tensor(prompts[:n_val]))
    return data.subset(~val), data.subset(val)


def roc_auc(scores: torch.Tensor, target: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    pos, neg = scores[target > 0.5], scores[target <= 0.5]
    if not len(pos) or not len(neg):
        return float("nan")
    ranks = torch.empty_like(scores, dtype=torch.float64)
    order = scores.argsort()
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # Average the ranks of tied scores.
    uniq, inverse = torch.unique(scores, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    ranks = (sums / counts)[inverse]
    n_pos, n_neg = len(pos), len(neg)
    return float((ranks[target > 0.5].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def threshold_at_rate(scores: torch.Tensor, rate: float) -> float:
    """The threshold that sends the top `rate` of tokens (by score) to the LLM."""
    if rate <= 0:
        return float(scores.max()) + 1e-6
    k = max(1, round(rate * len(scores)))
    return float(scores.topk(k).values[-1])


def recall_at_rates(scores: torch.Tensor, divergent: torch.Tensor, rates) -> dict[float, float]:
    """Share of divergent tokens that score within the top `rate` of all tokens, per rate."""
    total = max(int(divergent.sum()), 1)
    return {r: float(((scores >= threshold_at_rate(scores, r)) & (divergent > 0.5)).sum()) / total for r in rates}


def router_scores(router: Router, data: Features, embed, batch: int = 4096) -> torch.Tensor:
    router.eval()
    with torch.inference_mode():
        return torch.cat([torch.sigmoid(router.forward_features(
            data.hidden[i:i + batch], embed(data.tokens[i:i + batch]).float(), data.top_logprobs[i:i + batch]))
            for i in range(0, len(data.tokens), batch)])


def train(data: Features, embed, config: RouterConfig, objective: str = "divergent", val_fraction: float = VAL_FRACTION,
          seed: int = 0, epochs: int = 40, patience: int = 5, lr: float = 5e-4, batch_size: int = 512,
          progress=None) -> tuple[Router, Features, dict]:
    """Train a router; returns it (best validation AUC), the validation split and the training history."""
    usable = torch.tensor([lab != "unparseable" for lab in data.labels])
    data = data.subset(usable)
    train_set, val_set = split_by_prompt(data, val_fraction, seed)
    y_train, y_val = train_set.target(objective), val_set.target(objective)
    if y_train.sum() == 0 or y_train.sum() == len(y_train):
        raise R2RError(f"the training split has no {'positive' if y_train.sum() == 0 else 'negative'} "
                       f"tokens for objective {objective!r}: label more prompts")
    torch.manual_seed(seed)
    router = Router(config)
    # Class imbalance: weigh positives by negatives/positives so each class counts equally.
    pos_weight = (len(y_train) - y_train.sum()) / y_train.sum()
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.AdamW(router.parameters(), lr=lr, weight_decay=0.01)
    train_emb = embed(train_set.tokens).float()
    generator = torch.Generator().manual_seed(seed)
    best, best_state, stale, history = -1.0, None, 0, []
    task = progress.add_task(f"train ({objective}, {'+'.join(config.inputs)})", total=epochs) if progress else None
    for epoch in range(epochs):
        router.train()
        order = torch.randperm(len(y_train), generator=generator)
        total = 0.0
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            logit = router.forward_features(train_set.hidden[idx], train_emb[idx], train_set.top_logprobs[idx])
            loss = loss_fn(logit, y_train[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        auc = roc_auc(router_scores(router, val_set, embed), y_val)
        history.append({"epoch": epoch, "train_loss": total / len(y_train), "val_auc": auc})
        if progress:
            progress.update(task, advance=1, description=f"train ({objective}, {'+'.join(config.inputs)}) "
                                                         f"val AUC {auc:.3f}")
        if auc > best:
            best, stale = auc, 0
            best_state = {k: v.clone() for k, v in router.state_dict().items()}
        else:
            stale += 1
            if stale >= patience:
                break
    router.load_state_dict(best_state)
    router.eval()
    return router, val_set, {"history": history, "best_val_auc": best, "epochs_run": len(history)}


def checkpoint(router: Router, threshold: float, slm, metrics: dict) -> RouterCheckpoint:
    return RouterCheckpoint(router, threshold, slm_identity(slm), metrics)
