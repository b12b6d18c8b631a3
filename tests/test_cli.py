"""The command line on a tiny pair: JSON contract, highlighting, and one-line errors."""

import json
import re

import pytest
from tiny import save_pair, tiny_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # Room for a chat prompt and the commands' default 512 new tokens, in the tiny tokenizer's tokens
    slm_dir, llm_dir = save_pair(tmp_path_factory.mktemp("pair"), max_positions=4096)
    return ["--slm", slm_dir, "--llm", llm_dir, "--device", "cpu"]


def test_generate_json_has_the_contract_keys(run_cli, pair):
    code, out, err = run_cli("generate", "What is 48 / 2?", "--router", "random", "--threshold", "0.5",
                             "--max-new-tokens", "12", "--seed", "3", "--json", *pair)
    assert code == 0, err
    result = json.loads(out)
    for key in ("text", "token_ids", "sources", "llm_rate", "avg_params_b", "tokens_per_s"):
        assert key in result
    assert len(result["sources"]) == len(result["token_ids"]) <= 12
    assert set(result["sources"]) <= {"slm", "llm", "fix"}  # routing verifies by default: "fix" is the LLM's fix
    code, out, err = run_cli("generate", "What is 48 / 2?", "--router", "random", "--threshold", "0.5",
                             "--max-new-tokens", "12", "--seed", "3", "--json", "--verify", "off", *pair)
    assert code == 0, err
    assert set(json.loads(out)["sources"]) <= {"slm", "llm"} and json.loads(out)["rollbacks"] == 0


def test_generate_json_gives_each_tokens_logprob_from_the_model_that_wrote_it(run_cli, pair):
    sources = set()
    for verify in ("off", "1"):
        code, out, err = run_cli("generate", "What is 48 / 2?", "--router", "random", "--threshold", "0.5",
                                 "--max-new-tokens", "12", "--seed", "3", "--json", "--logprobs", "3",
                                 "--verify", verify, *pair)
        assert code == 0, err
        result = json.loads(out)
        assert len(result["logprobs"]) == len(result["token_ids"])
        sources |= set(result["sources"])
        for token, entry in zip(result["token_ids"], result["logprobs"]):
            tops = entry["top"]
            logprobs = [t["logprob"] for t in tops]
            assert len(tops) == 3 and logprobs == sorted(logprobs, reverse=True) and entry["logprob"] <= 0
            # Greedy: each model wrote its own most likely token, whichever model that was.
            assert tops[0]["token_id"] == token and tops[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)
    assert sources == {"slm", "llm", "fix"}
    code, out, err = run_cli("generate", "hi", "--json", *pair)
    assert code == 0 and "logprobs" not in json.loads(out)


def test_generate_with_penalties_is_the_llms_penalised_answer_under_strict_verification(run_cli, pair):
    penalties = ("--presence-penalty", "0.8", "--frequency-penalty", "0.5", "--repetition-penalty", "1.4")
    runs = {}
    for name, args in (("plain", ("--router", "llm")), ("llm", ("--router", "llm", *penalties)),
                       ("strict", ("--router", "random", "--threshold", "0.5", "--verify", "strict", *penalties))):
        code, out, err = run_cli("generate", "What is 48 / 2?", "--max-new-tokens", "16", "--json", *args, *pair)
        assert code == 0, err
        runs[name] = json.loads(out)["token_ids"]
    assert runs["strict"] == runs["llm"] != runs["plain"]


def test_generate_follows_a_structured_output_given_inline_or_in_a_file(run_cli, pair, tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # llguidance's own setting, in the schema
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "g.gbnf").write_text('root ::= "(" [a-c] ")"')
    cases = [(("--json-schema", json.dumps(schema)), lambda t: set(json.loads(t)) == {"n"}),
             (("--json-schema", str(tmp_path / "schema.json")), lambda t: set(json.loads(t)) == {"n"}),
             (("--regex", "[0-9]{3}"), lambda t: len(t) == 3 and t.isdigit()),
             (("--choice", "yes", "--choice", "no"), lambda t: t in ("yes", "no")),
             (("--grammar-file", str(tmp_path / "g.gbnf")), lambda t: t in ("(a)", "(b)", "(c)"))]
    for args, holds in cases:
        code, out, err = run_cli("generate", "What is 48 / 2?", "--router", "random", "--threshold", "0.5",
                                 "--max-new-tokens", "24", "--json", *args, *pair)
        assert code == 0, err
        text = json.loads(out)["text"]
        assert holds(text.strip()), (args, text)


def test_generate_raw_and_slm_only(run_cli, pair):
    code, out, err = run_cli("generate", "def add(a, b):", "--raw", "--router", "slm", "--max-new-tokens", "5",
                             "--json", *pair)
    assert code == 0, err
    assert json.loads(out)["llm_rate"] == 0.0


def test_generate_prints_text_and_stats(run_cli, pair):
    code, out, err = run_cli("generate", "Hello", "--router", "llm", "--max-new-tokens", "6", *pair)
    assert code == 0, err
    assert "LLM rate" in out and "100.0%" in out and "avg. activated params" in out
    import re

    import torch

    from roads_to_rome.models.loading import pick_dtype

    dtype = pick_dtype("auto", "cpu")  # (bf16 where the processor has it natively, else float32)
    for role in ("SLM", "LLM"):  # which backend ran each model (model directories: torch)
        assert re.search(rf"{role} ran on\s+torch {re.escape(torch.__version__)} {dtype} ", out), out


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "   "], "prompt is empty"),
        (["generate", "hi", "--max-new-tokens", "0"], "max new tokens"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--router", "router"], "no router checkpoint"),
        (["generate", "hi", "--router", "entropy", "--threshold", "-2"], "entropy threshold"),
        (["generate", "hi", "--router-path", "x", "--router", "slm"], "--router-path goes with"),
        (["generate", "hi", "--logprobs", "2"], "add --json"),
        (["generate", "hi", "--json", "--logprobs", "21"], "logprobs takes 0 to 20"),
        (["generate", "hi", "--presence-penalty", "3"], "presence penalty is in [-2, 2]"),
        (["generate", "hi", "--repetition-penalty", "0"], "repetition penalty is in [0.01, 100]"),
        (["generate", "hi", "--min-p", "1.5"], "min-p must be in [0, 1]"),
        (["generate", "hi", "--min-tokens", "600"], "min tokens must be in [0, max new tokens = 512]"),
        (["generate", "hi", "--verify", "maybe"], "verify takes off, strict or a tolerance"),
        (["generate", "hi", "--regex", "[a-"], "regex structured output is not valid"),
        (["generate", "def f(", "--suffix", "\n"], "no fill-in-the-middle tokens"),
        (["generate", "hi", "--regex", "a", "--choice", "b"], "one structured output at most"),
        (["generate", "hi", "--json-schema", "no-such.json"], "--json-schema takes a JSON schema"),
        (["generate", "hi", "--grammar-file", "no-such.gbnf"], "--grammar-file: no file"),
        (["generate", "hi", "--verify", "-2"], "verify takes off, strict or a tolerance"),
        (["generate", "hi", "--verify", "strict", "--max-unverified", "0"], "at least 1"),
        (["generate", "hi", "--verify", "off", "--max-unverified", "4"], "and nothing is checked"),
        (["generate", "hi", "--router", "slm", "--max-unverified", "4"], "and nothing is checked"),
        (["generate", "hi", "--chat-template", "no-such.jinja"], "--chat-template: no file at no-such.jinja"),
        (["generate", "hi", "--chat-template", "{% for m in messages %}{{ m }}"], "--chat-template is not a valid "
                                                                                  "Jinja template (line 1"),
    ],
)
def test_bad_input_gives_one_line_error(run_cli, pair, args, message):
    code, out, err = run_cli(*args, *pair)
    assert code != 0
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_models_give_one_line_errors(run_cli, tmp_path, pair):
    (tmp_path / "corrupt.gguf").write_bytes(b"not a gguf file at all")
    other = save_pair(tmp_path / "other", llm_tokenizer=tiny_tokenizer(310, ("zebra quantum",)))
    cases = [
        (["--slm", tmp_path / "missing", "--llm", tmp_path / "missing"], "does not exist"),
        (["--slm", other[0], "--llm", other[1]], "tokenizers differ"),
        (["--slm", pair[1], "--llm", tmp_path / "corrupt.gguf"], "LLM model"),  # read by llama.cpp or transformers
    ]
    for models_args, message in cases:
        code, out, err = run_cli("generate", "hi", "--max-new-tokens", "2", "--device", "cpu", *models_args)
        assert code != 0 and message in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_generate_writes_the_chat_in_the_template_given(run_cli, pair, tmp_path):
    """--chat-template (a file, or the template itself) replaces the tokenizer's: the prompt is the messages in it."""
    template = "{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}\n{% endfor %}answer:"
    (tmp_path / "plain.jinja").write_text(template)
    from transformers import AutoTokenizer

    expected = len(AutoTokenizer.from_pretrained(pair[1]).encode("user says What is 48 / 2?\nanswer:"))
    for given in (template, str(tmp_path / "plain.jinja")):
        code, out, err = run_cli("generate", "What is 48 / 2?", "--router", "slm", "--max-new-tokens", "2", "--json",
                                 "--chat-template", given, *pair)
        assert code == 0, err
        assert json.loads(out)["prompt_tokens"] == expected


def test_chat_streams_and_quits_on_empty_line(run_cli, pair, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("What is 48 / 2?\nAnd 48 / 3?\n\n"))
    code, out, err = run_cli("chat", "--max-new-tokens", "5", "--router", "random", *pair)
    assert code == 0, err
    assert out.count("LLM rate") == 2
    # The second turn reads only what follows the first turn's prompt and answer (prefix caching)
    kept = re.findall(r"prompt tokens +(\d+) \((\d+) kept read from before", out)
    assert len(kept) == 1 and 0 < int(kept[0][1]) < int(kept[0][0])


def test_chat_past_the_models_context_leaves_its_first_exchanges_out(run_cli, tmp_path, monkeypatch):
    """A conversation past what the models read (64 positions here) goes on without its oldest exchanges, and a message
    that alone does not fit is refused with what to cut, the chat going on; `generate` refuses such a prompt (torch ran
    it past the models' positions without a word)."""
    import io

    slm_dir, llm_dir = save_pair(tmp_path, max_positions=64)
    pair = ["--slm", slm_dir, "--llm", llm_dir, "--device", "cpu", "--router", "random", "--max-new-tokens", "10"]
    long = "this one message is long enough by itself to be past every position the tiny models read " * 2
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hello there friend\nsecond message is here\n{long}\nfourth\n\n"))
    code, out, err = run_cli("chat", *pair)
    assert code == 0, err
    assert out.count("LLM rate") == 3  # every turn but the long one's
    assert "first exchange left out" in re.sub(r"\s+", " ", out)
    assert re.search(r"more than the 64 the models read at most \(their context length\): shorten the prompt",
                     re.sub(r"\s+", " ", out))
    code, out, err = run_cli("generate", long, *pair)
    assert code == 2 and "their context length" in err


def test_benchmarks_run_and_report_ratios(run_cli, pair, tmp_path):
    slm_args = pair[:2] + pair[4:]
    code, out, err = run_cli("bench", "overhead", "--tokens", "6", "--rounds", "1", "--out", tmp_path / "o.json",
                             *slm_args)
    assert code == 0, err
    result = json.loads((tmp_path / "o.json").read_text())
    speeds = result["tokens_per_s"]
    assert set(speeds) == {"bare", "engine", "static"}
    assert result["ratio"] == pytest.approx(speeds["engine"] / speeds["bare"])
    code, out, err = run_cli("bench", "batch", "--batch-size", "2", "--tokens", "4", "--out", tmp_path / "b.json",
                             *pair)
    assert code == 0, err
    result = json.loads((tmp_path / "b.json").read_text())
    assert 0 < result["batched"]["tokens"] <= 2 * 4 and 0 < result["sequential"]["tokens"] <= 2 * 4  # 2 prompts x 4
    assert result["speedup"] == pytest.approx(result["batched"]["tokens_per_s"] / result["sequential"]["tokens_per_s"])


def test_llm_tokens_are_marked_when_output_is_not_a_terminal(run_cli, pair):
    code, out, err = run_cli("generate", "Hello", "--router", "random", "--threshold", "0.5", "--seed", "1",
                             "--max-new-tokens", "12", *pair)
    assert code == 0, err
    assert "[[" in out and "]]" in out and "(in [[ ]], fixes in {{ }})" in out  # routing verifies by default
    code, out, err = run_cli("generate", "Hello", "--router", "random", "--threshold", "0.5", "--seed", "1",
                             "--max-new-tokens", "12", "--verify", "off", *pair)
    assert code == 0, err
    assert "[[" in out and "]]" in out and "(in [[ ]])" in out and "{{" not in out


def test_serving_benchmark_runs(run_cli, pair, tmp_path):
    systems = ["r2r", "r2r+defer=continue", "r2r+overlap", "llm", "spec+k=2", "slm", "r2r+force=slm",
               "r2r+force=llm/2"]
    code, out, err = run_cli("bench", "serve", "--clients", "1,2", "--requests", "2", "--tokens", "4",
                             "--systems", ",".join(systems), "--out", tmp_path / "s.json", *pair)
    assert code == 0, err
    result = json.loads((tmp_path / "s.json").read_text())
    assert set(result["runs"]) == {f"{s} x{n}" for s in systems for n in (1, 2)} and result["baseline"] == "r2r"
    for name, run in result["runs"].items():
        assert run["tokens"] > 0 and 0 < run["p50_s"] <= run["p95_s"]
        # Every system but one model alone calls the LLM: R2R verifies the SLM's tokens, speculative decoding too.
        alone = name.startswith(("llm ", "slm ", "r2r+force=slm "))
        assert (run["llm_calls"] == 0) if alone else (run["llm_calls"] > 0), name
        base = result["runs"][f"r2r x{run['clients']}"]
        assert run["x_throughput"] == pytest.approx(run["tokens_per_s"] / base["tokens_per_s"])
    assert result["runs"]["llm x1"]["llm_rate"] == 1.0 and result["runs"]["llm x1"]["llm_calls"] == 0
    for name in ("slm", "r2r+force=slm"):  # the same tokens: the SLM's
        assert result["runs"][f"{name} x2"]["llm_rate"] == 0.0
        assert result["runs"][f"{name} x2"]["tokens"] == result["runs"]["slm x2"]["tokens"]
    for bad in ("r2r,r2r+defer=later", "r2r+k=2", "vllm", "r2r,r2r", "r2r+force=big", "llm+force=slm",
                "r2r+force=llm/0", "r2r+force=llm/x"):
        code, out, err = run_cli("bench", "serve", "--systems", bad, *pair)
        assert code == 2 and "--systems" in err, bad
    code, out, err = run_cli("bench", "serve", "--systems", "llm-direct", *pair)  # needs the LLM on a server
    assert code == 2 and "--llm http://" in err
    for systems, option in (("llm,slm", "--threshold 0.3"), ("r2r,r2r+overlap", "--defer-group 0.5"),
                            ("r2r,r2r+defer=park", "--overlap-ahead 3"), ("r2r,llm", "--defer-steps 4")):
        code, out, err = run_cli("bench", "serve", "--systems", systems, *option.split(), *pair)  # read by none
        assert code == 2 and f"{option.split()[0]} is for" in err and "leave it out" in err, (systems, err)


def test_prefix_benchmark_shares_a_system_message_between_clients(run_cli, pair, tmp_path):
    """`r2r bench prefix --shots N`: every conversation opens with the same worked examples and the clients arrive
    one after another, so that each after the first finds them kept; the server without prefix caching finds
    nothing."""
    slm_dir, llm_dir = save_pair(tmp_path, max_positions=512)  # the tiny tokenizer writes a token per few letters
    code, out, err = run_cli("bench", "prefix", "--clients", "1", "--turns", "1", "--shots", "1", "--slm", slm_dir,
                             "--llm", llm_dir, "--device", "cpu")
    assert code == 2 and "the server refused a turn" in err and "tokens per request" in err  # a 512-token context
    code, out, err = run_cli("bench", "prefix", "--clients", "2", "--turns", "2", "--tokens", "3", "--shots", "2",
                             "--out", tmp_path / "p.json", *pair)
    assert code == 0, err
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["shots"] == 2 and "a shared system message of 2" in out
    from transformers import AutoTokenizer

    from roads_to_rome.bench.serving import few_shot_message
    from roads_to_rome.data.benchmarks import gsm8k

    kept, none = result["per_turn"]["kept"], result["per_turn"]["none"]
    system = len(AutoTokenizer.from_pretrained(pair[1]).encode(few_shot_message(gsm8k()[998:1000])))
    assert 2 * kept[0]["cached_tokens"] >= system - 2  # the second client's first turn (a mean over the two)
    assert all(turn["cached_tokens"] == 0 for turn in none)
    assert kept[1]["cached_tokens"] > kept[0]["cached_tokens"]  # the second turns find their own first too
    assert (tmp_path / "p.png").exists()
    code, out, err = run_cli("bench", "prefix", "--clients", "500", "--turns", "2", "--shots", "1", *pair)
    assert code == 2 and "1000 GSM8K dev items" in err
    code, out, err = run_cli("bench", "prefix", "--clients", "1", "--turns", "2", "--tokens", "2", "--n", "3",
                             "--out", tmp_path / "n.json", *pair)
    assert code == 0, err
    result = json.loads((tmp_path / "n.json").read_text())
    assert result["n"] == 3 and result["per_turn"]["kept"][1]["cached_tokens"] > 0
    assert 2 < result["per_turn"]["kept"][0]["completion_tokens"] <= 3 * 2  # three choices of up to two tokens


def test_priority_benchmark_sends_urgent_requests_beside_a_batch_job(run_cli, pair, tmp_path):
    """`r2r bench priority`: urgent requests beside a batch job filling the batch, on a server scheduling first come
    first served (which never preempts) and one scheduling by priority; a table, the JSON and a plot."""
    code, out, err = run_cli("bench", "priority", "--batch-clients", "1", "--urgent", "2", "--tokens", "48",
                             "--urgent-tokens", "3", "--out", tmp_path / "u.json", *pair)
    assert code == 0, err
    result = json.loads((tmp_path / "u.json").read_text())
    fcfs, priority = result["by_scheduling"]["fcfs"], result["by_scheduling"]["priority"]
    assert fcfs["preemptions"] == 0 and priority["preemptions"] <= 2 and priority["batch_requests"] >= 1
    assert len(fcfs["ttft_s"]) == len(priority["ttft_s"]) == 2 and result["urgent_answers"] == 2
    assert "urgent requests" in out and (tmp_path / "u.png").exists()
    code, out, err = run_cli("bench", "priority", "--urgent", "1000", *pair)
    assert code == 2 and "1000 GSM8K dev items" in err


def test_step_cost_benchmark_runs(run_cli, pair, tmp_path):
    code, out, err = run_cli("bench", "steps", "--context", "8", "--new-tokens", "1,4", "--rows", "1,3",
                             "--out", tmp_path / "t.json", *pair)
    assert code == 0, err
    result = json.loads((tmp_path / "t.json").read_text())
    ms, batched = result["ms"], result["batched_ms"]
    assert set(ms) == {"slm", "llm"} and all(v > 0 for row in ms.values() for v in row.values())
    assert list(batched) == ["3"] and set(batched["3"]) == {"slm", "llm"}
    assert all(set(row) == {"1", "4"} and all(v > 0 for v in row.values()) for row in batched["3"].values())
    assert "×)" in out  # three rows' steps as multiples of one row's one-token step
    code, out, err = run_cli("bench", "steps", "--new-tokens", "1,x", *pair)
    assert code != 0 and "comma-separated" in err
    code, out, err = run_cli("bench", "steps", "--rows", "0", *pair)
    assert code == 2 and "every --rows value must be at least 1" in err


def test_generate_with_verification_reports_fixes(run_cli, pair):
    code, out, err = run_cli("generate", "What is 48 / 2?", "--router", "random", "--threshold", "0.3", "--verify",
                             "strict", "--max-unverified", "3", "--max-new-tokens", "16", "--json", *pair)
    assert code == 0, err
    result = json.loads(out)
    assert set(result["sources"]) <= {"slm", "llm", "fix"}
    assert result["fix_tokens"] == result["sources"].count("fix") and result["rollbacks"] == result["fix_tokens"]
    assert result["llm_tokens"] == result["sources"].count("llm") + result["fix_tokens"]
    code, out, err = run_cli("generate", "What is 48 / 2?", "--router", "slm", "--verify", "1", "--max-new-tokens",
                             "12", *pair)
    assert code == 0, err
    assert "verification" in out and "rollbacks" in out


@pytest.mark.parametrize("args, says", [
    (["--host", "0.0.0.0"], "has no --api-key"),  # other machines could use the models
    (["--host", "0.0.0.0", "--max-num-seqs", "2", "--served-model-name", "m"], "has no --api-key"),  # vLLM's names
    (["--host", "192.168.1.20"], "--allow-unauthenticated"),
    (["--api-key", ""], "is empty"),
    (["--api-key", "  "], "is empty"),
    # Model directories run on torch, whose caches grow with each request: llama.cpp's pool size would be ignored
    (["--kv-cache-tokens", "8192", "--backend", "torch"], "no model runs on llama.cpp here (the SLM on torch, the "
                                                          "LLM on torch): leave it out"),
    (["--kv-cache-tokens", "8192", "--backend", "torch", "--llm", "http://127.0.0.1:9"], "the LLM on a server"),
])
def test_serve_refuses_an_open_network_bind_and_an_empty_key_before_loading_anything(run_cli, args, says):
    models = [x for option in ("--slm", "--llm") if option not in args for x in (option, "/nowhere")]
    code, out, err = run_cli("serve", *args, *models)  # refused before loading
    assert code != 0 and says in err + out, err + out


def test_serving_anyone_on_a_network_is_said_out_loud(capsys):
    from roads_to_rome.cli.main import check_exposure

    check_exposure("0.0.0.0", None, allow_unauthenticated=True)
    check_exposure("127.0.0.1", None, allow_unauthenticated=False)
    check_exposure("0.0.0.0", "a-key", allow_unauthenticated=False)
    out = capsys.readouterr()
    assert (out.out + out.err).count("anyone who reaches the port") == 1


def test_serve_says_its_port_is_taken_before_loading_anything(run_cli):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, out, err = run_cli("serve", "--port", port, "--slm", "/nowhere", "--llm", "/nowhere")
    assert code != 0 and f"cannot listen on 127.0.0.1:{port}" in err and "give another --port" in err, err
    assert "/nowhere" not in err and "Traceback" not in err  # (the models would have failed next)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_names_every_option_whole_at_80_columns_in_its_panel(command):
    import typer
    from typer.testing import CliRunner

    from roads_to_rome.cli.main import app
    from roads_to_rome.cli.options import PANELS

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output and max(map(len, result.output.splitlines())) <= 80
    lines = result.output.splitlines()
    for param in typer.main.get_command(app).commands[command].params:
        for name in [*param.opts, *param.secondary_opts]:
            if name.startswith("--"):
                assert re.search(rf"(^|[ ,/]){re.escape(name)}([ ,/]|$)", result.output, re.M), f"{name} is not whole"
        panel = next((p for p, names in PANELS.items() if set(param.opts) & set(names)), None)
        if panel is not None and param.opts[0].startswith("--"):  # listed under its panel's heading
            heading = lines.index(f"{panel}:")
            row = next(i for i, line in enumerate(lines) if re.match(rf"  {re.escape(param.opts[0])}([ ,]|$)", line))
            assert heading < row and not any(line and not line.startswith(" ") for line in lines[heading + 1:row])
