"""End-to-end on the real default pair (Qwen2.5-Coder 0.5B + 1.5B). Needs `r2r models prepare`."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from roads_to_rome import models
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.layout import left_pad
from roads_to_rome.core.request import Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM

pytestmark = pytest.mark.e2e

N_TOKENS = 64  # a cache or batching bug shows within 64 tokens as within 128, at half the cost
# The proofs on torch read half that: where the processor has no native bf16 (AVX2-only, many Xeons) the pair runs
# in float32 there, four times the bytes of llama.cpp's Q4 files per step, and 32 tokens on prompts of three
# lengths, alone and batched, still reach every cache and padding path.
TORCH_TOKENS = 32
PROMPTS = [
    "Write a Python class for a binary search tree with insert, delete and search, with docstrings.",
    "Explain in detail how quicksort works, then analyse its best, average and worst case running time.",
    gsm8k_prompt(gsm8k()[1]),
]


def transformers_greedy(model, prompts: list[list[int]], outputs: list[list[int]], pad_id) -> list[list[int]]:
    """transformers' own greedy choice at each position of `outputs`, the rows run as one left-padded batch (as
    the engine ran them): in float32, from one forward over each prompt and its output, where a multi-token
    forward and one-token steps agree to well below any logit gap (what strict verification below relies on
    too), so that the tokens the engine wrote are transformers' greedy ones exactly where it picks them again; in
    other dtypes they do not agree that closely, and `generate()` writes its own (to the last token: no EOS)."""
    import torch

    n = len(outputs[0])
    if model.dtype != torch.float32:
        ids, mask = left_pad(prompts, pad_id, "cpu")
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None
        try:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                 pad_token_id=pad_id)
        finally:
            model.generation_config.eos_token_id = eos
        return out[:, ids.shape[1]:].tolist()
    rows = [p + o[:-1] for p, o in zip(prompts, outputs)]
    ids, mask = left_pad(rows, pad_id, "cpu")
    with torch.no_grad():  # (positions counted from each row's first real token, as generate() counts them)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    return logits[:, -n:].argmax(-1).tolist()


def parts_only_at_a_near_tie(out: list[int], want: list[int], logits_after, note=None) -> int | None:
    """Where llama.cpp's output `out` first leaves `want` (a greedy output, one row at a time): the two tokens there
    nearly tie in `logits_after(want's tokens before it)`, the last position's logits as that output was judged on
    (llama.cpp's batch kernels round otherwise than its one-row ones). That position, or None where they agree."""
    split = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
    if split is not None:
        logits = logits_after(want[:split])
        margin = (logits[want[split]] - logits[out[split]]).item()
        assert abs(margin) < 0.5, (note, split, margin)
    return split


def always_one_model_proof(pair, role: str, alone: bool = True) -> list[list[int]]:
    """The engine's proof: routing everything to one model reproduces that model token for token (in the dtype of
    `pair`: the reference is the same loaded model), each prompt alone (where `alone`) and the three batched; the
    batch's outputs."""
    slm, llm, tokenizer = pair
    engine = Engine(slm, llm, tokenizer, AlwaysSLM() if role == "slm" else AlwaysLLM())
    reference = (slm if role == "slm" else llm).model
    prompts = [engine.prompts.chat(p) for p in PROMPTS]
    # ignore_eos on both sides so that every row really runs TORCH_TOKENS steps.
    params = SamplingParams(max_new_tokens=TORCH_TOKENS, ignore_eos=True)
    for prompt in prompts if alone else ():
        gen = engine.generate([prompt], params)[0]
        assert len(gen.token_ids) == TORCH_TOKENS
        assert gen.token_ids == transformers_greedy(reference, [prompt], [gen.token_ids], engine.pad_id)[0]
        assert gen.sources == [role] * TORCH_TOKENS
    gens = engine.generate(prompts, params)
    assert all(g.sources == [role] * TORCH_TOKENS for g in gens)
    batch = [g.token_ids for g in gens]
    assert batch == transformers_greedy(reference, prompts, batch, engine.pad_id)
    return batch


def strict_verification_runs(pair, tokens: int):
    """The shipped router (the LLM checks at routed tokens and at the end) and speculative decoding (the SLM alone,
    checked every 4 tokens), strict, each on the 3 prompts in one batch: the prompts, (policy, outputs) for each,
    and the rollbacks they made in all."""
    from roads_to_rome.routing import policies

    slm, llm, tokenizer = pair
    prompts = [Engine.alone(llm, tokenizer).prompts.chat(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    router = policies.build("router", slm, None, models.router_path_for(None, None))
    runs, rollbacks = [], 0
    for policy, interval in ((router, None), (AlwaysSLM(), 4)):
        gens = Engine(slm, llm, tokenizer, policy, verify="strict", max_unverified=interval).generate(prompts, params)
        rollbacks += sum(g.rollbacks for g in gens)
        runs.append((policy.name, [g.token_ids for g in gens]))
    return prompts, runs, rollbacks


def test_always_the_slm_equals_its_greedy_generation(torch_pair):
    """The proof for the SLM in the dtype `--dtype auto` picks here (bf16 where the processor has it natively)."""
    always_one_model_proof(torch_pair, "slm")


def test_always_the_llm_and_strict_verification_write_transformers_greedy_output_on_torch(torch_pair_float32):
    """The proof for the LLM, batched, then verification on catch-up, strict, held to the same output: the shipped
    router (the LLM checks at routed tokens and at the end) and speculative decoding (the SLM alone, checked every 4
    tokens) both write the LLM's own greedy output, on the 3 prompts of different lengths in one batch, so that rows
    roll back while others go on. In float32, where a multi-token LLM forward and a one-token step agree to well
    below any logit gap, padded or not: the LLM's greedy output is then transformers' own, one output for all three.
    Rows alone on torch are the SLM's proof's (the engine's code for a row alone is the same for either model), and
    the LLM alone's on the real pair llama.cpp's, below: the most costly steps of the suite where float32 is all a
    processor has."""
    want = always_one_model_proof(torch_pair_float32, "llm", alone=False)
    _, runs, rollbacks = strict_verification_runs(torch_pair_float32, TORCH_TOKENS)
    for policy, outs in runs:
        for out, expected in zip(outs, want):
            split = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), None)
            assert split is None, (policy, split)
    assert rollbacks > 0  # the LLM did correct the SLM


def test_an_imported_reference_router_routes_as_its_format_says(torch_pair_float32, tmp_path):
    """A reference-layout router of the real 0.5B's sizes (random weights from a seed), imported as `r2r router
    import` does and run by the engine, routes exactly the tokens that the format's forward
    (tests/test_reference_router.py), computed here on the SLM's own features, marks. On torch in float32, where a
    prefill's features equal the decode steps' to rounding (llama.cpp's depend on the batch's company,
    docs/backends.md); the float32 pair is the proof's above (the commands' wiring: tests/test_reference_router.py)."""
    import torch
    from helpers import format_forward, reference_checkpoint

    from roads_to_rome.routing.policies import router_policy
    from roads_to_rome.routing.router import import_reference

    slm, llm, tokenizer = torch_pair_float32
    embedding = slm.embedding_table().float()
    checkpoint = reference_checkpoint(slm.hidden_size, embedding.shape[1], dims=(256, 256), seed=3)
    prompt = Engine(slm, llm, tokenizer).prompts.chat(gsm8k_prompt(gsm8k()[0]))

    def scores(ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The format's score at each position from `start` on, with the token the SLM proposes there (greedy)."""
        logits, hidden = slm.forward_sequence(ids, start)
        proposals = logits.float().argmax(-1)
        return format_forward(checkpoint, hidden.float(), embedding[proposals], logits.float()), proposals

    # A threshold that routes some of the prompt's own positions and not others.
    checkpoint["common_args"]["threshold"] = float(scores(prompt, 0)[0].quantile(0.7))
    torch.save(checkpoint, tmp_path / "reference.pt")
    import_reference(tmp_path / "reference.pt", slm, tmp_path / "router")
    engine = Engine(slm, llm, tokenizer, router_policy(tmp_path / "router", slm))
    gen = engine.generate([prompt], SamplingParams(max_new_tokens=48))[0]
    threshold = checkpoint["common_args"]["threshold"]
    # Without verification nothing is taken back: position j was decided after prompt + the tokens before it.
    expected, proposals = scores(prompt + gen.token_ids[:-1], len(prompt) - 1)
    routed = [source == "llm" for source in gen.sources]
    assert routed == (expected >= threshold).tolist()
    assert 0 < sum(routed) < len(routed)
    assert torch.allclose(torch.tensor(gen.scores), expected, atol=1e-4)
    # Where the SLM kept its token, it is the proposal the features were computed with.
    assert all(t == p for t, p, r in zip(gen.token_ids, proposals.tolist(), routed) if not r)


@pytest.fixture(scope="module")
def llamacpp_alone(llamacpp_pair) -> dict[str, list[list[int]]]:
    """Each prompt written alone by one model through the engine on llama.cpp (N_TOKENS greedy tokens), by role:
    the test below proves them llama.cpp's own greedy output, and the LLM's are what verification is held to."""
    slm, llm, tokenizer = llamacpp_pair
    params = SamplingParams(max_new_tokens=N_TOKENS, ignore_eos=True)
    outputs = {}
    for role, policy in (("slm", AlwaysSLM()), ("llm", AlwaysLLM())):
        engine = Engine(slm, llm, tokenizer, policy)
        gens = [engine.generate([engine.prompts.chat(p)], params)[0] for p in PROMPTS]
        assert all(g.sources == [role] * N_TOKENS for g in gens)
        outputs[role] = [g.token_ids for g in gens]
    return outputs


@pytest.mark.parametrize("role", ["slm", "llm"])
def test_always_one_model_on_llamacpp_equals_llamacpps_own_greedy_output(llamacpp_pair, llamacpp_alone, role,
                                                                         monkeypatch):
    """The same proof on the llama.cpp backend, against llama-cpp-python's own greedy generation."""
    import llama_cpp

    from roads_to_rome.backends.llamacpp import model_params
    from roads_to_rome.models import DEFAULT_LLM, DEFAULT_SLM, gguf_path

    # The reference loads its model with the backend's parameters: the defaults crash on AMX CPUs.
    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", model_params)

    slm, llm, tokenizer = llamacpp_pair
    engine = Engine(slm, llm, tokenizer, AlwaysSLM() if role == "slm" else AlwaysLLM())
    # flash_attn as llama.cpp's own default picks it on CPU (llama-cpp-python turns it off by default;
    # the attention sums then round differently and near-ties flip).
    reference = llama_cpp.Llama(str(gguf_path(DEFAULT_SLM if role == "slm" else DEFAULT_LLM)), n_ctx=1024,
                                n_batch=512, flash_attn=True, verbose=False)
    prompts = [engine.prompts.chat(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=N_TOKENS, ignore_eos=True)
    expected = []
    for prompt in prompts:
        reference.reset()
        out = []
        for token in reference.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(token)
            if len(out) == N_TOKENS:
                break
        expected.append(out)
    assert llamacpp_alone[role] == expected
    # Batched rows run through llama.cpp's matrix-matrix kernels, which round differently from its
    # one-row kernels: a row may leave the one-row greedy path, but only where two tokens nearly tie.
    reference_backend = slm if role == "slm" else llm
    for prompt, want, gen in zip(prompts, expected, engine.generate(prompts, params)):
        parts_only_at_a_near_tie(gen.token_ids, want,
                                 lambda ids: reference_backend.forward_sequence(prompt + ids)[0][-1])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "roads_to_rome", *args], capture_output=True, text=True, timeout=900)


ENTROPY_THRESHOLD = "0.8"  # nats: the CLI default; 16% LLM tokens on this question when measured


def test_entropy_routing_mixes_both_models_into_a_coherent_answer():
    item = gsm8k()[0]
    result = run_cli("generate", gsm8k_prompt(item), "--router", "entropy", "--threshold", ENTROPY_THRESHOLD,
                     "--max-new-tokens", "400", "--json", "--device", "cpu", "--verify", "off")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert 0.10 <= out["llm_rate"] <= 0.20, out["llm_rate"]
    assert {"slm", "llm"} <= set(out["sources"])
    assert out["sources"].count("llm") == round(out["llm_rate"] * len(out["token_ids"]))
    text = out["text"]
    # Coherent: finishes on its own, words rather than junk, no degenerate loop, the question's numbers used.
    assert out["finish_reason"] == "stop"
    words = text.split()
    assert len(words) > 30
    assert sum(w.isascii() for w in words) / len(words) > 0.95
    trigrams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    assert len(set(trigrams)) / len(trigrams) > 0.7
    assert "16" in text and "the answer is" in text.lower()


def test_the_shipped_router_is_the_default_policy():
    """`r2r generate` on the default pair routes with the router shipped in the package."""
    from roads_to_rome.models import shipped_router

    assert shipped_router() is not None, "no router shipped in roads_to_rome/models/routers/"
    backend = "llamacpp" if importlib.util.find_spec("llama_cpp") else "torch"
    result = run_cli("generate", gsm8k_prompt(gsm8k()[0]), "--max-new-tokens", "200", "--json", "--device", "cpu",
                     "--backend", backend)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["policy"] == "router"
    assert 0.02 <= out["llm_rate"] <= 0.35, out["llm_rate"]
    assert {"slm", "llm"} <= set(out["sources"])


def test_one_router_serves_both_backends(tmp_path):
    """The SLM's features on llama.cpp (Q4_K_M compute) match torch's (bf16) closely enough that the
    shipped router takes the same decisions on both."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    out = tmp_path / "backends.json"
    result = run_cli("bench", "backends", "--prompts", "1", "--tokens", "48", "--out", str(out))
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert figures["positions"] == 48
    assert figures["hidden_cosine_mean"] > 0.99 and figures["hidden_cosine_min"] > 0.95
    assert figures["argmax_agreement"] >= 0.9
    assert figures["router_decision_agreement"] >= 0.9


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--slm", "/nonexistent/model"], "does not exist"),
        (["generate", "", "--max-new-tokens", "8"], "prompt is empty"),
        (["generate", "hi", "--max-new-tokens", "0"], "max new tokens"),
    ],
)
def test_bad_input_fails_in_one_line(args, message):
    result = run_cli(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_bad_model_files_fail_in_one_line(tmp_path):
    from tiny import save_pair

    (tmp_path / "corrupt.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
    tiny_slm, _ = save_pair(tmp_path / "tiny")
    for args, message in [
        (["--llm", str(tmp_path / "corrupt.gguf")], "LLM model"),  # read by llama.cpp or transformers
        (["--llm", str(tiny_slm)], "tokenizers differ"),
    ]:
        result = run_cli("generate", "hi", "--max-new-tokens", "4", "--device", "cpu", *args)
        assert result.returncode != 0 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_eval_grades_the_real_slm_on_gsm8k_and_humaneval(tmp_path):
    """The harness end to end on the real SLM: answers generated, extracted, graded and summarised;
    a HumanEval answer ends at its code block (the stop string) and goes through the harness."""
    backend = "llamacpp" if importlib.util.find_spec("llama_cpp") else "torch"
    for benchmark, item, tokens in (("gsm8k", "1", "400"), ("humaneval", "0", "400")):
        result = run_cli("eval", "--benchmark", benchmark, "--systems", "slm", "--ids", item, "--max-new-tokens",
                         tokens, "--out", str(tmp_path), "--backend", backend, "--device", "cpu")
        assert result.returncode == 0, result.stderr
        (row,) = [json.loads(line) for line in (tmp_path / benchmark / "slm.jsonl").read_text().splitlines()]
        summary = json.loads((tmp_path / benchmark / "summary.json").read_text())["systems"]["slm"]
        assert summary["items"] == 1 and summary["accuracy"] == float(row["correct"]) and row["tokens"] > 0
        assert row["finish_reason"] == "stop", row["output"]
        if benchmark == "gsm8k":
            assert row["extracted"] is not None and row["extracted"].strip().lstrip("-").replace(".", "").isdigit()
        else:
            # Nothing after the code block: the stop string (or EOS right after the fence) ended it.
            code_and_after = row["output"].split("```python", 1)[-1].split("```", 1)
            assert len(code_and_after) == 1 or not code_and_after[1].strip(), row["output"]
            assert row["extracted"] == "passed" or row["extracted"].startswith("failed"), row["extracted"]


def test_eval_fills_in_a_humaneval_line_with_the_real_pair(tmp_path):
    """Single-line infilling through the harness: the code model's fill-in-the-middle prompt, one line written by
    the SLM, the LLM and R2R, ended at its newline, and the function run with it in place."""
    backend = "llamacpp" if importlib.util.find_spec("llama_cpp") else "torch"
    result = run_cli("eval", "--benchmark", "humaneval-infill", "--systems", "slm,llm,r2r", "--ids", "0-1",
                     "--max-new-tokens", "48", "--out", str(tmp_path), "--backend", backend, "--device", "cpu")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "humaneval-infill" / "summary.json").read_text())["systems"]
    assert set(summary) == {"slm", "llm", "r2r"}
    for system in summary:
        for line in (tmp_path / "humaneval-infill" / f"{system}.jsonl").read_text().splitlines():
            row = json.loads(line)
            assert "\n" not in row["output"] and row["tokens"] > 0 and row["finish_reason"] == "stop", row
            assert row["extracted"] == "passed" or row["extracted"].startswith("failed"), row["extracted"]
    assert summary["llm"]["accuracy"] == 1.0  # (the LLM writes both lines right: a check that the prompt is FIM's)


def test_strict_verification_gives_the_llms_greedy_output_on_llamacpp(llamacpp_pair, llamacpp_alone):
    """The same verification as on torch above, on llama.cpp (Q4_K_M), against the LLM's own greedy output proved
    above: a multi-token forward and one-token steps round differently there, so where a row leaves the LLM's
    one-token path, its two top tokens must nearly tie there (64 tokens)."""
    llm = llamacpp_pair[1]
    prompts, runs, rollbacks = strict_verification_runs(llamacpp_pair, N_TOKENS)
    for policy, outs in runs:
        for prompt, out, want in zip(prompts, outs, llamacpp_alone["llm"]):
            parts_only_at_a_near_tie(out, want, lambda ids: llm.forward_sequence(prompt + ids)[0][-1], policy)
    assert rollbacks > 0  # the LLM did correct the SLM


def test_with_penalties_and_a_logit_bias_strict_verification_gives_the_llms_own_output_on_llamacpp(llamacpp_pair,
                                                                                                   llamacpp_alone):
    """The same proof with presence, frequency and repetition penalties and a logit bias that bans the token the
    LLM's plain answers use most, through the shipped router and grouped calls: every token the LLM checks is judged
    on the logits so shaped, so the output is the LLM's own output under them (up to llama.cpp's near-ties,
    measured on the shaped logits), which differs from its plain one."""
    from collections import Counter

    from roads_to_rome.core.llm_calls import Deferral
    from roads_to_rome.core.sampling import LogitRules, adjust_logits
    from roads_to_rome.routing import policies

    slm, llm, tokenizer = llamacpp_pair
    alone = Engine.alone(llm, tokenizer)
    prompts = [alone.prompts.chat(p) for p in (PROMPTS[0], PROMPTS[2])]  # code, and a GSM8K question
    plain = [llamacpp_alone["llm"][0], llamacpp_alone["llm"][2]]
    banned = Counter(t for out in plain for t in out).most_common(1)[0][0]
    params = SamplingParams(max_new_tokens=N_TOKENS, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.2, logit_bias={banned: -100.0})
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    assert all(e != p and banned not in e for e, p in zip(expected, plain))
    router = policies.build("router", slm, None, models.router_path_for(None, None))
    engine = Engine(slm, llm, tokenizer, router, verify="strict", defer=Deferral("continue"))
    gens = engine.generate(prompts, params)
    for prompt, want, gen in zip(prompts, expected, gens):
        assert banned not in gen.token_ids
        parts_only_at_a_near_tie(gen.token_ids, want, lambda ids: adjust_logits(
            llm.forward_sequence(prompt + ids)[0][-1], LogitRules.of(params, prompt), ids))
    assert sum(g.rollbacks for g in gens) > 0 and sum(g.llm_tokens for g in gens) > 0


def test_under_a_json_schema_strict_verification_gives_the_llms_own_valid_json_on_llamacpp(llamacpp_pair):
    """A GSM8K question answered as JSON of a schema, through the shipped router and grouped calls: the SLM's tokens,
    the LLM's and every check follow the schema's masks, so the answer is the LLM's own under the schema (up to
    llama.cpp's near-ties, measured on the masked logits) and parses as the schema says."""
    from roads_to_rome.core.grammar import GrammarWalk, OutputFormat
    from roads_to_rome.core.llm_calls import Deferral
    from roads_to_rome.core.sampling import LogitRules, adjust_logits
    from roads_to_rome.routing import policies

    slm, llm, tokenizer = llamacpp_pair
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "number"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    params = SamplingParams(max_new_tokens=300, output_format=OutputFormat.json_schema(schema))
    alone = Engine.alone(llm, tokenizer)
    prompt = alone.prompts.chat(gsm8k()[0]["question"] + '\nReply as JSON: {"reasoning": ..., "answer": ...}.')
    want = alone.run([Request(prompt, params)])[0].token_ids
    router = policies.build("router", slm, None, models.router_path_for(None, None))
    engine = Engine(slm, llm, tokenizer, router, verify="strict", defer=Deferral("continue"))
    gen = engine.run([Request(prompt, params)])[0]
    reply = json.loads(gen.text)
    assert gen.finish_reason == "stop" and list(reply) == ["reasoning", "answer"] and isinstance(reply["answer"],
                                                                                                 int | float)
    split = parts_only_at_a_near_tie(gen.token_ids, want, lambda ids: adjust_logits(
        llm.forward_sequence(prompt + ids)[0][-1],
        LogitRules.of(params, prompt, grammar=GrammarWalk(params.output_format, engine.grammar_tokenizer)), ids))
    if split is None:
        assert gen.token_ids == want
    assert gen.llm_tokens > 0 and gen.sources.count("slm") > 0


def test_a_structural_tag_holds_a_tool_call_in_running_text_to_its_schema_on_llamacpp(llamacpp_pair):
    """The default pair asked for the weather with a tool shown writes a call; a structural tag whose schema allows
    only kelvin holds the call's arguments to it (free, the model writes celsius), through the shipped router."""
    from roads_to_rome.core.grammar import OutputFormat
    from roads_to_rome.routing import policies

    slm, llm, tokenizer = llamacpp_pair
    engine = Engine(slm, llm, tokenizer, policies.build("router", slm, None, models.router_path_for(None, None)))
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": schema}}]
    prompt = engine.prompts.messages([{"role": "user", "content": "What's the weather in Paris, in celsius?"}],
                                    tools=tools)
    kelvin = {**schema, "properties": {"city": {"type": "string"}, "unit": {"enum": ["kelvin"]}}}
    tag = {"triggers": ['{"name"'], "structures": [{"begin": '{"name": "get_weather", "arguments": ',
                                                   "schema": kelvin, "end": "}"}]}
    call = re.compile(r'\{"name": "get_weather", "arguments": (\{.*\})\}', re.S)
    free, held = (engine.generate([prompt], SamplingParams(max_new_tokens=60, output_format=fmt))[0]
                  for fmt in (None, OutputFormat("structural_tag", tag)))
    assert json.loads(call.search(free.text).group(1))["unit"] == "C", free.text
    assert json.loads(call.search(held.text).group(1)) == {"city": "Paris", "unit": "kelvin"}, held.text


def test_the_readmes_python_example_runs_as_written():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "The answer is 391" in done.stdout and "tokens from the LLM" in done.stdout, done.stdout
