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

from roads_to_rome import files
from roads_to_rome.data.stats import roc_auc
from roads_to_rome.errors import R2RError
from roads_to_rome.pipeline.labels import Parts, prefill_rows
from roads_to_rome.plots import pyplot
from roads_to_rome.progress import QUIET
from roads_to_rome.routing.rate import threshold_at_rate
from roads_to_rome.routing.reference import ReferenceConfig, ReferenceRouter
from roads_to_rome.routing.router import (
    Router,
    RouterCheckpoint,
    RouterConfig,
    load_router,
    save_router,
    slm_identity,
)

OBJECTIVES = ("divergent", "different")
VAL_FRACTION = 0.15  # share of prompts held out for validation (training, calibration, reports)
FEATURE_KEYS = ("hidden", "tokens", "top_logits", "logsumexp")  # the cached router inputs, per labelled token
ARCHITECTURES = ("mlp", "reference")  # this project's router; the paper's reference router (routing/reference.py)


@dataclass
class Features:
    """Per labelled token: router inputs, label, entropy, and the prompt it belongs to."""
    hidden: torch.Tensor  # [N, H] float32
    tokens: torch.Tensor  # [N] the SLM's proposed token
    top_logits: torch.Tensor  # [N, K] float32, raw, sorted descending
    logsumexp: torch.Tensor  # [N] over the whole vocabulary: top_logits - logsumexp are log-probabilities
    labels: list[str]  # identical / neutral / divergent / unparseable
    entropy: torch.Tensor  # [N] the SLM's entropy (nats), for the entropy baseline
    prompt: torch.Tensor  # [N] index of the prompt (the split unit)
    ids: list[str]  # prompt index -> prompt id

    @property
    def top_logprobs(self) -> torch.Tensor:
        return self.top_logits - self.logsumexp[:, None]

    def top(self, kind: str) -> torch.Tensor:
        """What a router reads of the logits (its `logits_input`): "raw" top-k logits or their "logprobs"."""
        return self.top_logits if kind == "raw" else self.top_logprobs

    def target(self, objective: str) -> torch.Tensor:
        if objective not in OBJECTIVES:
            raise R2RError(f"unknown objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
        if objective == "divergent" and "different" in self.labels:
            raise R2RError("this dataset is not judged yet (no labels.parquet): train --objective different, "
                           "or run the label pipeline's judgements and labels steps")
        bad = "identical" if objective == "different" else None
        return torch.tensor([(lab != bad) if bad else (lab == "divergent") for lab in self.labels], dtype=torch.float32)

    def judged(self) -> torch.Tensor:
        """Tokens with a verdict: not `unparseable` (the answer judge found no final answer, or the position was
        not rolled out), so neither positive nor negative."""
        return torch.tensor([lab != "unparseable" for lab in self.labels], dtype=torch.bool)

    def subset(self, mask: torch.Tensor) -> Features:
        keep = mask.nonzero()[:, 0].tolist()
        return Features(self.hidden[mask], self.tokens[mask], self.top_logits[mask], self.logsumexp[mask],
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
def features(dataset: Path, slm, top_k: int = 100, progress=QUIET, cache: Path | None = None,
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
    task = progress.add_task("features (SLM prefill)", total=len(ids), completed=len(ids) - len(todo))
    for count, rid in enumerate(todo, 1):
        r = responses.get(rid)
        if r is None:
            raise R2RError(f"labels.parquet has {rid!r} but responses/ does not: the dataset is incomplete")
        labelled = by_id[rid]
        # The state after reading token t-1 proposes token t: response token j is proposed at
        # len(prompt) - 1 + j, so outputs start there.
        start = len(r["prompt_ids"]) - 1
        logits, states = slm.forward_sequence(r["prompt_ids"] + r["response_ids"][:-1], start)
        at = torch.tensor([x["position"] for x in labelled])
        raw = logits[at].float()
        done[rid] = {"hidden": states[at].float(), "tokens": torch.tensor([x["slm_token"] for x in labelled]),
                     "top_logits": raw.topk(top_k, dim=-1).values, "logsumexp": torch.logsumexp(raw, -1)}
        if count % save_every == 0 or count == len(todo):
            _write_cache(cache, done)
        progress.advance(task)
    ordered = [x for rid in ids for x in by_id[rid]]
    return Features(*(torch.cat([done[rid][key] for rid in ids]) for key in FEATURE_KEYS),
                    [x["label"] for x in ordered], torch.tensor([x["entropy"] for x in ordered]),
                    torch.cat([torch.full((len(by_id[rid]),), i) for i, rid in enumerate(ids)]), ids)


def merged_features(datasets: list[Path], slm, top_k: int = 100, progress=QUIET) -> Features:
    """Several label datasets as one. A prompt (the same prompt tokens) is taken from the first dataset that
    judged it: one whose differing positions are all `unparseable` there (the answer judge found no final answer
    to compare) falls through to the next, so answer labels come first and facts labels fill in the rest."""
    if len(datasets) == 1:
        return features(datasets[0], slm, top_k, progress)
    taken: set[tuple[int, ...]] = set()
    kept: list[Features] = []
    ids: list[str] = []  # the merged prompts, "<dataset>/<id>"
    for dataset in datasets:
        data = features(dataset, slm, top_k, progress)
        _, responses = load_dataset(dataset)
        index = torch.full((len(data.ids),), -1, dtype=torch.long)  # this dataset's prompt -> merged prompt
        for i, rid in enumerate(data.ids):
            key = tuple(responses[rid]["prompt_ids"])
            verdicts = {data.labels[j] for j in (data.prompt == i).nonzero()[:, 0].tolist()} - {"identical"}
            if key in taken or verdicts == {"unparseable"}:
                continue
            taken.add(key)
            index[i] = len(ids)
            ids.append(f"{dataset}/{rid}")
        chosen = data.subset(index[data.prompt] >= 0)
        chosen.prompt = index[chosen.prompt]
        kept.append(chosen)
    return Features(*(torch.cat([getattr(data, key) for data in kept]) for key in FEATURE_KEYS),
                    [lab for data in kept for lab in data.labels], torch.cat([data.entropy for data in kept]),
                    torch.cat([data.prompt for data in kept]), ids)


def _read_cache(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Cached features per prompt id (empty when there is no cache or it is from an older format)."""
    if not path.exists():
        return {}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "ids" not in meta:
        return {}
    saved, ids, counts = load_file(str(path)), json.loads(meta["ids"]), json.loads(meta["counts"])
    if any(key not in saved for key in FEATURE_KEYS):
        return {}
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


def recall_at_rates(scores: torch.Tensor, divergent: torch.Tensor, rates) -> dict[float, float]:
    """Share of divergent tokens that score within the top `rate` of all tokens, per rate."""
    total = max(int(divergent.sum()), 1)
    return {r: float(((scores >= threshold_at_rate(scores, r)) & (divergent > 0.5)).sum()) / total for r in rates}


def judged_auc(scores: torch.Tensor, data: Features, objective: str) -> float:
    """ROC-AUC over the tokens with a verdict (`Features.judged`)."""
    judged = data.judged()
    return roc_auc(scores[judged], data.target(objective)[judged])


def router_scores(router: Router | ReferenceRouter, data: Features, embed, batch: int = 4096) -> torch.Tensor:
    router.eval()
    top = data.top(router.logits_input)
    with torch.inference_mode():
        return torch.cat([torch.sigmoid(router.forward_features(
            data.hidden[i:i + batch], embed(data.tokens[i:i + batch]).float(), top[i:i + batch]))
            for i in range(0, len(data.tokens), batch)])


def train(data: Features, embed, config: RouterConfig | ReferenceConfig, objective: str = "divergent",
          val_fraction: float = VAL_FRACTION, seed: int = 0, epochs: int = 40, patience: int = 5, lr: float = 5e-4,
          batch_size: int = 512, progress=QUIET) -> tuple[Router | ReferenceRouter, Features, dict]:
    """Train a router; returns it (best validation AUC), the validation split and the training history."""
    data = data.subset(data.judged())
    train_set, val_set = split_by_prompt(data, val_fraction, seed)
    y_train, y_val = train_set.target(objective), val_set.target(objective)
    if y_train.sum() == 0 or y_train.sum() == len(y_train):
        raise R2RError(f"the training split has no {'positive' if y_train.sum() == 0 else 'negative'} "
                       f"tokens for objective {objective!r}: label more prompts")
    torch.manual_seed(seed)
    router = (ReferenceRouter if isinstance(config, ReferenceConfig) else Router)(config)
    train_top = train_set.top(router.logits_input)
    # Class imbalance: weigh positives by negatives/positives so each class counts equally.
    pos_weight = (len(y_train) - y_train.sum()) / y_train.sum()
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.AdamW(router.parameters(), lr=lr, weight_decay=0.01)
    train_emb = embed(train_set.tokens).float()
    generator = torch.Generator().manual_seed(seed)
    best, best_state, stale, history = -1.0, None, 0, []
    task = progress.add_task(f"train ({objective}, {'+'.join(config.inputs)})", total=epochs)
    for epoch in range(epochs):
        router.train()
        order = torch.randperm(len(y_train), generator=generator)
        total = 0.0
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            logit = router.forward_features(train_set.hidden[idx], train_emb[idx], train_top[idx])
            loss = loss_fn(logit, y_train[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        auc = roc_auc(router_scores(router, val_set, embed), y_val)
        history.append({"epoch": epoch, "train_loss": total / len(y_train), "val_auc": auc})
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


def checkpoint(router: Router | ReferenceRouter, threshold: float, slm, metrics: dict) -> RouterCheckpoint:
    return RouterCheckpoint(router, threshold, slm_identity(slm), metrics)


# ---- the `r2r train` and `r2r calibrate` commands ---------------------------------------------------

RATES = (0.05, 0.10, 0.15, 0.20, 0.25)  # LLM rates the reports give recall at
ABLATION_INPUTS = ("hidden", "hidden,token", "hidden,token,logits")


def train_router(datasets: list[Path], slm, out: Path, objective: str = "divergent",
                 inputs: str = "hidden,token,logits", dim: int = 128, blocks: int = 2, target_rate: float = 0.12,
                 seed: int = 0, epochs: int = 40, ablations: bool = False, progress=QUIET,
                 architecture: str = "mlp") -> dict:
    """Train the router asked for (and, with `ablations`, every input set x objective on the same split),
    calibrate its threshold to `target_rate` on validation, save it at `out` with `training.json`.

    `architecture`: "mlp" (this project's router) or "reference" (the paper's: `dim` x `blocks` block widths,
    every input; `r2r router export` writes it in the reference's own file format).

    Returns {"runs": [...], "entropy": {...}, "metrics": {...}, "skipped": [...]}; the first run is the
    saved router's."""
    check_architecture(architecture, inputs, ablations)
    embed = slm.embedding_table().float().cpu()

    def lookup(tokens):
        return embed[tokens]

    data = merged_features(datasets, slm, progress=progress)
    judged = "different" not in data.labels
    _, held_out = split_by_prompt(data, VAL_FRACTION, seed)  # the split every run below uses
    measured = recall_measured_on(held_out)
    runs = [(inputs, objective)]
    if ablations:
        objectives = OBJECTIVES if judged else ("different",)
        runs += [(i, o) for o in objectives for i in ABLATION_INPUTS if (i, o) != (inputs, objective)]
    results, skipped, entropy_baseline, metrics = [], [], None, None
    for run_inputs, run_objective in runs:
        if architecture == "reference":
            config = ReferenceConfig(slm.hidden_size, embed.shape[1], hidden_dims=(dim,) * blocks)
        else:
            config = RouterConfig(slm.hidden_size, embed.shape[1], tuple(run_inputs.split(",")), dim=dim,
                                  n_blocks=blocks)
        try:
            router, _, info = train(data, lookup, config, run_objective, seed=seed, epochs=epochs, progress=progress)
        except R2RError as e:
            if (run_inputs, run_objective) == (inputs, objective):
                raise
            skipped.append({"inputs": run_inputs, "objective": run_objective, "reason": str(e)})
            continue
        results.append(run_result(router, held_out, lookup, measured, run_inputs, run_objective, info, target_rate))
        if (run_inputs, run_objective) == (inputs, objective):
            entropy_baseline = {"val_auc": judged_auc(held_out.entropy, held_out, measured),
                                "recall": recall_at_rates(held_out.entropy, held_out.target(measured), RATES)}
            metrics = {"objective": objective, "recall_of": measured, "target_rate": target_rate,
                       "val_tokens": len(held_out.labels), "val_prompts": int(held_out.prompt.unique().numel()),
                       "val_auc": results[-1]["val_auc"], "recall_at_rate": results[-1]["recall"],
                       "entropy_baseline": entropy_baseline, "dataset": ", ".join(map(str, datasets)),
                       "prompts": len(data.ids), "seed": seed}
            save_router(out, checkpoint(router, results[-1]["threshold"], slm, {"training": metrics}))
    files.write_text(out / "training.json", json.dumps({"runs": results, "entropy": entropy_baseline}, indent=2))
    return {"runs": results, "entropy": entropy_baseline, "metrics": metrics, "skipped": skipped}


def check_architecture(architecture: str, inputs: str, ablations: bool) -> None:
    if architecture not in ARCHITECTURES:
        raise R2RError(f"--architecture is one of {', '.join(ARCHITECTURES)}, not {architecture!r}")
    if architecture == "reference" and (ablations or set(inputs.split(",")) != {"hidden", "token", "logits"}):
        raise R2RError("the reference architecture reads every input (hidden,token,logits): drop --inputs and "
                       "--ablations, or train --architecture mlp")


def run_result(router, held_out, lookup, measured: str, inputs: str, objective: str, info: dict,
               target_rate: float) -> dict:
    """One trained router's figures on the held-out prompts. Rates count every token of the validation prompts,
    unjudged ones too (the router sees them all when it routes); AUC compares judged tokens only."""
    scores = router_scores(router, held_out, lookup)
    return {"inputs": inputs, "objective": objective, "params": sum(p.numel() for p in router.parameters()),
            "val_auc": judged_auc(scores, held_out, measured),
            "recall": recall_at_rates(scores, held_out.target(measured), RATES),
            **info, "threshold": threshold_at_rate(scores, target_rate)}


def check_targets(target_rate: float | None, target_recall: float | None, write: bool) -> None:
    """One threshold is chosen for one target: a rate or a recall, each strictly between 0 and 1."""
    for name, value in (("--target-rate", target_rate), ("--target-recall", target_recall)):
        if value is not None and not 0 < value < 1:
            raise R2RError(f"{name} must be strictly between 0 and 1")
    if target_rate is not None and target_recall is not None:
        raise R2RError("give --target-rate or --target-recall, not both: one threshold is chosen for one target")
    if write and target_rate is None and target_recall is None:
        raise R2RError("--write needs --target-rate or --target-recall: it stores the threshold that reaches it")


def calibrate(router_path: Path, dataset: Path, slm, target_rate: float | None = None,
              target_recall: float | None = None, write: bool = False, all_prompts: bool = False) -> dict:
    """Sweep a router's threshold on the validation prompts it was trained without: recall of divergent
    tokens (different ones before the judge has run) against LLM rate, beside entropy's, as a table
    and `calibration.png` next to the router. With a target rate or recall, the threshold that reaches
    it (stored in the checkpoint with `write`). `all_prompts`: every prompt of `dataset`, for one the
    router never saw (how its recall carries over to other prompts, an evaluation set's say)."""
    plt = pyplot()

    check_targets(target_rate, target_recall, write)
    ckpt = load_router(router_path, slm_identity(slm))
    embed = slm.embedding_table().float().cpu()
    seed = ckpt.extra.get("training", {}).get("seed", 0)
    data = features(dataset, slm)
    # Every token of the prompts counts toward the LLM rate; only judged ones are positives (`unparseable` never is).
    val = data if all_prompts else split_by_prompt(data, VAL_FRACTION, seed)[1]
    scores = router_scores(ckpt.router, val, lambda t: embed[t])
    measured = recall_measured_on(val)
    divergent = val.target(measured)
    rates = [x / 100 for x in range(1, 41)]
    recall, entropy_recall = recall_at_rates(scores, divergent, rates), recall_at_rates(val.entropy, divergent, rates)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([100 * r for r in rates], [100 * recall[r] for r in rates], label="router")
    ax.plot([100 * r for r in rates], [100 * entropy_recall[r] for r in rates], label="entropy", linestyle="--")
    ax.set(xlabel="LLM rate (% of tokens)", ylabel=f"recall of {measured} tokens (%)",
           title=f"{len(val.labels)} {'' if all_prompts else 'validation '}tokens of {dataset}")
    ax.grid(alpha=0.3)
    ax.legend()
    plot_path = Path(router_path) / "calibration.png"
    fig.savefig(plot_path, dpi=120, bbox_inches="tight")
    plt.close(fig)

    def at_threshold(threshold: float) -> dict:
        routed = scores >= threshold
        return {"threshold": threshold, "rate": float(routed.float().mean()),
                "recall": float((routed & (divergent > 0.5)).sum() / max(divergent.sum(), 1))}

    result = {"recall_of": measured, "val_tokens": len(val.labels), "plot": str(plot_path),
              "auc": judged_auc(scores, val, measured), "entropy_auc": judged_auc(val.entropy, val, measured),
              "own_threshold": at_threshold(ckpt.threshold),
              "table": [{"rate": r, "threshold": threshold_at_rate(scores, r), "router_recall": recall[r],
                         "entropy_recall": entropy_recall[r]} for r in rates[4::5]], "chosen": None}
    if target_rate is not None or target_recall is not None:
        if target_rate is not None:
            threshold = threshold_at_rate(scores, target_rate)
        else:
            # The highest threshold that still catches the target share of divergent tokens.
            threshold = float(scores[divergent > 0.5].sort(descending=True).values[
                max(0, round(target_recall * int(divergent.sum())) - 1)])
        result["chosen"] = at_threshold(threshold)
        if write:
            ckpt.threshold = threshold
            save_router(router_path, ckpt)
    return result
