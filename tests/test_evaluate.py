"""The evaluation harness on a tiny pair: files, resume, summary from the per-item file, report."""

import json

import pytest
from tiny import save_pair

from roads_to_rome.data.stats import wilson
from roads_to_rome.eval.evaluate import markdown_table, read_results, routing_profile, summaries, summarize


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # HumanEval's prompts are long in the tiny tokenizer's tokens (one per few letters)
    slm_dir, llm_dir = save_pair(tmp_path_factory.mktemp("pair"), max_positions=4096)
    return ["--slm", slm_dir, "--llm", llm_dir, "--device", "cpu"]


def test_eval_writes_results_summary_plots_and_report(run_cli, pair, tmp_path):
    code, out, err = run_cli("eval", "--benchmark", "gsm8k", "--systems", "slm,llm,entropy,random", "--ids", "0-2",
                             "--max-new-tokens", "8", "--llm-rate", "0.3", "--sweep", "0.1,0.5", "--out", tmp_path,
                             *pair)
    assert code == 0, err
    d = tmp_path / "gsm8k"
    for name in ("slm", "llm", "entropy", "random", "entropy@0.1", "entropy@0.5"):
        rows = read_results(d / f"{name}.jsonl")
        assert [r["id"] for r in rows] == ["0", "1", "2"]
        for r in rows:
            assert len(r["sources"]) == len(r["token_ids"]) == r["tokens"] <= 8
    assert all(c == "L" for r in read_results(d / "llm.jsonl") for c in r["sources"])
    assert all(c == "S" for r in read_results(d / "slm.jsonl") for c in r["sources"])
    summary = json.loads((d / "summary.json").read_text())["systems"]
    for name, s in summary.items():  # the summary is exactly what the per-item file says (and the gap, below)
        assert {k: v for k, v in s.items() if k != "gap_recovered"} == summarize(read_results(d / f"{name}.jsonl"))
    rows = read_results(d / "random.jsonl")
    assert summary["random"]["accuracy"] == sum(r["correct"] for r in rows) / 3
    assert summary["random"]["llm_rate"] == sum(r["llm_tokens"] for r in rows) / sum(r["tokens"] for r in rows)
    for name in ("pareto_params.png", "pareto_speed.png", "routing_by_position.png", "report.html"):
        assert (d / name).stat().st_size > 0
    report = (d / "report.html").read_text()
    assert "entropy@0.5" in report and 'class="llm"' in report and "| system |" in out


def test_eval_resumes_without_redoing_or_duplicating(run_cli, pair, tmp_path):
    args = ["eval", "--benchmark", "gsm8k", "--systems", "slm", "--ids", "0-3", "--max-new-tokens", "6",
            "--out", tmp_path, *pair]
    assert run_cli(*args)[0] == 0
    path = tmp_path / "gsm8k" / "slm.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["output"] = "KEPT"  # proves row 0 is not recomputed
    # As if killed while writing item 3: its line is cut off, item 2's is gone.
    path.write_text("\n".join([json.dumps(first), lines[1], lines[3][:20]]))
    assert run_cli(*args)[0] == 0
    rows = read_results(path)
    assert sorted(r["id"] for r in rows) == ["0", "1", "2", "3"]
    assert rows[0]["output"] == "KEPT"
    code, _, err = run_cli(*args[:-len(pair)], "--max-new-tokens", "7", *pair)  # another configuration
    assert code != 0 and "another configuration" in err


def test_a_system_another_process_is_running_into_the_directory_is_refused_and_the_others_run(run_cli, pair, tmp_path):
    """Two runs of one system into one directory would run the same items and write each twice: the second is
    refused, naming the system; a system nobody else is running goes on."""
    from roads_to_rome import files

    d = tmp_path / "gsm8k"
    d.mkdir()
    args = ["eval", "--benchmark", "gsm8k", "--ids", "0-1", "--max-new-tokens", "4", "--out", tmp_path, *pair]

    def busy():
        raise AssertionError("nothing else holds it")

    with files.exclusive(d / "slm.config.json", busy):  # as another process's run of slm would
        code, _, err = run_cli(*args[:1], "--systems", "llm,slm", *args[1:])
        assert code != 0 and "another process is running slm into" in err and "Traceback" not in err
    assert [r["id"] for r in read_results(d / "llm.jsonl")] == ["0", "1"] and not read_results(d / "slm.jsonl")
    assert run_cli(*args[:1], "--systems", "slm", *args[1:])[0] == 0  # once it has ended
    assert [r["id"] for r in read_results(d / "slm.jsonl")] == ["0", "1"]


def test_eval_resumes_from_slim_rows(run_cli, pair, tmp_path):
    """Committed results (data/evals/) keep no outputs or token ids: a run resumes from them and reports."""
    args = ["eval", "--benchmark", "gsm8k", "--systems", "slm,entropy", "--ids", "0-1", "--max-new-tokens", "5",
            "--out", tmp_path, *pair]
    assert run_cli(*args)[0] == 0
    d = tmp_path / "gsm8k"
    for name in ("slm", "entropy"):
        path = d / f"{name}.jsonl"
        slim = [{k: v for k, v in r.items() if k not in ("output", "token_ids")} for r in read_results(path)]
        path.write_text("".join(json.dumps(r) + "\n" for r in slim))
    code, out, err = run_cli(*[("0-3" if a == "0-1" else a) for a in args])
    assert code == 0, err
    rows = read_results(d / "entropy.jsonl")
    assert [r["id"] for r in rows] == ["0", "1", "2", "3"] and "output" not in rows[0] and "output" in rows[2]
    assert json.loads((d / "summary.json").read_text())["systems"]["entropy"]["items"] == 4
    assert "entropy" in (d / "report.html").read_text()


def test_eval_humaneval_and_errors(run_cli, pair, tmp_path):
    code, out, err = run_cli("eval", "--benchmark", "humaneval", "--systems", "slm", "--ids", "0-1",
                             "--max-new-tokens", "4", "--out", tmp_path, *pair)
    assert code == 0, err
    rows = read_results(tmp_path / "humaneval" / "slm.jsonl")
    assert [r["correct"] for r in rows] == [False, False]  # a 4-token random model does not pass tests
    for args, message in [
        (["--systems", "r2r"], "needs a trained router"),
        (["--systems", "gpt"], "--systems"),
        (["--benchmark", "mmlu"], "unknown benchmark"),
        (["--ids", "0-99999"], "outside"),
        # a setting no chosen system reads: refused, not left out of a table that looks made with it
        (["--threshold", "0.3"], "--threshold is r2r's, and --systems slm does not read it"),
        (["--spec-k", "3"], "--spec-k is the spec system's"),
        (["--systems", "r2r,random", "--llm-rate", "0.2"], "beside r2r they match its rate"),
        (["--router-path", "somewhere"], "--router-path is r2r's and --sweep's"),
        (["--verify", "1"], "--systems slm has none: add one, or leave --verify out"),
    ]:
        base = {"--benchmark": "gsm8k", "--systems": "slm", "--ids": "0"}
        for k, v in zip(args[::2], args[1::2]):
            base[k] = v
        flat = [x for kv in base.items() for x in kv]
        code, _, err = run_cli("eval", *flat, "--max-new-tokens", "2", "--out", tmp_path, *pair)
        assert code != 0 and message in err, err
        assert len(err.strip().splitlines()) == 1


def test_statistics_helpers():
    low, high = wilson(50, 100)
    assert low == pytest.approx(0.404, abs=1e-3) and high == pytest.approx(0.596, abs=1e-3)
    assert wilson(0, 0) == (0.0, 0.0)
    profile = routing_profile([{"sources": "LSSSSSSSSL"}], bins=5)
    assert profile == [0.5, 0.0, 0.0, 0.0, 0.5]


def test_eval_r2r_results_belong_to_one_router(run_cli, pair, tmp_path):
    """Resuming r2r with a retrained router would mix two systems in one file: refused."""
    import torch

    from roads_to_rome.models import load_pair
    from roads_to_rome.models.loading import pick_dtype
    from roads_to_rome.routing.router import Router, RouterCheckpoint, RouterConfig, save_router, slm_identity

    slm, _, _ = load_pair(str(pair[1]), None, "cpu", need_llm=False, dtype=pick_dtype("auto", "cpu"))  # as eval does
    config = RouterConfig(hidden_size=slm.hidden_size, embed_size=slm.embedding_table().shape[1], top_k=16, dim=16,
                          n_blocks=1)
    for seed in (0, 1):
        torch.manual_seed(seed)
        save_router(tmp_path / f"router{seed}", RouterCheckpoint(Router(config), 0.5, slm_identity(slm)))
    args = ["eval", "--benchmark", "gsm8k", "--systems", "r2r", "--ids", "0", "--max-new-tokens", "4",
            "--out", tmp_path, *pair, "--router-path"]
    for _ in range(2):  # the same router resumes
        code, _, err = run_cli(*args, tmp_path / "router0")
        assert code == 0, err
    code, _, err = run_cli(*args, tmp_path / "router1")
    assert code != 0 and "another configuration" in err


def test_entropy_matched_to_r2r_routes_short_answers_at_r2rs_rate(run_cli, pair, tmp_path):
    """Answers shorter than the rate control's warm-up never aim: the matched entropy baseline routes them at the
    SLM's entropy quantile at R2R's rate over R2R's own tokens, and routes each token by it."""
    import torch

    from roads_to_rome.data import benchmarks
    from roads_to_rome.models import load_pair
    from roads_to_rome.models.loading import pick_dtype
    from roads_to_rome.models.systems import alone
    from roads_to_rome.routing.policies import entropy
    from roads_to_rome.routing.rate import WARMUP_TOKENS, threshold_at_rate
    from roads_to_rome.routing.router import Router, RouterCheckpoint, RouterConfig, save_router, slm_identity

    slm, _, tokenizer = load_pair(str(pair[1]), None, "cpu", need_llm=False, dtype=pick_dtype("auto", "cpu"))  # (eval)
    config = RouterConfig(hidden_size=slm.hidden_size, embed_size=slm.embedding_table().shape[1], top_k=16, dim=16,
                          n_blocks=1)
    torch.manual_seed(0)
    save_router(tmp_path / "router", RouterCheckpoint(Router(config), 0.5, slm_identity(slm)))
    code, _, err = run_cli("eval", "--benchmark", "gsm8k", "--systems", "r2r,entropy", "--ids", "0-5",
                           "--max-new-tokens", str(WARMUP_TOKENS - 4), "--out", tmp_path, *pair,
                           "--router-path", tmp_path / "router", "--threshold", "0.65")  # about half the tokens
    assert code == 0, err
    d, encoder = tmp_path / "gsm8k", alone(slm, tokenizer, "slm")
    items = {item.id: item for item in benchmarks.load("gsm8k")[:6]}

    def entropies(row):
        prompt = encoder.prompts.prompt(items[row["id"]].prompt)
        return entropy(slm.forward_sequence(prompt + row["token_ids"][:-1], len(prompt) - 1)[0])

    r2r = read_results(d / "r2r.jsonl")
    rate = summarize(r2r)["llm_rate"]
    warmup = json.loads((d / "entropy.config.json").read_text())["warmup"]
    assert 0 < rate < 1 and warmup == pytest.approx(threshold_at_rate(torch.cat([entropies(r) for r in r2r]), rate),
                                                    abs=1e-3)
    checked = 0
    for row in read_results(d / "entropy.jsonl"):
        for score, source in zip(entropies(row).tolist(), row["sources"]):
            if abs(score - warmup) > 0.02:  # decoding step by step rounds apart from one forward over it all
                assert (source == "L") == (score >= warmup)
                checked += 1
    assert checked > 30


def test_summary_covers_every_system_run_in_the_directory(run_cli, pair, tmp_path):
    """A benchmark run in chunks or one system at a time still ends in one table over the selected items."""
    common = ["eval", "--benchmark", "gsm8k", "--max-new-tokens", "3", "--out", tmp_path, *pair]
    for systems, ids in (("llm", "0-1"), ("slm", "0"), ("slm", "0-1")):  # slm item 0 is cached
        assert run_cli(*common, "--systems", systems, "--ids", ids)[0] == 0
    summary = json.loads((tmp_path / "gsm8k" / "summary.json").read_text())["systems"]
    assert list(summary) == ["slm", "llm"]
    assert summary["slm"]["items"] == summary["llm"]["items"] == 2
    code, out, err = run_cli(*common, "--systems", "slm", "--ids", "0")  # fewer items: the table follows --ids
    summary = json.loads((tmp_path / "gsm8k" / "summary.json").read_text())["systems"]
    assert code == 0 and summary["llm"]["items"] == 1 and "| llm |" in out


def test_eval_runs_verified_and_speculative_systems(run_cli, pair, tmp_path):
    """--verify makes one system per setting; strict verification and speculative decoding give the LLM's
    own answers (float32, so chunked and one-token LLM forwards agree to the last bit that matters)."""
    code, out, err = run_cli("eval", "--benchmark", "gsm8k", "--systems", "llm,random,spec", "--ids", "0-2",
                             "--max-new-tokens", "10", "--llm-rate", "0.2", "--verify", "off,strict,1",
                             "--max-unverified", "3", "--spec-k", "3", "--out", tmp_path, *pair, "--dtype", "float32")
    assert code == 0, err
    d = tmp_path / "gsm8k"
    summary = json.loads((d / "summary.json").read_text())["systems"]
    assert set(summary) == {"llm", "random", "random+verify=strict+n=3", "random+verify=1+n=3", "spec+k=3"}
    llm = {r["id"]: r["token_ids"] for r in read_results(d / "llm.jsonl")}
    for name in ("random+verify=strict+n=3", "spec+k=3"):
        rows = read_results(d / f"{name}.jsonl")
        assert {r["id"]: r["token_ids"] for r in rows} == llm, name
        assert all(r["llm_tokens"] == sum(c in "LF" for c in r["sources"]) for r in rows)
    assert sum(r["rollbacks"] for r in read_results(d / "spec+k=3.jsonl")) > 0
    assert "rollbacks / 100 tokens" in out
    code, _, err = run_cli("eval", "--benchmark", "gsm8k", "--systems", "random", "--ids", "0", "--verify", "maybe",
                           "--out", tmp_path, *pair)
    assert code != 0 and "verify takes off, strict or a tolerance" in err and len(err.strip().splitlines()) == 1


def test_paired_counts_and_the_speed_pareto_scripts(tmp_path):
    """scripts/paired.py (exact McNemar on the items where two systems disagree) and scripts/pareto-speed.py
    (eval accuracy against `r2r bench` tokens/s, speculative decoding at the LLM's accuracy)."""
    import subprocess
    import sys
    from pathlib import Path

    scripts = Path(__file__).parent.parent / "scripts"
    correct = {"slm": [0] * 10, "llm": [1] * 8 + [0] * 2, "r2r": [1] * 2 + [0] * 8, "r2r+verify=1": [1] * 9 + [0]}
    for system, marks in correct.items():
        (tmp_path / f"{system}.jsonl").write_text("".join(json.dumps(
            {"id": str(i), "correct": bool(c), "tokens": 100, "llm_tokens": 0 if system == "slm" else 10})
            + "\n" for i, c in enumerate(marks)))
    with (tmp_path / "r2r.jsonl").open("a") as f:
        f.write('{"id": "10", "correct": tr')  # a line an eval still running (or killed) has not finished
    out = subprocess.run([sys.executable, scripts / "paired.py", tmp_path, "r2r+verify=1", "r2r"],
                         capture_output=True, text=True, check=True).stdout
    # verify=1 alone right on items 2-8 (7), r2r alone on none: p = 2 * 0.5^7
    assert "only r2r+verify=1 right 7, only r2r right 0, McNemar p=0.016" in out.splitlines()[-1]
    other = tmp_path / "other"
    other.mkdir()
    (other / "entropy.jsonl").write_text((tmp_path / "r2r.jsonl").read_text())  # a system from another run
    out = subprocess.run([sys.executable, scripts / "paired.py", tmp_path, "r2r+verify=1", f"{other}:entropy"],
                         capture_output=True, text=True, check=True).stdout
    assert f"only r2r+verify=1 right 7, only {other}:entropy right 0, McNemar p=0.016" in out.splitlines()[-1]
    # Two verifying systems: rollbacks per token item by item, with a sign test; none for systems that do not verify.
    for system, rollbacks in (("r2r+verify=1", [1] * 10), ("entropy+verify=1", [3] * 8 + [0] * 2)):
        (tmp_path / f"{system}.jsonl").write_text("".join(json.dumps(
            {"id": str(i), "correct": True, "tokens": 100, "llm_tokens": 10, "rollbacks": k}) + "\n"
            for i, k in enumerate(rollbacks)))
    out = subprocess.run([sys.executable, scripts / "paired.py", tmp_path, "r2r+verify=1", "entropy+verify=1"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    # fewer for r2r on items 0-7, for entropy on 8-9: p = 2 * (1 + 10 + 45) / 2^10
    assert out[-1] == ("rollbacks: r2r+verify=1 10 (1.00 / 100 tokens), entropy+verify=1 24 (2.40) | fewer per "
                       "token: r2r+verify=1 on 8 items, entropy+verify=1 on 2, 0 tied, sign test p=0.11")
    out = subprocess.run([sys.executable, scripts / "paired.py", tmp_path, "r2r+verify=1", "r2r"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-1].startswith("all: ")
    summary = {"benchmark": "gsm8k", "ids": "0-9", "systems": {
        s: {"accuracy": sum(m) / 10, "accuracy_ci95": [0.0, 1.0], "llm_rate": 0.1} for s, m in correct.items()}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    bench = {"processor": "test CPU", "systems": {
        name + " (llamacpp)": {"tokens_per_s": speed} for name, speed in
        (("LLM alone", 27.0), ("SLM alone", 48.0), ("R2R", 26.0), ("R2R verify=1.0", 20.0), ("speculative k=4", 19.0))}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    subprocess.run([sys.executable, scripts / "pareto-speed.py", tmp_path, tmp_path / "bench.json",
                    tmp_path / "plot.png"], capture_output=True, text=True, check=True)
    points = {p["system"]: p for p in json.loads((tmp_path / "plot.json").read_text())["points"]}
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert points["r2r+verify=1"]["tokens_per_s"] == 20.0 and points["r2r+verify=1"]["accuracy"] == 0.9
    assert points["speculative k=4"]["accuracy"] == 0.8 and points["llm"]["tokens_per_s"] == 27.0
    missing = subprocess.run([sys.executable, scripts / "pareto-speed.py", tmp_path / "nowhere",
                              tmp_path / "bench.json",
                              tmp_path / "x.png"], capture_output=True, text=True)
    assert missing.returncode != 0 and "not found" in missing.stderr and "Traceback" not in missing.stderr


def test_gap_recovered_only_on_the_items_both_models_ran(tmp_path):
    """The share of the SLM->LLM gap a system closes: on the SLM's and the LLM's own items, else not at all."""
    def write(name, correct):
        rows = [{"id": str(i), "correct": c, "tokens": 10, "llm_tokens": 1, "avg_params_b": 1.0, "time_s": 1.0}
                for i, c in enumerate(correct)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("slm", [1, 0, 0, 0])  # 25%
    write("llm", [1, 1, 1, 0])  # 75%
    write("r2r", [1, 1, 0, 0])  # 50%: half the gap
    write("entropy", [0, 0, 0, 0])  # below the SLM: a negative share
    write("random", [1, 1, 1])  # other items: no share
    table = summaries(tmp_path)
    assert table["r2r"]["gap_recovered"] == 0.5 and table["entropy"]["gap_recovered"] == -0.5
    assert "gap_recovered" not in table["random"] and "gap_recovered" not in table["slm"]
    assert "gap_recovered" not in summaries(tmp_path, {"0"})["r2r"]  # the two models tie there: no gap to close
    assert "| r2r | 4 | 50.0% " in markdown_table(table) and "| 50% |" in markdown_table(table)
    assert "| random | 3 | " in markdown_table(table) and "| – |" in markdown_table(table)


def test_the_report_marks_routed_tokens_and_fixes_apart(tokenizer):
    from roads_to_rome.eval.evaluate import highlight

    ids = tokenizer("What is 48 / 2?", add_special_tokens=False)["input_ids"][:3]
    page = highlight({"token_ids": ids, "sources": "SLF"}, tokenizer)
    assert page.count('class="llm"') == 1 and page.count('class="fix"') == 1


def test_eval_writes_prompts_in_the_chat_template_given_and_resumes_only_with_it(run_cli, pair, tmp_path):
    import hashlib

    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    args = ["eval", "--benchmark", "gsm8k", "--systems", "slm", "--ids", "0-1", "--max-new-tokens", "4",
            "--out", tmp_path, *pair]
    assert run_cli(*args, "--chat-template", template)[0] == 0
    config = json.loads((tmp_path / "gsm8k" / "slm.config.json").read_text())
    assert config["chat_template"] == hashlib.sha256(template.encode()).hexdigest()[:16]
    code, _, err = run_cli(*args)  # the tokenizer's own template: another configuration
    assert code != 0 and "another configuration" in err
    refusing = "{{ raise_exception('not this one') }}"  # the template is what writes the prompts
    code, _, err = run_cli(*args[:-len(pair) - 2], "--out", tmp_path / "other", *pair, "--chat-template", refusing)
    assert code != 0 and "the chat template refused these messages: not this one" in err
