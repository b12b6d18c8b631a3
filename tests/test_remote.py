"""The LLM on a serving engine, as the remote backend, against real servers on loopback (llama.cpp's own, from
the xllamacpp wheel; vLLM, from its own virtualenv): the same tokens as the server's own greedy generation
(the LLM alone, and R2R with strict verification), R2R batches with and without tolerance verification that
match the same model run locally, and the faults a user meets (no server, a server that dies mid-generation,
a wrong model name, another tokenizer)."""

import dataclasses
import gc
import json
import os
import re
import threading
import time

import httpx
import psutil
import pytest
import torch
from conftest import HAS_LLAMA, LlamaServer, VllmServer, free_port, tiny_llamacpp
from helpers import NEEDS_LLAMA_SERVER, REMOTE_PROMPTS, remote
from tiny import save_gguf, tiny_model, tiny_tokenizer

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.batch import Batch
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.grammar import OutputFormat
from roads_to_rome.core.llm_calls import Deferral
from roads_to_rome.core.request import Failure, Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import LLMUnavailable, R2RError, RemoteError
from roads_to_rome.routing.policies import AlwaysLLM, EntropyPolicy, RandomPolicy

ENGINES = [
    pytest.param("llamacpp", marks=NEEDS_LLAMA_SERVER),
    pytest.param("vllm", marks=pytest.mark.skipif(not VllmServer.PYTHON.exists(),
                                                  reason="vLLM lives in .venv-vllm: run `make vllm`")),
]




# Each engine's server is started once for the module (vLLM takes a minute to start on a CPU), with a key, as a
# server on a network runs: the key's own test uses it too.
KEY = "s3cret-key"


@pytest.fixture(scope="module", params=ENGINES)
def server(request, llm_files):
    with LlamaServer(llm_files["gguf"], api_key=KEY) if request.param == "llamacpp" else \
            VllmServer(llm_files["dir"], api_key=KEY) as srv:
        srv.engine = request.param
        yield srv


# Grouped calls and the two models at once are the engine's logic on the calls every remote test makes: proved on
# llama.cpp's server; vLLM's protocol (the calls themselves) keeps its own proofs, strict and tolerance verification
# among them.
ON_LLAMA_SERVER_ONLY = pytest.mark.parametrize("server", [ENGINES[0]], indirect=True)


def served(server, tokenizer, slm, **kw):
    """The remote backend on the module's server, with its key."""
    return remote(server.url, tokenizer, slm, api_key=KEY, **kw)


def same_model_here(server, llm_files, tokenizer):
    """The served model run by this process: llama.cpp on the same GGUF, or torch on the same weights (float32,
    as vLLM serves them here)."""
    if server.engine == "vllm":
        return TorchBackend(llm_files["model"], name="local", vocab_size=len(tokenizer))
    if not HAS_LLAMA:
        pytest.skip("compares with llama-cpp-python on the same GGUF")
    return tiny_llamacpp(llm_files["gguf"], name="local", n_ctx=2048, max_rows=8, vocab_size=len(tokenizer))




def test_the_llm_alone_through_the_remote_backend_equals_the_servers_own_greedy(server, slm, tokenizer):
    llm = served(server, tokenizer, slm)
    # What the prefix cache reuses is read from the server itself (vLLM: its metrics; the fixture asks for 32).
    reuse = "32-token blocks" if server.engine == "vllm" else "per token"
    assert llm.kernels.endswith(f"(prefix cache: {reuse})")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for engine in (Engine.alone(llm, tokenizer), Engine(slm, llm, tokenizer, AlwaysLLM())):
        prompts = [engine.prompts.chat(p) for p in REMOTE_PROMPTS[:2]]
        outs = engine.generate(prompts, params)  # the two rows go to the server at once
        for ids, out in zip(prompts, outs):
            assert len(out.token_ids) == 40
            assert out.token_ids == server.own_greedy(ids, 40)
            assert out.sources == ["llm"] * 40


def test_r2r_batches_with_the_remote_llm_match_the_same_model_run_locally(server, llm_files, slm, tokenizer):
    """Rows join, finish and leave at different times; the remote cache (each row's ids) must follow."""
    local = same_model_here(server, llm_files, tokenizer)
    outs = {}
    for name, llm in (("remote", served(server, tokenizer, slm)), ("local", local)):
        engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=3))
        sequences = [engine.sequence(Request(engine.prompts.chat(p), SamplingParams(max_new_tokens=n, ignore_eos=True)))
                     for p, n in zip(REMOTE_PROMPTS, (12, 30, 20))]
        batch = Batch(engine.context)
        batch.add(sequences[:2])
        for _ in range(5):
            batch.step()
        batch.add(sequences[2:])  # joins a running batch
        while batch.sequences:
            batch.step()
        outs[name] = [(s.generation.token_ids, s.generation.sources) for s in sequences]
    assert outs["remote"] == outs["local"]
    assert {s for _, sources in outs["remote"] for s in sources} == {"slm", "llm"}


@ON_LLAMA_SERVER_ONLY
def test_deferred_routing_through_the_remote_llm_gives_lockstep_routings_tokens(server, slm, tokenizer):
    """Grouped LLM calls (--defer) through a serving engine: every row's tokens are those lockstep routing gives it,
    with and without strict verification (whose output is then the server's own greedy one)."""
    llm = served(server, tokenizer, slm)
    prompts = [Engine.alone(slm, tokenizer, "slm").prompts.chat(p) for p in REMOTE_PROMPTS]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    deferred = 0
    for verify in ("off", "strict"):
        lockstep = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), verify=verify).generate(prompts, params)
        for mode in ("continue", "park"):
            engine = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), verify=verify, defer=Deferral(mode, 1.0, 8))
            gens = engine.generate(prompts, params)
            expected = [(g.token_ids, g.sources) for g in lockstep]
            assert [(g.token_ids, g.sources) for g in gens] == expected, (verify, mode)
            deferred += sum(g.deferred for g in gens)
        if verify == "strict":
            assert [g.token_ids for g in lockstep] == [server.own_greedy(p, 24) for p in prompts]
    assert deferred > 0


@ON_LLAMA_SERVER_ONLY
def test_overlap_through_the_remote_llm_gives_the_tokens_of_its_calls_in_the_step(server, slm, tokenizer):
    """The LLM's calls beside the SLM's steps, the LLM on a serving engine: every row's tokens are those the calls
    in the step give it (lockstep and grouped), batched and alone; strict verification is the server's own greedy
    output."""
    llm = served(server, tokenizer, slm)
    prompts = [Engine.alone(slm, tokenizer, "slm").prompts.chat(p) for p in REMOTE_PROMPTS]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for verify in ("off", 1.0, "strict"):
        for mode in ("off", "continue"):
            rule = Deferral(mode, 1.0, 8)
            expected = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), verify=verify, defer=rule).generate(prompts,
                                                                                                          params)
            engine = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), verify=verify, defer=rule, overlap=True)
            gens = engine.generate(prompts, params)
            assert [(g.token_ids, g.sources) for g in gens] == [(g.token_ids, g.sources) for g in expected]
            assert engine.generate(prompts[:1], params)[0].token_ids == expected[0].token_ids
            if verify == "strict":
                assert [g.token_ids for g in gens] == [server.own_greedy(p, 24) for p in prompts]


def test_strict_verification_through_the_remote_llm_gives_the_servers_own_greedy_output(server, slm, tokenizer):
    llm = served(server, tokenizer, slm)
    for n in (None, 4):
        engine = Engine(slm, llm, tokenizer, RandomPolicy(0.2, seed=1), verify="strict", max_unverified=n)
        prompts = [engine.prompts.chat(p) for p in REMOTE_PROMPTS[:2]]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
        for ids, out in zip(prompts, outs):
            assert out.token_ids == server.own_greedy(ids, 32)
        assert sum(o.rollbacks for o in outs) > 0  # the SLM's tokens were taken back, and the output is the LLM's


def test_tolerance_verification_through_the_remote_llm_matches_the_same_model_run_locally(server, llm_files, slm,
                                                                                          tokenizer):
    local = same_model_here(server, llm_files, tokenizer)
    outs = {}
    for name, llm in (("remote", served(server, tokenizer, slm)), ("local", local)):
        engine = Engine(slm, llm, tokenizer, RandomPolicy(0.2, seed=5), verify=1.0, max_unverified=6)
        prompts = [engine.prompts.chat(p) for p in REMOTE_PROMPTS]
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
        outs[name] = [(g.token_ids, g.sources, g.rollbacks) for g in gens]
    assert outs["remote"] == outs["local"]
    assert any("fix" in sources for _, sources, _ in outs["remote"])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="intra-op threads need two cores to show")
def test_the_remote_backends_pool_threads_start_no_threads_of_their_own(server, slm, tokenizer):
    """The pool's threads only talk to the server: one that ran a tensor operation (a row of a real vocabulary's
    logits) would keep a team of intra-op threads for as long as it lives, the pool's size times the cores."""
    from roads_to_rome.backends.remote import RemoteBackend

    torch.set_num_threads(2)  # as a process with two cores runs (one_intra_op_thread puts back what it found)
    process = psutil.Process()
    torch.zeros(1 << 20).fill_(1.0)  # this thread's own team, which its first large operation starts
    # Threads the OS has but Python does not know: intra-op teams, and a thread of an earlier test that Python
    # has let go while its OS thread still winds down (so only growth can tell).
    native_before = process.num_threads() - threading.active_count()
    llm = RemoteBackend(server.url, tokenizer, slm.eos_ids, vocab_size=151_936, api_key=KEY)
    rows = [Engine.alone(llm, tokenizer).prompts.chat(p) for p in REMOTE_PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    cache = llm.new_cache()
    assert llm.forward_all(cache, ids, mask, keep_last=4).shape == (3, 4, 151_936)
    assert llm.forward(cache, ids[:, -1:] * 0 + 5, torch.ones(3, width + 1, dtype=torch.long))[0].shape[0] == 3
    assert process.num_threads() - threading.active_count() <= native_before


@ON_LLAMA_SERVER_ONLY
def test_a_request_past_the_servers_context_is_refused_before_any_call(server, slm, tokenizer):
    """The server's context (llama.cpp's per-slot n_ctx, vLLM's max_model_len) bounds a request as the models' own
    does: refused with what to cut before the SLM reads it, not by the server's 400 once the first routed token
    asks (the whole prompt read by then)."""
    engine = Engine(slm, served(server, tokenizer, slm), tokenizer, AlwaysLLM())
    assert engine.max_context == server.ctx
    prompt = engine.prompts.chat("a long question " * 200)
    assert len(prompt) > server.ctx
    with pytest.raises(R2RError, match=f"more than the {server.ctx} the models read at most.*shorten the prompt"):
        engine.run([Request(prompt, SamplingParams(max_new_tokens=8))])
    assert engine.counters.llm_calls == 0


def test_a_remote_backends_pool_is_closed_with_it(server, slm, tokenizer):
    """Not left to the interpreter's teardown, where its pipe may close before its own finalizer writes to it: a
    traceback printed after an error's message (`r2r generate` with a server that refused a request)."""
    llm = served(server, tokenizer, slm)
    pool = llm.pool
    del llm
    gc.collect()
    assert pool._state == "CLOSE"


def test_sampled_strict_verification_is_refused_with_a_remote_llm(server, slm, tokenizer):
    engine = Engine(slm, served(server, tokenizer, slm), tokenizer, RandomPolicy(0.2), verify="strict")
    with pytest.raises(R2RError, match="whole distribution"):
        engine.sequence(Request([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.7)))


@pytest.mark.parametrize("setting", [{"presence_penalty": 0.5}, {"logit_bias": {5: 3.0}},
                                     {"allowed_token_ids": (5, 6)},
                                     {"output_format": OutputFormat("regex", "[a-z]+")}])
def test_penalties_and_logit_rules_are_refused_with_a_remote_llm_unless_the_slm_writes_alone(server, slm, tokenizer,
                                                                                             setting):
    """A server's top log-probabilities are not the whole distribution a penalty, a bias, a list of allowed
    tokens or a structured output reshapes; holding back ending tokens until min_tokens only removes some of them,
    which a ranked list can do exactly."""
    engine = Engine(slm, served(server, tokenizer, slm), tokenizer, RandomPolicy(0.2))
    reshaped = SamplingParams(max_new_tokens=4, **setting)
    for force in (None, "llm"):
        with pytest.raises(R2RError, match="penalties, a logit bias, allowed tokens and structured outputs"):
            engine.sequence(Request([1, 2, 3], reshaped, force=force))
    assert engine.run([Request([1, 2, 3], reshaped, force="slm")])[0].token_ids
    held = SamplingParams(max_new_tokens=4, min_tokens=4, stop_token_ids=(7,))
    assert len(engine.run([Request([1, 2, 3], held, force="llm")])[0].token_ids) == 4
    # ... and so do bad words
    plain = engine.run([Request([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), force="llm")])[0]
    banned = SamplingParams(max_new_tokens=4, ignore_eos=True, bad_words=((plain.token_ids[1],),))
    assert plain.token_ids[1] not in engine.run([Request([1, 2, 3], banned, force="llm")])[0].token_ids


def test_a_prompt_is_scored_by_a_vllm_llm_as_by_the_same_model_here(server, llm_files, slm, tokenizer):
    """Prompt log-probabilities (echo with logprobs, vLLM's prompt_logprobs) with the LLM on a server: vLLM's own
    prompt log-probabilities score the positions routed to it, as the same model run here scores them, and
    decoding goes on from the prompt read; llama.cpp's server gives none, so it is refused, naming what to do."""
    from roads_to_rome.core.scheduler import PromptRead
    from roads_to_rome.core.scoring import score_prompt

    ids = Engine.alone(slm, tokenizer).prompts.chat(REMOTE_PROMPTS[0])
    llm = served(server, tokenizer, slm)
    request = Request(ids, SamplingParams(max_new_tokens=6, ignore_eos=True), prompt_logprobs=3)
    if server.engine == "llamacpp":
        with pytest.raises(R2RError, match="no prompt log-probabilities"):
            Engine(slm, llm, tokenizer, RandomPolicy(0.5, seed=3)).sequence(request)
        return
    scored = {}
    for name, model in (("remote", llm), ("local", same_model_here(server, llm_files, tokenizer))):
        for force in ("llm", None):
            engine = Engine(slm, model, tokenizer, RandomPolicy(0.5, seed=3))
            sequence = engine.sequence(dataclasses.replace(request, force=force))
            read = PromptRead(engine.context, sequence)
            scored[name, force] = score_prompt(engine.context, sequence, read.per_model)
            read.release()
        scored[name, "run"] = engine.run([request])[0]
    for force in ("llm", None):
        (entries, sources), (expected, expected_sources) = scored["remote", force], scored["local", force]
        assert sources == expected_sources and entries[0] is expected[0] is None
        assert "llm" in sources and (force or "slm" in sources)
        for mine, theirs in zip(entries[1:], expected[1:]):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3) and mine.rank == theirs.rank
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    run, here = scored["remote", "run"], scored["local", "run"]
    assert run.token_ids == here.token_ids and run.prompt_sources == here.prompt_sources
    assert [e.logprob for e in run.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in here.prompt_logprobs[1:]],
                                                                          abs=1e-3)


def test_vllms_prefix_cache_is_read_from_its_metrics():
    from roads_to_rome.backends.remote import vllm_prefix_cache
    from roads_to_rome.errors import RemoteError

    class Metrics:
        def __init__(self, text):
            self.body = text

        def text(self, path):
            if self.body is None:
                raise RemoteError("refused GET /metrics (404)")
            return self.body

    line = ('vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="%s",'
            'kv_cache_dtype_skip_layers="[]",num_gpu_blocks="292"} 1.0')
    metrics = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n" + line
    assert vllm_prefix_cache(Metrics(metrics % "True")) == "128-token blocks"
    assert vllm_prefix_cache(Metrics(metrics % "False")) == "off"
    assert vllm_prefix_cache(Metrics("vllm:num_requests_running 0.0")) == "unknown"
    assert vllm_prefix_cache(Metrics(None)) == "unknown"


def test_no_server_wrong_model_and_another_tokenizer_are_refused(server, slm, tokenizer, tmp_path):
    if server.engine != "llamacpp":
        with pytest.raises(R2RError, match="does not serve 'nope'"):
            remote(server.url + "?model=nope", tokenizer, slm, api_key=KEY)
        return
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(R2RError, match=f"{nobody} is unavailable"):
        remote(nobody, tokenizer, slm, retry=1)
    with pytest.raises(R2RError, match="does not serve 'nope'"):
        remote(server.url + "?model=nope", tokenizer, slm, api_key=KEY)
    with pytest.raises(R2RError, match="unknown setting"):
        remote(server.url + "?modle=x", tokenizer, slm, api_key=KEY)
    other = tiny_tokenizer(extra_words=("zebra quokka",))
    gguf = tmp_path / "other.gguf"
    save_gguf(tiny_model(other, hidden=32, seed=2), other, gguf)
    with LlamaServer(gguf, slots=1) as srv:
        with pytest.raises(R2RError, match="does not share the SLM's tokenizer"):
            remote(srv.url, tokenizer, slm)


@NEEDS_LLAMA_SERVER
def test_a_server_that_dies_mid_generation_fails_that_request_and_the_next_one_works(llm_files, slm, tokenizer):
    with LlamaServer(llm_files["gguf"], slots=1) as srv:
        llm = remote(srv.url, tokenizer, slm, retry=1, timeout=10)
        engine = Engine(slm, llm, tokenizer, AlwaysLLM())
        prompt = engine.prompts.chat(REMOTE_PROMPTS[0])
        params = SamplingParams(max_new_tokens=2000, ignore_eos=True)
        batch = Batch(engine.context)
        batch.add([engine.sequence(Request(prompt, params))])
        for _ in range(3):
            batch.step()
        srv.stop()
        # The request waiting for the LLM fails (a `Failure`: the rows that need no LLM would go on) and leaves.
        [failed] = batch.step()
        assert isinstance(failed, Failure) and isinstance(failed.error, R2RError)
        assert f"{srv.url} is unavailable" in str(failed.error) and batch.sequences == []
        srv.start()
        out = engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
        assert out.token_ids == srv.own_greedy(prompt, 8)


@NEEDS_LLAMA_SERVER
def test_r2r_serve_keeps_serving_when_its_remote_llm_fails_a_request(llm_files, slm, tokenizer):
    from roads_to_rome.serving.background import BackgroundServer
    from roads_to_rome.serving.limits import Limits
    from roads_to_rome.serving.server import create_app

    with LlamaServer(llm_files["gguf"], slots=2) as srv:
        engine = Engine(slm, remote(srv.url, tokenizer, slm, retry=0, timeout=10), tokenizer, RandomPolicy(0.5, seed=0))
        with BackgroundServer(create_app(engine, "tiny", Limits(max_tokens=64, context_length=512))) as r2r:
            chat = r2r.url + "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": REMOTE_PROMPTS[0]}], "max_tokens": 16, "temperature": 0}
            first = httpx.post(chat, json={**body, "r2r_policy": "llm"}, timeout=60)
            assert first.status_code == 200
            models = httpx.get(r2r.url + "/v1/models").text
            assert srv.url not in models and str(srv.port) not in models  # the LLM's model, not its address
            srv.stop()
            failed = httpx.post(chat, json={**body, "r2r_policy": "llm"}, timeout=60)
            assert failed.status_code == 503 and failed.headers["retry-after"], failed.text
            assert failed.json()["error"]["code"] == "llm_unavailable" and srv.url not in failed.text
            assert httpx.post(chat, json={**body, "r2r_policy": "slm"}, timeout=60).status_code == 200  # still up
            srv.start()
            again = httpx.post(chat, json={**body, "r2r_policy": "llm"}, timeout=60)
            assert again.status_code == 200
            assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
            assert httpx.post(chat, json=body, timeout=60).json()["usage"]["llm_tokens"] > 0  # R2R routes again


@NEEDS_LLAMA_SERVER
def test_r2r_chat_goes_on_when_its_remote_llm_fails_a_turn(llm_files, tokenizer, run_cli, monkeypatch, tmp_path):
    """A turn whose LLM server is away fails alone: the chat says why, and once the server is back the next turn
    answers, the conversation kept (the chat ended, and the conversation with it)."""
    import io

    tiny_model(tokenizer, seed=0).save_pretrained(tmp_path / "slm")
    tokenizer.save_pretrained(tmp_path / "slm")
    with LlamaServer(llm_files["gguf"], slots=2) as srv:

        class Turns(io.StringIO):
            """The user's lines; the server stops before the second and is back before the third."""

            lines = iter([(None, "What is 48 / 2?"), (srv.stop, "And 48 / 3?"), (srv.start, "And 48 / 4?"), (None, "")])

            def readline(self, *_):
                disturb, line = next(self.lines)
                if disturb:
                    disturb()
                return line + "\n"

        monkeypatch.setattr("sys.stdin", Turns())
        code, out, err = run_cli("chat", "--slm", tmp_path / "slm", "--llm", srv.url, "--router", "llm",
                                 "--llm-retry", "0", "--max-new-tokens", "4", "--device", "cpu")
    assert code == 0, err
    assert out.count("LLM rate") == 2 and "is unavailable" in re.sub(r"\s+", " ", out), out


def test_what_the_server_writes_itself_equals_the_engines_token_by_token_greedy(server, slm, tokenizer):
    """The label pipeline's LLM-alone steps (responses, continuations) run as server-side generations."""
    from roads_to_rome.backends.base import greedy
    from roads_to_rome.core.layout import left_pad

    llm = served(server, tokenizer, slm)
    engine = Engine.alone(llm, tokenizer)

    def written(rows: list[list[int]], n: int) -> list[list[int]]:
        return llm.complete(llm.new_cache(), *left_pad(rows, engine.pad_id, llm.device), n)

    prompts = [engine.prompts.chat(p) for p in REMOTE_PROMPTS]
    whole = written(prompts, 24)
    assert whole == [g.token_ids for g in engine.generate(prompts, SamplingParams(max_new_tokens=24))]
    cache = llm.new_cache()
    assert greedy(llm, cache, [prompts[0]], 24, engine.eos_ids, stop=lambda i, out: len(out) == 5)[0] == whole[0][:5]
    # rollouts from copies of one cache rolled back to their positions: what the server writes from each prefix
    from roads_to_rome.backends.base import mask_for
    from roads_to_rome.pipeline.labels import llm_branches

    base, response = llm.new_cache(), whole[1]
    llm.read(base, torch.tensor([prompts[1] + response[:3]]), mask_for(base, len(prompts[1]) + 3, llm.device))
    branches = llm_branches(llm, base, len(prompts[1]), [3, 1], [response[3], 42], [6, 4], engine.eos_ids, None)
    assert branches == [written([prompts[1] + response[:3] + [response[3]]], 6)[0],
                        written([prompts[1] + response[:1] + [42]], 4)[0]]


def test_a_server_started_with_a_key_needs_it_and_r2r_sends_it(server, slm, tokenizer, monkeypatch):
    monkeypatch.delenv("R2R_LLM_API_KEY", raising=False)
    with pytest.raises(R2RError, match="needs an API key.*--llm-api-key"):
        remote(server.url, tokenizer, slm)
    with pytest.raises(R2RError, match="refused the key"):
        remote(server.url, tokenizer, slm, api_key="wrong")
    with pytest.raises(R2RError, match="empty"):
        remote(server.url, tokenizer, slm, api_key="")
    llm = remote(server.url, tokenizer, slm, api_key=KEY)
    engine = Engine(slm, llm, tokenizer, AlwaysLLM())
    prompt = engine.prompts.chat(REMOTE_PROMPTS[0])
    out = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.llm_tokens == 6
    monkeypatch.setenv("R2R_LLM_API_KEY", KEY)  # from the environment, as `r2r serve` reads it
    assert remote(server.url, tokenizer, slm).api.model


@NEEDS_LLAMA_SERVER
def test_r2r_serve_with_llm_api_key_against_a_keyed_llama_server(llm_files, slm, tokenizer, tmp_path, run_cli):
    slm_dir = tmp_path / "slm"
    slm.model.save_pretrained(slm_dir)
    tokenizer.save_pretrained(slm_dir)
    with LlamaServer(llm_files["gguf"], api_key=KEY) as srv:
        common = ["generate", "hi", "--slm", slm_dir, "--llm", srv.url, "--max-new-tokens", "4", "--device", "cpu",
                  "--router", "llm", "--json"]
        code, out, err = run_cli(*common)
        assert code != 0 and "needs an API key" in err + out
        code, out, err = run_cli(*common, "--llm-api-key", KEY)
        assert code == 0, err
        assert json.loads(out)["llm_tokens"] > 0


def mock_client(handler, retry: float = 1.0, url: str = "http://127.0.0.1:9"):
    from roads_to_rome.backends.remote import Client

    client = Client(url, timeout=5, retry=retry)
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(handler), auth=client.http.auth,
                               headers=client.http.headers)
    return client


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_5xx_answers_are_retried_then_the_llm_counts_as_unavailable(status):
    calls = []

    def flaky(request):
        calls.append(request)
        return httpx.Response(status, text="busy") if len(calls) <= 2 else httpx.Response(200, json={"ok": 1})

    assert mock_client(flaky, retry=5).get("/v1/models") == {"ok": 1} and len(calls) == 3
    with pytest.raises(LLMUnavailable, match=f"answered {status}"):
        mock_client(lambda r: httpx.Response(status), retry=0.5).get("/v1/models")


def test_a_call_counts_as_waiting_from_its_start_through_its_retries(monkeypatch):
    """A server that never answers in time: the call's wait is counted from its first attempt, not restarted by each
    timed-out attempt or by the first failure, so `stalled` comes STALLED_AFTER_S after the call began."""
    from roads_to_rome.backends import remote as remote_module

    monkeypatch.setattr(remote_module, "STALLED_AFTER_S", 1.0)

    def too_slow(request):
        time.sleep(0.3)
        raise httpx.ReadTimeout("no answer", request=request)

    client = mock_client(too_slow, retry=3.0)  # attempts end 0.3, 0.85, 1.65 and 2.95 s in; it gives up after that
    backend = remote_module.RemoteBackend.__new__(remote_module.RemoteBackend)  # `health` reads only the client
    backend.client = client
    outcome = []

    def call():
        try:
            client.get("/v1/models")
        except LLMUnavailable as e:
            outcome.append(e)

    started = time.monotonic()
    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.1)
    assert backend.health() is None
    time.sleep(1.4)  # into the third attempt, two timed out
    waited, health = client.waiting_for(), backend.health()
    assert waited >= time.monotonic() - started - 0.1 and health["status"] == "stalled"
    caller.join()
    assert outcome and client.waiting_for() == 0.0 and backend.health()["status"] == "unavailable"


def test_a_connection_cut_mid_answer_is_retried_and_garbled_answers_are_clear_errors():
    calls = []

    def cut_once(request):
        calls.append(request)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        return httpx.Response(200, json={"ok": 1})

    assert mock_client(cut_once).get("/x") == {"ok": 1} and len(calls) == 2
    for text in ("<html>502 Bad Gateway</html>", '{"choices": [{"logprobs": {"tok'):
        with pytest.raises(RemoteError, match="something other than JSON"):
            mock_client(lambda r, text=text: httpx.Response(200, text=text)).get("/x")


def test_an_openai_base_url_names_the_server_and_a_missing_path_says_what_address_to_give():
    asked = []

    def models_only(request):
        asked.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": []})
        return httpx.Response(404, text="<html>\n<h1>Not Found</h1>\n</html>")

    for url in ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1/", "http://127.0.0.1:9"):
        client = mock_client(models_only, url=url)
        assert client.url == "http://127.0.0.1:9" and client.get("/v1/models") == {"data": []}
    with pytest.raises(RemoteError, match="has no /tokenize .*address of a vLLM or llama.cpp server") as missing:
        client.post("/tokenize", {"content": "x"})
    assert "<html>" not in str(missing.value) and asked == ["/v1/models"] * 3 + ["/tokenize"]


def test_credentials_in_the_llm_address_are_sent_but_never_shown():
    seen = []

    def needs_basic(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(503)

    client = mock_client(needs_basic, retry=0, url="http://alice:hunter2@127.0.0.1:9/")
    assert "hunter2" not in client.url and "alice" not in client.url
    with pytest.raises(LLMUnavailable) as failed:
        client.get("/v1/models")
    assert "hunter2" not in str(failed.value) and seen[0].startswith("Basic ")
    from roads_to_rome.backends.remote import RemoteBackend, without_credentials

    assert without_credentials("http://alice:hunter2@h:1/v1?model=m") == "http://h:1/v1?model=m"
    with pytest.raises(R2RError) as bad:
        RemoteBackend("http://alice:hunter2@127.0.0.1:9?modle=x", None, set())
    assert "hunter2" not in str(bad.value)


def test_a_refused_connection_says_degraded_at_once_and_an_answer_clears_it():
    """A server killed mid-stream refuses connections: /health says so from the first refusal, while the call
    retries, not once the retry budget is spent; the first answer clears it."""
    from roads_to_rome.backends import remote as remote_module

    up = threading.Event()

    def killed_then_back(request):
        if not up.is_set():
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return httpx.Response(200, json={"ok": 1})

    client = mock_client(killed_then_back, retry=10.0)
    backend = remote_module.RemoteBackend.__new__(remote_module.RemoteBackend)  # `health` reads only the client
    backend.client = client
    caller = threading.Thread(target=client.get, args=("/v1/models",))
    caller.start()
    time.sleep(0.2)
    assert backend.health()["status"] == "refusing"
    up.set()
    caller.join(10)
    assert backend.health() is None


def test_each_rows_cache_salt_goes_to_vllm_with_its_requests():
    """vLLM's prefix cache reuses only what requests of the same `cache_salt` read: each row's salt goes with each
    of its requests (catch-ups and prompt scoring), none where it has none."""
    import multiprocessing.pool

    from roads_to_rome.backends.remote import RemoteBackend, VllmApi

    bodies = []

    def vllm(request):
        body = json.loads(request.content)
        bodies.append(body)
        if "prompt_logprobs" in body:
            entries = [None] + [{"5": {"logprob": -0.1, "rank": 1}}] * (len(body["prompt"]) - 1)
            return httpx.Response(200, json={"choices": [{"prompt_logprobs": entries}]})
        return httpx.Response(200, json={"choices": [{"logprobs": {"tokens": ["token_id:5"],
                                                                   "top_logprobs": [{"token_id:5": -0.1}]}}]})

    client = mock_client(vllm)
    api = VllmApi.__new__(VllmApi)
    api.client, api.model = client, "tiny"
    backend = RemoteBackend.__new__(RemoteBackend)
    backend.api, backend.client, backend.top_logprobs, backend.vocab_size, backend.hidden_size = api, client, 2, 10, 4
    backend.pool = multiprocessing.pool.ThreadPool(2)
    cache = backend.new_cache()
    backend.tag_rows(cache, ["alice", None])
    backend.forward(cache, torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2, dtype=torch.long))
    backend.forward_all(cache, torch.tensor([[6], [7]]), torch.ones(2, 3, dtype=torch.long), keep_last=1)
    backend.prompt_logprobs([1, 2, 3], 1, "bob")
    sent = sorted((b["prompt"], b.get("cache_salt")) for b in bodies)
    assert sent == [([1, 2], "alice"), ([1, 2, 3], "bob"), ([1, 2, 6], "alice"), ([3, 4], None), ([3, 4, 7], None)]


def test_the_batch_tags_the_llms_rows_with_their_requests_salts(slm, llm, tokenizer, monkeypatch):
    """Before each LLM call the batch hands the LLM's backend the cache_salt of each row it reads, in the cache's
    row order (what a remote one sends with the row's requests)."""
    from roads_to_rome.core.engine import Engine
    from roads_to_rome.core.request import Request
    from roads_to_rome.core.sampling import SamplingParams
    from roads_to_rome.routing.policies import AlwaysLLM

    tagged = []
    monkeypatch.setattr(llm, "tag_rows", lambda cache, salts: tagged.append(list(salts)))
    engine = Engine(slm, llm, tokenizer, AlwaysLLM())
    prompts = [tokenizer.encode(p) for p in ("Hello there", "What is 2 + 2?", "Bonjour")]
    engine.run([Request(p, SamplingParams(max_new_tokens=3 + i), cache_salt=salt)
                for i, (p, salt) in enumerate(zip(prompts, ["alice", None, "bob"]))])
    assert tagged and tagged[0] == ["alice", None, "bob"] and tagged[-1] == ["bob"]
