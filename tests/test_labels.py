"""The label pipeline on a tiny pair: every step, resume after a kill mid-step, the judges' parser."""

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import R2RError
from roads_to_rome.pipeline import judges, label_reports, labels, prompt_sets

PROMPTS = [
    {"id": "m1", "domain": "math", "prompt": "What is 48 / 2?"},
    {"id": "m2", "domain": "math", "prompt": "Calculate 5 - 3 - 6.", "reference": "-4"},
    {"id": "c1", "domain": "code", "prompt": "def add(a, b):"},
    {"id": "q1", "domain": "qa", "prompt": "Bonjour! Paris is the capital of which country?"},
    {"id": "q2", "domain": "qa", "prompt": "Over naive cafe, the answer is?"},
]


class EveryOtherJudge:
    """A deterministic stand-in judge: divergent when the SLM's branch is longer than the LLM's."""

    name = "stub"

    def __call__(self, cases):
        return [("divergent" if len(b) > len(a) else "neutral", f"{len(a)} vs {len(b)}") for _, a, b in cases]


@pytest.fixture(scope="module")
def slm(llm):
    """An SLM that mostly agrees with the LLM: the LLM with noise on its output head."""
    import copy

    import torch

    from roads_to_rome.backends.torch_backend import TorchBackend

    model = copy.deepcopy(llm.model)
    torch.manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight) * 0.35)
    return TorchBackend(model, name="near-llm")


def run_pipeline(out, slm, llm, tokenizer, judge=None, rollout=False, rejoin_tokens=labels.REJOIN_TOKENS,
                 batch_size=1):
    llm_engine = Engine.alone(llm, tokenizer)
    labels.step_responses(PROMPTS, llm_engine, out, max_new_tokens=24, batch_size=2)
    labels.step_prefill(slm, out)
    labels.step_continuations(llm_engine, out, max_new_tokens=8, rollout=rollout, rejoin_tokens=rejoin_tokens,
                              batch_size=batch_size)
    labels.step_judgements(judge or EveryOtherJudge(), out, batch_size=4)
    return labels.step_labels(out)


def test_pipeline_labels_every_response_token(tmp_path, slm, llm, tokenizer):
    path = run_pipeline(tmp_path, slm, llm, tokenizer)
    rows = pq.read_table(path).to_pylist()
    responses = labels.Parts(tmp_path, "responses").rows()
    assert len(rows) == sum(len(r["response_ids"]) for r in responses)
    by_id = {r["id"]: r for r in responses}
    for row in rows:
        assert row["token"] == by_id[row["id"]]["response_ids"][row["position"]]
        assert (row["label"] == "identical") == (row["slm_token"] == row["token"])
        assert (row["judge_raw"] is None) == (row["label"] == "identical")
    assert {r["label"] for r in rows} >= {"identical", "divergent", "neutral"}
    # Step 1 agrees with a cached forward: the SLM's argmax at each response position.
    first = responses[0]
    logits, _ = slm.forward_sequence(first["prompt_ids"] + first["response_ids"][:3])
    assert logits[-1].argmax().item() == [r for r in rows if r["id"] == first["id"]][3]["slm_token"]
    report = label_reports.report(tmp_path)
    assert set(report["domains"]) == {"math", "code", "qa"}
    overall = report["overall"]
    assert overall["tokens"] == len(rows) and overall["queries"] == 5
    assert overall["divergent_rate"] <= overall["different_rate"]
    assert overall["different_rate"] == sum(r["label"] != "identical" for r in rows) / len(rows)
    assert set(labels.throughput(tmp_path)) >= {"responses", "prefill", "continuations", "judgements (stub)"}
    # Before the judge: the prefill step alone gives the same different rates and no divergent ones.
    (tmp_path / "labels.parquet").rename(tmp_path / "judged.parquet")
    unjudged = label_reports.report(tmp_path)
    assert report["judged"] and not unjudged["judged"] and unjudged["overall"]["divergent_rate"] is None
    for key in ("tokens", "queries", "different_rate", "mean_entropy_identical", "mean_entropy_different"):
        assert unjudged["overall"][key] == pytest.approx(overall[key])
    assert unjudged["domains"].keys() == report["domains"].keys()


def test_continuation_branches_end_at_the_sentence(tmp_path, slm, llm, tokenizer):
    run_pipeline(tmp_path, slm, llm, tokenizer)
    rows = [c for c in labels.Parts(tmp_path, "continuations").rows() if c["position"] >= 0]
    assert rows
    llm_engine = Engine.alone(llm, tokenizer)
    from roads_to_rome.core.sampling import SamplingParams

    responses = {r["id"]: r for r in labels.Parts(tmp_path, "responses").rows()}
    for c in rows[:6]:  # the cache-reusing continuation equals a fresh greedy generation from the prefix
        r = responses[c["id"]]
        prefix = r["prompt_ids"] + r["response_ids"][: c["position"]] + [c["slm_token"]]
        fresh = llm_engine.generate([prefix], SamplingParams(max_new_tokens=8))[0]
        text = tokenizer.decode([c["slm_token"]] + fresh.token_ids, skip_special_tokens=True)
        assert labels.to_sentence_end(text) == c["slm_branch"]
    for c in rows:
        for branch in (c["slm_branch"], c["llm_branch"]):
            assert labels.to_sentence_end(branch) == branch
    assert labels.to_sentence_end("It is 24. Then we add") == "It is 24."
    assert labels.to_sentence_end("x = 2.5 so\nnext") == "x = 2.5 so\n"


@pytest.mark.parametrize("rollout", [False, True])
def test_a_killed_run_resumes_to_the_same_dataset(tmp_path, slm, llm, tokenizer, monkeypatch, rollout):
    judge = judges.AnswerJudge() if rollout else None
    run = lambda out: run_pipeline(out, slm, llm, tokenizer, judge, rollout)  # noqa: E731
    whole = pq.read_table(run(tmp_path / "whole")).to_pylist()

    out = tmp_path / "killed"
    real_write = labels.Parts.write
    writes = {"n": 0, "die_at": 0}

    def write_or_die(self, rows):
        writes["n"] += 1
        if writes["n"] == writes["die_at"]:
            raise KeyboardInterrupt  # killed after computing a chunk, before saving it
        return real_write(self, rows)

    monkeypatch.setattr(labels.Parts, "write", write_or_die)
    steps_reached = []
    for die_at in (3, 4, 5, 5):  # dies in step 0, then in step 1, then in step 2, then in step 3
        writes.update(n=0, die_at=die_at)
        with pytest.raises(KeyboardInterrupt):
            run(out)
        steps_reached.append(sorted(p.name for p in out.iterdir() if p.is_dir() and any(p.iterdir())))
    assert steps_reached[0] == ["responses"] and "continuations" in steps_reached[2]
    monkeypatch.setattr(labels.Parts, "write", real_write)
    resumed = pq.read_table(run(out)).to_pylist()
    assert resumed == whole
    ids = [r["id"] for r in labels.Parts(out, "responses").rows()]
    assert sorted(ids) == sorted(p["id"] for p in PROMPTS)  # none lost, none duplicated


def test_rollouts_run_to_the_end_of_the_answer_or_until_they_rejoin_the_response(tmp_path, slm, llm, tokenizer):
    run_pipeline(tmp_path / "full", slm, llm, tokenizer, judges.AnswerJudge(), rollout=True, rejoin_tokens=0)
    full = {(c["id"], c["position"]): c for c in labels.Parts(tmp_path / "full", "continuations").rows()
            if c["position"] >= 0}
    assert full and not any(c["rejoined"] for c in full.values())
    llm_engine = Engine.alone(llm, tokenizer)
    responses = {r["id"]: r for r in labels.Parts(tmp_path / "full", "responses").rows()}
    for (rid, pos), c in list(full.items())[:6]:  # a branch is the LLM's greedy generation, to its end
        r = responses[rid]
        prefix = r["prompt_ids"] + r["response_ids"][:pos] + [c["slm_token"]]
        rest = len(r["response_ids"]) - pos - 1
        fresh = llm_engine.generate([prefix], SamplingParams(max_new_tokens=rest + labels.ROLLOUT_MARGIN))[0]
        assert c["slm_branch"] == tokenizer.decode([c["slm_token"]] + fresh.token_ids, skip_special_tokens=True)
        assert c["llm_branch"] == tokenizer.decode(r["response_ids"][pos:], skip_special_tokens=True)
    run_pipeline(tmp_path / "early", slm, llm, tokenizer, judges.AnswerJudge(), rollout=True, rejoin_tokens=2)
    early = {(c["id"], c["position"]): c for c in labels.Parts(tmp_path / "early", "continuations").rows()
             if c["position"] >= 0}
    assert early.keys() == full.keys()
    rejoined = [k for k, c in early.items() if c["rejoined"]]
    assert rejoined  # the near-LLM SLM's branches often fall back onto the LLM's path
    for key in rejoined:  # from the re-join on, the response's own tokens stand for the rest of the branch
        r = responses[key[0]]
        assert early[key]["slm_branch"].endswith(tokenizer.decode(r["response_ids"][-2:], skip_special_tokens=True))
    for key, c in early.items():
        if not c["rejoined"]:
            assert c["slm_branch"] == full[key]["slm_branch"]
    # one output directory, one kind of branch; the refusal names the judge that makes the difference, not a field
    with pytest.raises(R2RError, match=r"made with rollouts to the answer's end \(--judge answer\) = on, not off: .*"
                                       "use another --out"):
        labels.step_continuations(llm_engine, tmp_path / "early", max_new_tokens=8)
    with pytest.raises(R2RError, match="made with --rejoin-tokens = 2, not 3"):
        labels.step_continuations(llm_engine, tmp_path / "early", max_new_tokens=8, rollout=True, rejoin_tokens=3)


def test_responses_stating_no_answer_get_no_rollouts(tmp_path, slm, llm, tokenizer, monkeypatch):
    run_pipeline(tmp_path / "all", slm, llm, tokenizer, judges.AnswerJudge(), rollout=True, rejoin_tokens=2)
    llm_engine = Engine.alone(llm, tokenizer)
    out = tmp_path / "skip"
    labels.step_responses(PROMPTS, llm_engine, out, max_new_tokens=24, batch_size=2)
    labels.step_prefill(slm, out)
    first = labels.Parts(out, "responses").rows()[0]
    silent = tokenizer.decode(first["response_ids"], skip_special_tokens=True)  # say it states no answer
    decoded = []  # the positions branched from
    real_branches = labels.llm_branches
    monkeypatch.setattr(labels, "llm_branches", lambda *a: decoded.extend(a[3]) or real_branches(*a))
    labels.step_continuations(llm_engine, out, 8, rollout=True, rejoin_tokens=2, answered=lambda t: t != silent)
    labels.step_judgements(judges.AnswerJudge(), out)
    rows = [c for c in labels.Parts(out, "continuations").rows() if c["position"] >= 0]
    skipped = [c for c in rows if c["id"] == first["id"]]
    assert skipped and all(c["slm_branch"] == tokenizer.decode([c["slm_token"]]) for c in skipped)
    assert len(decoded) == len(rows) - len(skipped) > 0
    both = {(c["id"], c["position"]): c for c in labels.Parts(tmp_path / "all", "continuations").rows()}
    assert all(c == both[(c["id"], c["position"])] for c in rows if c["id"] != first["id"])  # rolled out as before
    verdicts = {(j["id"], j["position"]): j["verdict"] for j in labels.Parts(out, "judgements").rows()}
    whole = {(j["id"], j["position"]): j["verdict"] for j in labels.Parts(tmp_path / "all", "judgements").rows()}
    assert verdicts == whole  # the skipped response's positions are unparseable either way


@pytest.mark.parametrize("rollout", [False, True])
def test_branches_decoded_together_equal_branches_decoded_one_at_a_time(tmp_path, slm, llm, tokenizer, rollout):
    """Batched branches start from copies of one cache, each rolled back to its position: the same tokens."""
    judge = judges.AnswerJudge() if rollout else None
    run_pipeline(tmp_path / "one", slm, llm, tokenizer, judge, rollout, rejoin_tokens=2, batch_size=1)
    run_pipeline(tmp_path / "three", slm, llm, tokenizer, judge, rollout, rejoin_tokens=2, batch_size=3)
    one, three = (sorted(labels.Parts(tmp_path / d, "continuations").rows(), key=lambda c: (c["id"], c["position"]))
                  for d in ("one", "three"))
    assert len([c for c in one if c["position"] >= 0]) > 3  # some responses have several branches
    assert one == three


def run_margin(out, slm, llm, tokenizer, margin=1.0, steps="responses,prefill,continuations,judgements,labels",
               writer="slm", prompts=None):
    path = out.parent / f"{out.name}-prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts or PROMPTS))
    return labels.run(path, out, steps, lambda: (slm, llm, tokenizer), lambda _: judges.MarginJudge(margin),
                      max_new_tokens=24, batch_size=2, margin=True, writer=writer)


def test_on_policy_margin_labels(tmp_path, slm, llm, tokenizer):
    """--writer slm --judge margin: the SLM writes, the LLM reads; divergent where the LLM ranks the SLM's token
    more than the margin below its own (the tokens --verify at that tolerance rejects)."""
    rows = pq.read_table(run_margin(tmp_path / "d", slm, llm, tokenizer)).to_pylist()
    responses = {r["id"]: r for r in labels.Parts(tmp_path / "d", "responses").rows()}
    slm_alone = Engine.alone(slm, tokenizer, "slm")
    for r in list(responses.values())[:2]:  # the SLM's own greedy responses
        assert slm_alone.generate([r["prompt_ids"]],
                                  SamplingParams(max_new_tokens=24))[0].token_ids == r["response_ids"]
    assert not any(c["position"] >= 0 for c in labels.Parts(tmp_path / "d", "continuations").rows())  # no branches
    labels_of = {label: [x for x in rows if x["label"] == label] for label in ("identical", "neutral", "divergent")}
    assert all(labels_of.values())
    for row in rows[:40] + labels_of["neutral"][:5] + labels_of["divergent"][:5]:  # checked against a fresh forward
        r = responses[row["id"]]
        prefix = r["prompt_ids"] + r["response_ids"][: row["position"]]
        logprobs = torch.log_softmax(llm.forward_sequence(prefix)[0][-1], -1)
        assert row["slm_token"] == r["response_ids"][row["position"]] and row["token"] == logprobs.argmax().item()
        gap = (logprobs.max() - logprobs[row["slm_token"]]).item()
        assert row["label"] == ("identical" if row["token"] == row["slm_token"] else
                                "divergent" if gap > 1.0 else "neutral")
        if row["label"] != "identical":
            assert float(row["judge_raw"]) == pytest.approx(gap, abs=2e-3)
    # Another margin re-judges the same positions without a model (the verdicts are rewritten whole).
    stricter = pq.read_table(run_margin(tmp_path / "d", None, None, None, margin=0.25, steps="judgements,labels")
                             ).to_pylist()
    assert [x["label"] == "identical" for x in stricter] == [x["label"] == "identical" for x in rows]
    assert sum(x["label"] == "divergent" for x in stricter) > len(labels_of["divergent"])
    itself = label_reports.agreement(tmp_path / "d", other_dir=tmp_path / "d")
    assert itself["agreement"] == 1.0
    # Against margin labels (now at 0.25 nats), the LLM's gap separates them perfectly; each wider margin calls a
    # subset of them divergent, at 1 nat exactly the first run's divergent positions.
    fit = itself["margins"]
    divergent = sum(x["label"] == "divergent" for x in stricter)
    assert fit["divergent"] == divergent and fit["roc_auc_margin"] == 1.0
    assert fit["by_margin"]["1.0"] == {"called_divergent": len(labels_of["divergent"]), "precision": 1.0,
                                       "recall": len(labels_of["divergent"]) / divergent}
    assert all(m["precision"] in (1.0, None) for m in fit["by_margin"].values())
    assert 0.0 <= fit["roc_auc_entropy"] <= 1.0


def test_margin_fit_on_planted_positions():
    """The LLM's gap and the SLM's entropy against another judge's verdicts, at each margin."""
    keys = [("a", i) for i in range(4)]
    verdict = dict(zip(keys, ["divergent", "neutral", "divergent", "neutral"]))
    gap = dict(zip(keys, [5.0, 3.5, 0.7, 0.2]))  # one divergent position far above, one below 1 nat
    entropy = dict(zip(keys, [0.1, 0.2, 0.3, 0.4]))  # entropy ranks the neutral positions higher
    fit = label_reports.margin_fit(keys, verdict, gap, entropy)
    assert fit["positions"] == 4 and fit["divergent"] == 2
    assert fit["roc_auc_margin"] == 0.75 and fit["roc_auc_entropy"] == 0.25
    assert fit["by_margin"]["0.5"] == {"called_divergent": 3, "precision": 2 / 3, "recall": 1.0}
    assert fit["by_margin"]["1.0"] == {"called_divergent": 2, "precision": 0.5, "recall": 0.5}
    assert fit["by_margin"]["4.0"] == {"called_divergent": 1, "precision": 1.0, "recall": 0.5}
    assert label_reports.margin_fit(keys, verdict, gap, {})["roc_auc_entropy"] is None


def test_margin_labels_of_llm_responses_need_no_branches(tmp_path, slm, llm, tokenizer):
    """--judge margin on the LLM's responses: the paper's differing positions, judged by the LLM's gap."""
    run_pipeline(tmp_path / "paper", slm, llm, tokenizer)
    rows = pq.read_table(run_margin(tmp_path / "m", slm, llm, tokenizer, writer="llm")).to_pylist()
    paper = pq.read_table(tmp_path / "paper" / "labels.parquet").to_pylist()
    assert [(x["token"], x["slm_token"]) for x in rows] == [(x["token"], x["slm_token"]) for x in paper]
    assert [x["label"] == "identical" for x in rows] == [x["label"] == "identical" for x in paper]
    assert {x["label"] for x in rows} == {"identical", "neutral", "divergent"}


def test_a_killed_margin_run_resumes_to_the_same_dataset(tmp_path, slm, llm, tokenizer, monkeypatch):
    whole = pq.read_table(run_margin(tmp_path / "whole", slm, llm, tokenizer)).to_pylist()
    real_write = labels.Parts.write
    writes = {"n": 0, "die_at": 0}

    def write_or_die(self, rows):
        writes["n"] += 1
        if writes["n"] == writes["die_at"]:
            raise KeyboardInterrupt
        return real_write(self, rows)

    monkeypatch.setattr(labels.Parts, "write", write_or_die)
    reached = []
    for die_at in (2, 4, 5):  # in the responses, in the prefill (SLM and LLM), in the judgements
        writes.update(n=0, die_at=die_at)
        with pytest.raises(KeyboardInterrupt):
            run_margin(tmp_path / "killed", slm, llm, tokenizer)
        reached.append({step: len(labels.Parts(tmp_path / "killed", step).rows()) for step in ("responses", "prefill")})
    assert reached == [{"responses": 2, "prefill": 0}, {"responses": 5, "prefill": 1}, {"responses": 5, "prefill": 5}]
    assert not labels.Parts(tmp_path / "killed", "judgements").rows()
    monkeypatch.setattr(labels.Parts, "write", real_write)
    assert pq.read_table(run_margin(tmp_path / "killed", slm, llm, tokenizer)).to_pylist() == whole


def test_margin_and_writer_misuse_is_refused(tmp_path, slm, llm, tokenizer):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    with pytest.raises(R2RError, match="--writer slm needs --judge margin or --judge answer"):
        labels.run(prompts, tmp_path / "x", "responses", lambda: (slm, llm, tokenizer), lambda _: None, writer="slm")
    with pytest.raises(R2RError, match="--writer takes llm or slm"):
        labels.run(prompts, tmp_path / "x", "responses", lambda: (slm, llm, tokenizer), lambda _: None, writer="both")
    with pytest.raises(R2RError, match="must be above 0"):
        judges.MarginJudge(0)
    with pytest.raises(R2RError, match="not two texts"):
        judges.check(judges.MarginJudge())
    run_pipeline(tmp_path / "paper", slm, llm, tokenizer)  # LLM-written, read by the SLM alone
    with pytest.raises(R2RError, match="ran without the LLM's reading"):
        labels.step_margin_judgements(judges.MarginJudge(), tmp_path / "paper")
    with pytest.raises(R2RError, match="use another --out"):  # its responses are the LLM's, its prefill SLM-only
        run_margin(tmp_path / "paper", slm, llm, tokenizer)
    with pytest.raises(R2RError, match="use another --out"):
        run_margin(tmp_path / "paper", slm, llm, tokenizer, writer="llm")


def run_on_policy_answer(out, slm, llm, tokenizer, batch_size=2, rejoin_tokens=0, positions_per_response=0):
    path = out.parent / f"{out.name}-prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return labels.run(path, out, "responses,prefill,continuations,judgements,labels", lambda: (slm, llm, tokenizer),
                      lambda _: judges.AnswerJudge(), max_new_tokens=24, batch_size=batch_size, rollout=True,
                      rejoin_tokens=rejoin_tokens, writer="slm", positions_per_response=positions_per_response)


def test_on_policy_answer_labels_roll_out_both_tokens(tmp_path, slm, llm, tokenizer, monkeypatch):
    """--writer slm --judge answer: on the SLM's response, the LLM writes to the end of the answer from the SLM's
    token and from its own; the verdict compares the two branches' final answers."""
    rows = pq.read_table(run_on_policy_answer(tmp_path / "a", slm, llm, tokenizer)).to_pylist()
    responses = {r["id"]: r for r in labels.Parts(tmp_path / "a", "responses").rows()}
    prefill = {p["id"]: p for p in labels.Parts(tmp_path / "a", "prefill").rows()}
    branches = [c for c in labels.Parts(tmp_path / "a", "continuations").rows() if c["position"] >= 0]
    assert len(branches) == sum(x["label"] != "identical" for x in rows) > 3
    llm_engine = Engine.alone(llm, tokenizer)
    for c in branches[:6]:  # each branch is the LLM's greedy generation from that token, to its end
        r = responses[c["id"]]
        assert c["slm_token"] == r["response_ids"][c["position"]]  # the SLM wrote the response
        assert c["llm_token"] == prefill[c["id"]]["llm_tokens"][c["position"]] != c["slm_token"]
        budget = max(len(x["response_ids"]) for x in responses.values())  # the LLM may take longer than the SLM
        limit = budget - c["position"] - 1 + labels.ROLLOUT_MARGIN
        for token, branch in ((c["slm_token"], c["slm_branch"]), (c["llm_token"], c["llm_branch"])):
            prefix = r["prompt_ids"] + r["response_ids"][: c["position"]] + [token]
            fresh = llm_engine.generate([prefix], SamplingParams(max_new_tokens=limit))[0]
            assert branch == tokenizer.decode([token] + fresh.token_ids, skip_special_tokens=True)
    verdicts = {(j["id"], j["position"]): j["verdict"] for j in labels.Parts(tmp_path / "a", "judgements").rows()}
    expected = judges.judge_cases(judges.AnswerJudge(), [(c["context"], c["llm_branch"], c["slm_branch"])
                                                         for c in branches])
    assert [verdicts[(c["id"], c["position"])] for c in branches] == [v for v, _ in expected]
    # Batched alike one at a time, and a run killed mid-continuations resumes to the same dataset.
    assert pq.read_table(run_on_policy_answer(tmp_path / "one", slm, llm, tokenizer, batch_size=1)).to_pylist() == rows
    real_write = labels.Parts.write
    writes = {"n": 0}

    def write_or_die(self, rows):  # killed after two responses' branches are saved
        writes["n"] += self.dir.name == "continuations"
        if writes["n"] == 3:
            raise KeyboardInterrupt
        return real_write(self, rows)

    monkeypatch.setattr(labels.Parts, "write", write_or_die)
    with pytest.raises(KeyboardInterrupt):
        run_on_policy_answer(tmp_path / "killed", slm, llm, tokenizer)
    assert 0 < len({c["id"] for c in labels.Parts(tmp_path / "killed", "continuations").rows()}) < len(PROMPTS)
    monkeypatch.setattr(labels.Parts, "write", real_write)
    assert pq.read_table(run_on_policy_answer(tmp_path / "killed", slm, llm, tokenizer)).to_pylist() == rows
    with pytest.raises(R2RError, match="use --rejoin-tokens 0"):
        run_on_policy_answer(tmp_path / "rejoin", slm, llm, tokenizer, rejoin_tokens=2)
    assert not (tmp_path / "rejoin" / "continuations.json").exists()  # refused before its mode is recorded
    # At most 2 positions per response rolled out: the same branches there, the others left unjudged.
    sampled = pq.read_table(run_on_policy_answer(tmp_path / "two", slm, llm, tokenizer, positions_per_response=2))
    rolled = {(c["id"], c["position"]): c for c in labels.Parts(tmp_path / "two", "continuations").rows()
              if c["position"] >= 0 and c["sampled"]}
    assert 0 < len(rolled) <= 2 * len(PROMPTS) and len(rolled) < len(branches)
    full = {(c["id"], c["position"]): c for c in branches}
    assert all(c["slm_branch"] == full[k]["slm_branch"] and c["llm_branch"] == full[k]["llm_branch"]
               for k, c in rolled.items())
    for x, y in zip(sampled.to_pylist(), rows):
        assert x["label"] == (y["label"] if (x["id"], x["position"]) in rolled or y["label"] == "identical"
                              else "unparseable")


def test_rejoin_point():
    response = [5, 6, 7, 8, 9, 10]
    assert labels.rejoin_point([1, 7, 8], response, 2) == 3  # re-joined at 7, 8 (ends at index 3)
    assert labels.rejoin_point([1, 2, 8, 9, 10], response, 3) == 5  # two tokens shorter: still the same path
    assert labels.rejoin_point([1, 8, 7], response, 2) is None
    assert labels.rejoin_point([7, 8], response, 0) is None  # 0: never stop early


def test_answer_judge_sets_aside_positions_where_the_llm_misses_the_reference():
    half = "Half of 48 "
    wrong_llm = judges.off_reference(("divergent", "'25' vs '26'"), half, "is 25. The answer is 25.", "24")
    assert wrong_llm[0] == "unparseable" and "misses the reference '24'" in wrong_llm[1]
    right_llm = ("divergent", "'24' vs '25'")
    assert judges.off_reference(right_llm, half, "is 24. The answer is \\boxed{24}", "24") == right_llm
    assert judges.off_reference(right_llm, half, "is 25. The answer is 25.", "") == right_llm  # no reference
    neutral = ("neutral", "'24' vs '24'")
    assert judges.off_reference(neutral, half, "is 24. The answer is 24.", "24.0") == neutral  # math-verify equal


def test_the_answer_judge_gets_each_prompts_reference_and_only_its_own(tmp_path, slm, llm, tokenizer, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{**p, "reference": f"ref-{i}"} for i, p in enumerate(PROMPTS)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []
    real = judges.off_reference
    monkeypatch.setattr(judges, "off_reference", lambda v, c, b, ref: seen.append(ref) or real(v, c, b, ref))
    run = lambda path, steps: labels.run(path, tmp_path / "out", steps, lambda: (slm, llm, tokenizer),  # noqa: E731
                                         lambda _: judges.AnswerJudge(), max_new_tokens=16, rollout=True)
    run(prompts, "responses,prefill,continuations,judgements,labels")
    judged = labels.Parts(tmp_path / "out", "judgements").rows()
    references = {p["id"]: p["reference"] for p in rows}
    assert seen and sorted(seen) == sorted(references[j["id"]] for j in judged)
    namesake = tmp_path / "other.jsonl"  # the same ids, other prompts: its references are not these responses'
    namesake.write_text("".join(json.dumps({**r, "prompt": r["prompt"] + " Again."}) + "\n" for r in rows))
    with pytest.raises(R2RError, match="is not the prompt set"):
        run(namesake, "judgements,labels")
    (tmp_path / "out" / "labels.parquet").unlink()
    for part in (tmp_path / "out" / "judgements").iterdir():
        part.unlink()
    seen.clear()  # one prompt changed since: only the others' references are used
    changed = [{**r, "prompt": r["prompt"] + " Again."} if i == 0 else r for i, r in enumerate(rows)]
    namesake.write_text("".join(json.dumps(r) + "\n" for r in changed))
    run(namesake, "judgements,labels")
    assert sorted(seen) == sorted(references[j["id"]] if j["id"] != rows[0]["id"] else "" for j in judged)


def test_answer_judge_compares_final_answers():
    judge = judges.AnswerJudge()
    cases = [
        ("48 / 2 ", "= 24, so the answer is 24.", "is 24. The answer is \\boxed{24}"),  # another road, same answer
        ("Half of 48 ", "is 25. The answer is 25.", "is 24. The answer is 24."),  # a changed number
        ("x = ", "1/2, the answer is \\frac{1}{2}", "0.5, so the answer is 0.5"),  # one value, two forms
        ("Who? ", "It was Alice. The answer is: Alice.", "The answer is alice"),  # short text answers
        ("Then ", "we add 3 and 4 to get 7.", "the answer is 7."),  # no answer stated in one: not guessed
        ("Then ", "we add.", "we add 3."),
    ]
    assert [v for v, _ in judge(cases)] == ["neutral", "divergent", "neutral", "neutral", "unparseable",
                                            "unparseable"]
    assert judges.build("answer").name == "answer" and judges.build("answer").rollout


@pytest.mark.parametrize("raw, verdict", [
    ("NEUTRAL", "neutral"),
    ("**Divergent**", "divergent"),
    ("  divergent.\n", "divergent"),
    ("The continuations diverge in their conclusion.", "divergent"),
    ("Neutral: only wording differs", "neutral"),
    ("neutral or divergent", "unparseable"),
    ("", "unparseable"),
    ("A", "unparseable"),
    ("I'm not sure", "unparseable"),
    ("NEUTRALITY", "unparseable"),
])
def test_judge_parser_on_odd_outputs(raw, verdict):
    assert judges.parse_verdict(raw) == verdict


def test_local_judge_records_raw_answers(slm, llm, tokenizer):
    judge = judges.LocalJudge(Engine.alone(llm, tokenizer))
    out = judge([("ctx", "It is 24.", "It is 25."), ("ctx", "Yes.", "Yes.")])
    assert len(out) == 2 and all(v in judges.VERDICTS for v, _ in out)
    assert all(v == judges.parse_verdict(raw) for v, raw in out)


def test_local_judge_reusing_its_cache_answers_as_a_fresh_one(llm, tokenizer):
    engine = Engine.alone(llm, tokenizer)
    text = "Natalia sold clips to 48 of her friends in April. Then she sold half as many in May."
    cases = [(text[:n], "It is 24.", b) for n, b in ((20, "It is 25."), (40, "So 24."), (60, "Yes."), (10, "No."))]
    shared = judges.LocalJudge(engine)
    reused = shared(cases)
    assert shared.cached  # the cache was kept between cases
    fresh = [judges.LocalJudge(engine)([case])[0] for case in cases]
    assert reused == fresh
    greedy = engine.generate([engine.prompts.chat(judges.judge_prompt(*cases[0]))],
                             SamplingParams(max_new_tokens=judges.LocalJudge.ANSWER_TOKENS))[0]
    assert fresh[0][1] == greedy.text


def test_semantic_judge():
    judge = judges.SemanticJudge()
    out = judge([("", "The answer is 24.", "The answer is 24."),
                 ("", "So we divide 48 by 2 to get 24.", "The capital of France is Paris, a large city.")])
    assert [v for v, _ in out] == ["neutral", "divergent"]
    assert out[0][1].startswith("cosine=")


def test_facts_judge_compares_numbers_and_names_not_wording():
    context = "Alice and Bella share 48 apples. The apples are split evenly between the two of them."
    out = judges.FactsJudge()([
        (context, " The total is 24 apples each.", " Each of them gets 24 apples."),  # reworded: neutral
        (context, " Each gets 24.", " Each gets 12."),  # another number
        (context, " Alice gets 24.", " Bella gets 24."),  # another person
        (context, " So 48 / 2 = 24.", " So 24 = 48 / 2."),  # the same facts in another order
        (context, " Then she eats 2.5 of them.", " Then she eats 2 of them."),
    ])
    assert [v for v, _ in out] == ["neutral", "divergent", "divergent", "neutral", "divergent"]
    assert out[1][1] == "differ: 12 24" and out[0][1] == "same facts"


def test_prompt_sets(tmp_path):
    prompts = prompt_sets.build_prompt_set(per_domain=3, seed=0)
    assert len(prompts) == 12 and {p["domain"] for p in prompts} == set(prompt_sets.DOMAINS)
    assert not any("gsm_symbolic" in p["id"] for p in prompts)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    assert prompt_sets.load_prompts(path) == prompts
    path.write_text('{"id": "a", "domain": "math"}\n')
    with pytest.raises(R2RError, match="prompt"):
        prompt_sets.load_prompts(path)
    for bad, says in (('{"id": "a", "domain": "m", "prompt": "x"}\n{"id": "a", "domain": "m", "prompt": "y"}\n',
                       "duplicate"),
                      ('{"id": "a", "domain": "m", "prompt": "x", "suffix": "y", "stop": [""]}\n',
                       "stop must be a list of non-empty strings"),
                      ('{"id": "a", "domain": "m", "prompt": "x", "suffix": 3}\n', "suffix must be a string")):
        path.write_text(bad)
        with pytest.raises(R2RError, match=says):
            prompt_sets.load_prompts(path)


def test_math_prompt_set_is_deterministic_and_checkable():
    from collections import Counter

    from roads_to_rome.data.benchmarks import MATH_INSTRUCTION

    prompts = prompt_sets.math_prompt_set(22, seed=0)
    assert prompts == prompt_sets.math_prompt_set(22, seed=0) and prompts != prompt_sets.math_prompt_set(22, seed=1)
    sources = Counter(p["id"].split("/")[1] for p in prompts)
    assert sources["champ"] == 270 and set(sources) - {"champ"} == set(prompt_sets.WORD_GENERATORS)
    assert sum(sources.values()) == 270 + 22
    assert all(p["reference"] and p["prompt"].endswith(MATH_INSTRUCTION) for p in prompts)
    assert prompt_sets.math_prompt_set(22, seed=0, champ=False) == [p for p in prompts if "/champ/" not in p["id"]]


def test_written_problems_that_copy_a_gsm8k_question_are_dropped():
    from roads_to_rome.data.benchmarks import gsm8k

    questions = [q["question"] for q in gsm8k()[:50]]
    grams = set().union(*(prompt_sets.word_ngrams(q, prompt_sets.OVERLAP_WORDS) for q in questions))
    seen = set()
    fresh = "A bakery sells 12 rolls an hour for 5 hours and gives away 7. How many rolls are left?"
    assert prompt_sets.new_problem(fresh, seen, grams)
    assert not prompt_sets.new_problem(fresh.upper().replace("?", " ?"), seen, grams)  # the same words again
    assert not prompt_sets.new_problem("A farm has 3 cows and 4 ducks.", seen, grams)  # asks nothing
    near_copy = "Here is one: " + questions[7]
    assert not prompt_sets.new_problem(near_copy, seen, grams)
    assert prompt_sets.longest_shared_run(near_copy, questions) == len(re.findall(r"[a-z0-9]+", questions[7].lower()))
    assert prompt_sets.longest_shared_run(fresh, questions) < prompt_sets.OVERLAP_WORDS


def test_label_cli(run_cli, tmp_path):
    from tiny import save_pair

    slm_dir, llm_dir = save_pair(tmp_path / "pair")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:2]))
    pair = ["--slm", slm_dir, "--llm", llm_dir, "--device", "cpu"]
    code, out, err = run_cli("label", prompts, "--out", tmp_path / "d", "--max-new-tokens", "12",
                             "--judge", "semantic", *pair)
    assert code == 0, err
    code, out, err = run_cli("label", "report", tmp_path / "d", "--json")
    assert code == 0, err
    assert json.loads(out)["overall"]["queries"] == 2
    # The labels step alone joins the parts: it loads no model (this SLM path does not exist).
    (tmp_path / "d" / "labels.parquet").unlink()
    code, out, err = run_cli("label", prompts, "--out", tmp_path / "d", "--steps", "labels",
                             "--slm", tmp_path / "no-such-model")
    assert code == 0, err
    assert (tmp_path / "d" / "labels.parquet").exists()
    code, out, err = run_cli("label", tmp_path / "missing.jsonl", "--out", tmp_path / "e", *pair)
    assert code != 0 and "does not exist" in err
    code, out, err = run_cli("label", "check-judge", "--judge", "local", "--json", "--llm", llm_dir, "--device", "cpu")
    assert code == 0, err
    checked = json.loads(out)
    assert checked["cases"] == len(checked["answers"]) >= 20 and 0 <= checked["accuracy"] <= 1
    code, out, err = run_cli("label", "check-judge", tmp_path / "p.jsonl", "--judge", "semantic")
    assert code != 0 and "judge check set" in err
    code, out, err = run_cli("label", prompts, "--out", tmp_path / "m", "--max-new-tokens", "12", "--writer", "slm",
                             "--judge", "margin", "--margin", "0.5", *pair)
    assert code == 0, err
    assert {r["judge"] for r in labels.Parts(tmp_path / "m", "judgements").rows()} <= {"margin"}
    assert json.loads((tmp_path / "m" / "responses.json").read_text()) ["writer"] == "slm"
    # --chat-template: the responses answer prompts in it, and a resume in another is refused
    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    args = ["label", prompts, "--out", tmp_path / "t", "--max-new-tokens", "4", "--writer", "slm", "--judge",
            "margin", "--steps", "responses", *pair]
    code, out, err = run_cli(*args, "--chat-template", template)
    assert code == 0, err
    from transformers import AutoTokenizer

    written = AutoTokenizer.from_pretrained(slm_dir).encode(f"Q: {PROMPTS[0]['prompt']}\nA:")
    assert labels.Parts(tmp_path / "t", "responses").rows()[0]["prompt_ids"] == written
    code, out, err = run_cli(*args)
    assert code != 0 and "made with --chat-template" in err
    for bad, says in ((["--margin", "-1"], "must be above 0"), (["--writer", "slm"], "needs --judge margin"),
                      (["--judge-url", "http://127.0.0.1:9/v1"], "which --judge facts does not ask"),
                      (["--rejoin-tokens", "2"], "--judge facts makes none")):
        code, out, err = run_cli("label", prompts, "--out", tmp_path / "n", "--judge", "margin" if bad[0] ==
                                 "--margin" else "facts", *bad, *pair)
        assert code != 0 and says in err and "Traceback" not in err
    code, out, err = run_cli("label", "prompts", "--recipe", "infill", "--functions", "3",
                             "--out", tmp_path / "i.jsonl")
    assert code == 0 and "3 prompts in 1 domain(s) (infill)" in out, err
    assert prompt_sets.load_prompts(tmp_path / "i.jsonl") == prompt_sets.infill_prompt_set(3)
    code, out, err = run_cli("label", "prompts", "--recipe", "code", "--out", tmp_path / "x.jsonl")
    assert code != 0 and "--recipe takes default, math or infill" in err and "Traceback" not in err


def test_agreement_between_two_judges(tmp_path, slm, llm, tokenizer):
    run_pipeline(tmp_path, slm, llm, tokenizer)
    labels.step_judgements(EveryOtherJudge(), tmp_path, name="judgements-same")
    same = label_reports.agreement(tmp_path, "judgements-same")
    assert same["agreement"] == 1.0 and same["positions"] > 0

    class Contrary:
        name = "contrary"

        def __call__(self, cases):
            return [("neutral" if len(b) > len(a) else "divergent", "") for _, a, b in cases]

    labels.step_judgements(Contrary(), tmp_path, name="judgements-contrary")
    assert label_reports.agreement(tmp_path, "judgements-contrary")["agreement"] == 0.0


def test_agreement_between_early_stopped_and_full_rollouts(tmp_path, slm, llm, tokenizer, run_cli):
    """`r2r label agree EARLY --against FULL`: what stopping at a re-join changed, on the positions it stopped at."""
    run_pipeline(tmp_path / "full", slm, llm, tokenizer, judges.AnswerJudge(), rollout=True, rejoin_tokens=0)
    run_pipeline(tmp_path / "early", slm, llm, tokenizer, judges.AnswerJudge(), rollout=True, rejoin_tokens=2)
    result = label_reports.agreement(tmp_path / "early", other_dir=tmp_path / "full")
    stopped = [c for c in labels.Parts(tmp_path / "early", "continuations").rows() if c.get("rejoined")]
    assert result["positions"] == len([c for c in labels.Parts(tmp_path / "full", "continuations").rows()
                                       if c["position"] >= 0])
    assert result["rejoined"]["positions"] == len(stopped) > 0
    assert sum(result["rejoined"]["confusion (pipeline judge/other judge)"].values()) == len(stopped)
    assert label_reports.agreement(tmp_path / "full", other_dir=tmp_path / "full")["agreement"] == 1.0
    judged = result["judged"]["confusion (pipeline judge/other judge)"]
    assert not any("unparseable" in pair for pair in judged) and sum(judged.values()) == result["judged"]["positions"]
    committed = tmp_path / "committed"  # a dataset as committed: labels.parquet only, no judgement parts
    committed.mkdir()
    (tmp_path / "full" / "labels.parquet").rename(committed / "labels.parquet")
    assert label_reports.agreement(tmp_path / "early", other_dir=committed) == result
    code, out, _ = run_cli("label", "agree", committed, "--against", tmp_path / "early")  # labels.parquet first too
    assert code == 0 and json.loads(out)["positions"] == result["positions"]
    code, out, err = run_cli("label", "agree", tmp_path / "early", "--against", tmp_path / "full")
    assert code == 0, err
    assert json.loads(out)["rejoined"] == result["rejoined"]
    code, out, err = run_cli("label", "agree", tmp_path / "early", "--against", tmp_path / "nowhere")
    assert code != 0 and "has no judgements yet" in err and "Traceback" not in err


def test_same_text_is_neutral_without_asking_the_judge():
    asked = []

    def judge(cases):
        asked.extend(cases)
        return [("divergent", "DIVERGENT") for _ in cases]

    out = judges.judge_cases(judge, [("c", "It is 24.", " It is  24."), ("c", "It is 24.", "It is 25.")])
    assert out == [("neutral", "same text"), ("divergent", "DIVERGENT")]
    assert asked == [("c", "It is 24.", "It is 25.")]


def test_judge_check_against_hand_labels(tmp_path):
    cases = [("a", "x", "neutral"), ("b", "y", "divergent"), ("c", "z", "divergent"), ("d", "w", "neutral"),
             ("e", "e", "neutral")]
    path = tmp_path / "check.jsonl"
    path.write_text("".join(json.dumps({"context": "", "a": a, "b": b, "label": label}) + "\n"
                            for a, b, label in cases))
    said = {"x": "divergent", "y": "divergent", "z": "neutral", "w": "neutral"}  # 1 FP, 1 TP, 1 FN, 1 TN
    result = judges.check(lambda cs: [(said[b], said[b].upper()) for _, _, b in cs], path)
    assert result["cases"] == 5 and result["divergent_cases"] == 2
    assert result["accuracy"] == pytest.approx(3 / 5)
    assert result["divergent_recall"] == pytest.approx(1 / 2) and result["divergent_precision"] == pytest.approx(1 / 2)
    chance = (3 / 5) * (3 / 5) + (2 / 5) * (2 / 5)
    assert result["kappa"] == pytest.approx((3 / 5 - chance) / (1 - chance))
    assert result["answers"][4] == {"label": "neutral", "verdict": "neutral", "raw": "same text"}
    path.write_text('{"context": "", "a": "x", "b": "y", "label": "maybe"}\n')
    with pytest.raises(R2RError, match="neutral or divergent"):
        judges.check(lambda cs: [], path)


def test_the_shipped_judge_check_set_is_well_formed():
    rows = [json.loads(line) for line in judges.CHECK_SET.read_text().splitlines()]
    assert len(rows) >= 20 and {r["label"] for r in rows} == {"neutral", "divergent"}
    assert all(r["a"] and r["b"] is not None for r in rows)


def test_the_committed_datasets_match_their_reports():
    """data/labels/default (facts labels), data/labels/onpolicy (on-policy margin labels, the shipped router's) and
    data/labels/infill (on-policy margin labels of lines of code filled in) are datasets of token ids and labels;
    each report.json is its report."""
    root = Path(__file__).parent.parent / "data" / "labels"
    assert label_reports.report(root / "default") == json.loads((root / "report.json").read_text())
    for name in ("onpolicy", "infill"):
        assert label_reports.report(root / name) == json.loads((root / name / "report.json").read_text())
        prompts = [json.loads(line)["id"] for line in (root / name / "prompts.jsonl").read_text().splitlines()]
        labelled = {r["id"] for r in labels.Parts(root / name, "responses").rows()}
        assert set(prompts[: len(labelled)]) == labelled  # the prompt set's first prompts, in order


def test_a_resume_with_other_settings_is_refused_naming_the_setting(tmp_path, slm, llm, tokenizer):
    out = tmp_path / "run"
    run_pipeline(out, slm, llm, tokenizer)
    llm_engine = Engine.alone(llm, tokenizer)
    with pytest.raises(R2RError, match="made with --max-new-tokens = 24, not 48"):  # responses of two lengths would mix
        labels.step_responses(PROMPTS, llm_engine, out, max_new_tokens=48, batch_size=2)
    with pytest.raises(R2RError, match='made with --judge = "stub", not "answer"'):  # verdicts of two judges would mix
        labels.step_judgements(judges.AnswerJudge(), out, batch_size=4)
    labels.step_responses(PROMPTS, llm_engine, out, max_new_tokens=24, batch_size=2)  # the same settings resume


def test_a_directory_another_process_is_labelling_into_is_refused_before_any_model_loads(tmp_path, slm, llm,
                                                                                          tokenizer):
    from roads_to_rome import files

    out = tmp_path / "run"
    run_pipeline(out, slm, llm, tokenizer)
    (out / "labels.parquet").unlink()

    def never():
        raise AssertionError("no model loads while another process labels into the directory")

    with files.exclusive(out, never):  # as another process's run would
        with pytest.raises(R2RError, match="another process is labelling into .*run now"):
            labels.run(tmp_path / "prompts.jsonl", out, "prefill,labels", load_pair=never, judge_for=never)
    assert labels.run(tmp_path / "prompts.jsonl", out, "labels", load_pair=never, judge_for=never).exists()


def test_a_margin_step_cut_short_leaves_the_old_verdicts_whole(tmp_path, slm, llm, tokenizer, monkeypatch):
    out = tmp_path / "margin"
    run_margin(out, slm, llm, tokenizer, margin=1.0)
    before = sorted(map(str, labels.Parts(out, "judgements").rows()))
    assert before

    def dies(self, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(labels.Parts, "write", dies)
    with pytest.raises(KeyboardInterrupt):
        labels.step_margin_judgements(judges.MarginJudge(3.0), out)
    monkeypatch.undo()
    assert sorted(map(str, labels.Parts(out, "judgements").rows())) == before


LIBRARY = {
    "shapes.py": '''
def area(width, height):
    """The area.

    Of a rectangle.
    """
    # width times height
    product = width * height

    return product


class Box:
    def volume(self, depth):
        base = self.width * self.height
        if depth < 0:
            raise ValueError("depth")
        total = base * depth
        return total

    def short(self):
        return 1

    def usage(self):
        text = """
no indentation here
"""
        first = text.strip()
        second = first.upper()
        return second
''',
    "test/test_shapes.py": "def test_area():\n    a = 1\n    b = 2\n    c = 3\n    d = 4\n    assert a + b + c + d\n",
    "broken.py": "def f(:\n",
}


def test_infill_prompts_take_one_line_of_code_out_of_a_library_function(tmp_path):
    """The infill recipe: each prompt is a function's code before one line of its body, the suffix the code after
    it, the reference that line, the response stopped at the line's end; signatures, docstrings, comments, blank
    lines, tests and functions a string keeps from being dedented are never asked for; the seed fixes the set."""
    for name, text in LIBRARY.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    functions = {name: (source, holes) for name, source, holes in prompt_sets.library_functions(tmp_path)}
    assert set(functions) == {"shapes.area", "shapes.Box.volume"}  # short, test, undedentable and broken left out
    area, holes = functions["shapes.area"]
    assert [area.splitlines()[k] for k in holes] == ["    product = width * height", "    return product"]
    assert functions["shapes.Box.volume"][0].startswith("def volume(self, depth):\n    base")  # dedented
    assert len(functions["shapes.Box.volume"][1]) == 5
    seen = set()
    for seed in range(6):
        rows = prompt_sets.infill_prompt_set(2, seed=seed, root=tmp_path)
        assert rows == prompt_sets.infill_prompt_set(2, seed=seed, root=tmp_path)
        assert len({r["id"] for r in rows}) == 2
        for r in rows:
            source = functions[r["id"].split("/")[1]][0]
            assert r["prompt"] + r["reference"] + r["suffix"] == source and r["stop"] == ["\n"]
            assert r["reference"].strip() and not r["reference"].strip().startswith(("#", '"', "def "))
            seen.add(r["reference"].strip())
    assert len(seen) > 3  # the seed draws the line too
    with pytest.raises(R2RError, match="2 functions to fill in, not 3"):
        prompt_sets.infill_prompt_set(3, root=tmp_path)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prompt_sets.load_prompts(path) == rows  # a suffix and stop strings kept


def test_the_standard_librarys_infill_prompts_rebuild_its_functions():
    rows = prompt_sets.infill_prompt_set(40, seed=1)
    assert len({r["id"] for r in rows}) == 40 and all(r["domain"] == "infill" for r in rows)
    for r in rows:
        function = r["prompt"] + r["reference"] + r["suffix"]
        compile(function, r["id"], "exec")  # a whole function again
        assert r["reference"].strip() and "\n" not in r["reference"]


def test_infill_responses_are_asked_in_the_middle_and_end_at_their_stop(tmp_path, slm, tokenizer):
    """A prompt with a suffix is read in the fill-in-the-middle format; a response ends at its first stop string
    (its token kept: what the router meets), as a request with that stop ends."""
    from roads_to_rome.core.request import Request

    writer = Engine.alone(slm, tokenizer, "slm")
    writer.prompts.fim_ids = (0, 1, 2)  # the tiny tokenizer's special tokens stand in for the FIM markers
    prompts = [{"id": f"f{i}", "domain": "infill", "prompt": f"def add(a, b):\n    {i}", "suffix": "\n    return c\n",
                "stop": ["l"]} for i in range(4)] + [{"id": "chat", "domain": "qa", "prompt": "What is 48 / 2?"}]
    labels.step_responses(prompts, writer, tmp_path, max_new_tokens=24, batch_size=3, writer="slm")
    rows = {r["id"]: r for r in labels.Parts(tmp_path, "responses").rows()}
    assert rows["chat"]["prompt_ids"] == writer.prompts.chat("What is 48 / 2?")
    stopped = 0
    for p in prompts[:4]:
        r = rows[p["id"]]
        assert r["prompt_ids"] == writer.prompts.infill(p["prompt"], p["suffix"])
        assert r["prompt_ids"][0] == 0 and r["prompt_ids"][-1] == 2
        alone = writer.run([Request(r["prompt_ids"], SamplingParams(max_new_tokens=24))])[0].token_ids
        n = len(r["response_ids"])
        assert r["response_ids"] == alone[:n]  # the greedy response, cut where it stops
        assert "l" not in tokenizer.decode(r["response_ids"][:-1])
        stopped += r["finish_reason"] == "stop"
        if r["finish_reason"] == "stop":
            assert "l" in tokenizer.decode(r["response_ids"])
    assert stopped  # the stop string ended some response, not only the length limit
