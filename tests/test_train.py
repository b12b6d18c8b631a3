"""Router training on a synthetic label dataset with a planted rule; calibration; the CLI."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import planted_dataset

from roads_to_rome.pipeline.labels import Parts
from roads_to_rome.routing.rate import threshold_at_rate
from roads_to_rome.routing.router import RouterConfig, load_router, save_router
from roads_to_rome.training import train as training


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, slm, tokenizer):
    return planted_dataset(tmp_path_factory.mktemp("labels"), slm, tokenizer)


def lookup(slm):
    table = slm.embedding_table().detach().float()
    return lambda tokens: table[tokens]


def test_training_learns_a_planted_rule_and_is_reproducible(dataset, slm):
    data = training.features(dataset, slm, top_k=20)
    assert len(data.labels) == 60 * 40 and data.hidden.shape[1] == slm.hidden_size
    config = RouterConfig(slm.hidden_size, slm.hidden_size, ("hidden", "token", "logits"), top_k=20, dim=64, n_blocks=2)
    router, val, info = training.train(data, lookup(slm), config, "divergent", seed=1, epochs=30, batch_size=64)
    scores = training.router_scores(router, val, lookup(slm))
    divergent = val.target("divergent")
    assert training.roc_auc(scores, divergent) > 0.95
    share = float(divergent.mean())
    assert training.recall_at_rates(scores, divergent, [share + 0.05])[share + 0.05] > 0.9
    # The entropy here is noise: the router must beat it by far.
    assert training.roc_auc(val.entropy, divergent) < 0.65
    # Validation holds whole prompts, none of which the training split saw.
    train_set, val_set = training.split_by_prompt(data.subset(torch.ones(len(data.labels), dtype=torch.bool)), 0.15, 1)
    assert not set(train_set.prompt.tolist()) & set(val_set.prompt.tolist())
    again, _, _ = training.train(data, lookup(slm), config, "divergent", seed=1, epochs=30, batch_size=64)
    assert all(torch.equal(a, b) for a, b in zip(router.state_dict().values(), again.state_dict().values()))


def test_merged_datasets_take_each_prompt_from_the_first_that_judged_it(slm, tokenizer, tmp_path):
    answer = planted_dataset(tmp_path / "answer", slm, tokenizer, n_prompts=6, length=10)
    rows = pq.read_table(answer / "labels.parquet").to_pylist()
    for r in rows:  # no final answer in p0's response: the answer judge left every differing position unparseable
        if r["id"] == "p0" and r["label"] != "identical":
            r["label"] = "unparseable"
    pq.write_table(pa.Table.from_pylist(rows), answer / "labels.parquet")
    facts = planted_dataset(tmp_path / "facts", slm, tokenizer, n_prompts=8, length=10)  # the same 6 prompts, 2 more
    merged = training.merged_features([answer, facts], slm, top_k=20)
    assert sorted(merged.ids) == sorted([f"{answer}/p{i}" for i in range(1, 6)] + [f"{facts}/p{i}" for i in (0, 6, 7)])
    assert len(merged.labels) == 8 * 10 and "unparseable" not in merged.labels
    assert sorted(set(merged.prompt.tolist())) == list(range(8))  # every prompt index names a kept prompt
    alone = training.features(facts, slm, top_k=20)
    p0 = merged.ids.index(f"{facts}/p0")
    assert torch.equal(merged.hidden[merged.prompt == p0], alone.hidden[alone.prompt == alone.ids.index("p0")])


def test_feature_cache_adds_only_new_prompts_and_survives_a_kill(dataset, slm, tmp_path, monkeypatch):
    import shutil

    full = training.features(dataset, slm, top_k=20, cache=tmp_path / "full.safetensors")
    # Half of the prompts cached, as after a run killed midway (saved every 4 prompts) or a dataset
    # that has grown since: the next run prefills only the other half and gives the same features.
    half = tmp_path / "half"
    shutil.copytree(dataset / "responses", half / "responses")
    rows = pq.read_table(dataset / "labels.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([r for r in rows if int(r["id"][1:]) < 30]), half / "labels.parquet")
    cache = tmp_path / "grown.safetensors"
    training.features(half, slm, top_k=20, cache=cache, save_every=4)
    calls = []
    forward_sequence = slm.forward_sequence
    monkeypatch.setattr(slm, "forward_sequence", lambda *a: calls.append(1) or forward_sequence(*a))
    grown = training.features(dataset, slm, top_k=20, cache=cache)
    assert len(calls) == 30
    assert grown.ids == full.ids and torch.equal(grown.prompt, full.prompt) and grown.labels == full.labels
    assert all(torch.equal(getattr(grown, k), getattr(full, k)) for k in ("hidden", "tokens", "top_logprobs"))
    calls.clear()
    training.features(dataset, slm, top_k=20, cache=cache)
    assert not calls


def test_metrics_on_known_scores():
    scores = torch.tensor([0.9, 0.8, 0.7, 0.1, 0.2, 0.3])
    target = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    assert training.roc_auc(scores, target) == pytest.approx(8 / 9)  # 8 of 9 (positive, negative) pairs ordered
    assert training.roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])) == 0.5
    recall = training.recall_at_rates(scores, target, [1 / 6, 2 / 6, 0.5, 1.0])
    assert list(recall.values()) == pytest.approx([1 / 3, 2 / 3, 2 / 3, 1.0])
    assert threshold_at_rate(scores, 0.5) == pytest.approx(0.7)


def test_unjudged_positions_count_toward_the_rate_but_never_as_positives():
    # Answer labels roll out a sample of differing positions: the rest are `unparseable`. The router routes them
    # too, so they count toward the LLM rate, but AUC compares judged tokens only.
    labels = ["divergent", "unparseable", "unparseable", "neutral", "identical", "identical"]
    data = training.Features(torch.zeros(6, 2), torch.zeros(6, dtype=torch.long), torch.zeros(6, 1), torch.zeros(6),
                             labels,
                             torch.zeros(6), torch.zeros(6, dtype=torch.long), ["p0"])
    scores = torch.tensor([0.5, 0.9, 0.8, 0.4, 0.1, 0.2])
    assert training.judged_auc(scores, data, "divergent") == 1.0  # the unjudged high scorers are not negatives
    recall = training.recall_at_rates(scores, data.target("divergent"), [2 / 6, 3 / 6])
    assert list(recall.values()) == [0.0, 1.0]  # the divergent token is third of six: top half, not top third


def test_train_and_calibrate_cli(run_cli, dataset, tmp_path):
    from tiny import save_pair

    slm_dir, _ = save_pair(tmp_path)
    code, out, err = run_cli("train", dataset, "--out", tmp_path / "router", "--slm", slm_dir, "--dim", "32",
                             "--epochs", "3", "--target-rate", "0.3", "--ablations")
    assert code == 0, err
    report = json.loads((tmp_path / "router" / "training.json").read_text())
    runs = report["runs"]
    assert {(r["inputs"], r["objective"]) for r in runs} == {
        (i, o) for i in ("hidden", "hidden,token", "hidden,token,logits") for o in ("divergent", "different")}
    assert set(report["entropy"]["recall"]) == set(runs[0]["recall"]) and "saved to" in out
    ckpt = load_router(tmp_path / "router")
    assert ckpt.extra["training"]["target_rate"] == 0.3
    code, out, err = run_cli("calibrate", tmp_path / "router", dataset, "--slm", slm_dir, "--target-rate", "0.2",
                             "--write")
    assert code == 0, err
    assert (tmp_path / "router" / "calibration.png").exists()
    assert load_router(tmp_path / "router").threshold != ckpt.threshold
    code, out, err = run_cli("calibrate", tmp_path / "router", dataset, "--slm", slm_dir, "--all-prompts", "--json")
    assert code == 0, err
    every = json.loads(out)
    assert every["val_tokens"] == len(pq.read_table(dataset / "labels.parquet")) and 0 <= every["auc"] <= 1
    assert every["own_threshold"]["threshold"] == load_router(tmp_path / "router").threshold
    code, out, err = run_cli("train", tmp_path, "--slm", slm_dir)
    assert code == 2 and "not a label dataset" in err
    for targets, says in ((["--target-rate", "0.2", "--target-recall", "0.5"], "not both"),  # one threshold, one target
                          (["--write"], "--write needs --target-rate or --target-recall"),
                          (["--target-recall", "1"], "strictly between 0 and 1")):
        code, out, err = run_cli("calibrate", tmp_path / "router", dataset, "--slm", slm_dir, *targets)
        assert code == 2 and says in err, err


def test_a_judge_that_calls_nothing_divergent_still_gives_the_ablation_table(run_cli, dataset, tmp_path):
    import shutil

    from tiny import save_pair

    slm_dir, _ = save_pair(tmp_path)
    neutral = tmp_path / "all-neutral"
    shutil.copytree(dataset / "responses", neutral / "responses")
    rows = pq.read_table(dataset / "labels.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([{**r, "label": "neutral" if r["label"] == "divergent" else r["label"]}
                                         for r in rows]), neutral / "labels.parquet")
    code, out, err = run_cli("train", neutral, "--objective", "different", "--out", tmp_path / "router", "--slm",
                             slm_dir, "--dim", "32", "--epochs", "2", "--ablations")
    assert code == 0, err
    assert out.count("skipped") == 3 and "recall of different tokens" in " ".join(out.split())
    runs = json.loads((tmp_path / "router" / "training.json").read_text())["runs"]
    assert {r["objective"] for r in runs} == {"different"} and len(runs) == 3
    assert load_router(tmp_path / "router").extra["training"]["recall_of"] == "different"
    code, out, err = run_cli("train", neutral, "--out", tmp_path / "router2", "--slm", slm_dir)
    assert code == 2 and "no positive tokens for objective 'divergent'" in err


def test_an_unjudged_dataset_trains_the_different_objective(dataset, slm, tmp_path):
    import shutil

    from roads_to_rome.errors import R2RError

    unjudged = tmp_path / "unjudged"
    shutil.copytree(dataset / "responses", unjudged / "responses")
    prefill = []
    for r in Parts(dataset, "responses").rows():
        logits, _ = slm.forward_sequence(r["prompt_ids"] + r["response_ids"])
        start = len(r["prompt_ids"]) - 1
        slm_tokens = logits[start : start + len(r["response_ids"])].argmax(-1).tolist()
        prefill.append({"id": r["id"], "slm_tokens": slm_tokens, "entropy": [0.0] * len(slm_tokens),
                        "different": [a != b for a, b in zip(slm_tokens, r["response_ids"])]})
    Parts(unjudged, "prefill").write(prefill)
    data = training.features(unjudged, slm, top_k=20)
    assert set(data.labels) == {"identical", "different"}
    assert int(data.target("different").sum()) == sum(sum(p["different"]) for p in prefill)
    with pytest.raises(R2RError, match="not judged yet"):
        data.target("divergent")


def test_router_checkpoint_round_trip_keeps_the_calibrated_threshold(slm, tmp_path):
    config = RouterConfig(slm.hidden_size, slm.hidden_size, top_k=10, dim=16, n_blocks=1)
    router = training.Router(config)
    ckpt = training.checkpoint(router, 0.4321, slm, {"training": {"seed": 3}})
    save_router(tmp_path / "r", ckpt)
    loaded = load_router(tmp_path / "r")
    assert loaded.threshold == 0.4321 and loaded.extra["training"]["seed"] == 3
    assert all(torch.equal(a, b) for a, b in zip(router.state_dict().values(), loaded.router.state_dict().values()))


@pytest.mark.parametrize("labels, measured", [
    (["identical", "different"], "different"),  # before the judge
    (["identical", "neutral"], "different"),  # a judge that calls nothing divergent
    (["identical", "neutral", "divergent"], "divergent"),
])
def test_recall_is_measured_on_divergent_tokens_when_there_are_some(labels, measured):
    n = len(labels)
    data = training.Features(torch.zeros(n, 4), torch.zeros(n, dtype=torch.long), torch.zeros(n, 2), torch.zeros(n),
                             labels,
                             torch.zeros(n), torch.zeros(n, dtype=torch.long), ["p"])
    assert training.recall_measured_on(data) == measured
