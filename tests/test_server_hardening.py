"""Server hardening, item by item (issue "Server hardening"): each bad input gets a clear 4xx without hurting
requests in flight or after it; long prompts are read in chunks; admission follows what the backend holds;
access control; graceful shutdown; and a bounded soak test mixing all of it."""

import concurrent.futures
import ctypes
import gc
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from bystander import Stream
from conftest import assert_idle_soon, make_backend, tiny_llamacpp
from helpers import until

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.request import Request, Sequence
from roads_to_rome.core.scheduler import Scheduler, Scheduling
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving import bodies
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.engine_thread import Job
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.messages_schemas import CountTokensBody, MessagesBody
from roads_to_rome.serving.responses_schemas import ResponsesBody
from roads_to_rome.serving.server import create_app

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine(slm, llm, tokenizer):
    return Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, "tiny-r2r", Limits(max_batch=4, max_queue=16, max_tokens=400, context_length=512,
                                                max_body_bytes=64 * 1024), scheduling=Scheduling(prefill_chunk=4))
    with BackgroundServer(app) as srv:
        yield srv.url


def body(content="What is 48 / 2?", **kw):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **kw}


def post(url, payload, **kw):
    return httpx.post(url + CHAT, json=payload, timeout=60, **kw)


def answer(url, content="What is 48 / 2?", r2r_policy="llm", **kw):
    response = post(url, body(content, r2r_policy=r2r_policy, **kw))
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


LONG_RUNNING = "Bonjour!"  # the tiny SLM answers it with no EOS for 450 tokens


def slow_down(model, monkeypatch, seconds=0.01):
    """Each forward of `model` takes `seconds` more: a stream that lasts long enough to act on it."""
    forward = model.forward

    def slow(*args):
        time.sleep(seconds)
        return forward(*args)

    monkeypatch.setattr(model, "forward", slow)


def unharmed(url, expected):
    """A request after the bad one is answered as before."""
    assert answer(url) == expected


@pytest.fixture(scope="module")
def expected(server):
    return answer(server)


# 1. A bad seed (or any value the backend cannot take) is refused before it joins the batch.
def test_1_an_overflowing_seed_is_a_400_and_a_concurrent_stream_goes_on(server, expected):
    reference = answer(server, "def add(a, b):", max_tokens=40)
    stream = Stream(server, body("def add(a, b):", max_tokens=40, r2r_policy="llm"))
    for seed in (1180591620717411303424, -(2**70)):
        response = post(server, body(seed=seed))
        assert response.status_code == 400 and response.json()["error"]["param"] == "seed", response.text
    assert stream.wait().error is None and stream.text == reference
    assert post(server, body(seed=2**64 - 1, temperature=1)).status_code == 200
    unharmed(server, expected)


# 2. Admission against the KV the backend really holds (llama.cpp: one pool every row shares).
@pytest.fixture(scope="module")
def gguf_files(slm, llm, tokenizer, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    folder = tmp_path_factory.mktemp("hardening")
    for model, name in ((slm, "slm"), (llm, "llm")):
        make_backend("llamacpp", model.model, tokenizer, folder, name)
    return folder / "slm.gguf", folder / "llm.gguf"


def gguf_engine(files, tokenizer, n_ctx, max_rows):
    small, large = (tiny_llamacpp(f, name=f.stem, n_ctx=n_ctx, max_rows=max_rows, vocab_size=len(tokenizer))
                    for f in files)
    return Engine(small, large, tokenizer, RandomPolicy(0.3, seed=0))


def test_2_llamacpp_admits_against_its_shared_kv_pool(gguf_files, tokenizer):
    engine = gguf_engine(gguf_files, tokenizer, n_ctx=700, max_rows=4)
    assert engine.kv_capacity == 700 and engine.max_context == 512  # the tiny model's trained context
    app = create_app(engine, "tiny-r2r", Limits(max_batch=4, max_tokens=450))
    scheduler = app.state.r2r.engine_thread.scheduler
    admit, seen = scheduler.admit, []

    def watched():  # what admission left in flight and waiting, each turn
        left = admit()
        seen.append((scheduler.kv_in_use, len(scheduler.waiting)))
        return left

    scheduler.admit = watched
    with BackgroundServer(app) as srv:
        too_long = post(srv.url, body("48 / 2 " * 200, max_tokens=400))
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        # Three requests whose prompt + max_tokens take 60% of the pool each: one at a time, none fails.
        reference = answer(srv.url, LONG_RUNNING, max_tokens=400, r2r_policy="slm")
        streams = [Stream(srv.url, body(LONG_RUNNING, max_tokens=400, r2r_policy="slm")) for _ in range(3)]
        for s in streams:
            assert s.wait().error is None and s.text == reference
    assert max(used for used, _ in seen) <= 700
    assert any(used and waiting for used, waiting in seen)  # one did wait for room


# 3. A long prompt is read in chunks between decode steps: running streams keep getting tokens.
def test_3_a_running_stream_keeps_receiving_tokens_while_a_long_prompt_is_read(server, engine):
    running = Stream(server, body(LONG_RUNNING, max_tokens=300, r2r_policy="slm"))
    while not running.times:
        time.sleep(0.01)
    submitted = time.monotonic()
    long_prompt = "Natalia sold clips to 48 of her friends in April. " * 8  # ~230 tokens: ~60 chunks of 4
    assert len(engine.prompts.chat(long_prompt)) > 200
    newcomer = Stream(server, body(long_prompt, max_tokens=4, r2r_policy="slm")).wait()
    running.wait()
    assert newcomer.error is None and running.error is None, (newcomer.error, running.error)
    during = [t for t in running.times if submitted < t < newcomer.times[0]]
    assert len(running.times) > 100, "the running stream ended too early to tell"
    # Read in one go, the prompt would hold every stream until it is read; in chunks, a token per chunk.
    assert len(during) >= 20, (len(during), len(running.times))


# 4. --max-batch beyond what the backend can hold is refused at start.
def test_4_max_batch_beyond_the_backends_rows_is_refused_at_start(gguf_files, tokenizer):
    engine = gguf_engine(gguf_files, tokenizer, n_ctx=2048, max_rows=8)
    with pytest.raises(R2RError, match="--max-batch 9 is more than the backend holds"):
        create_app(engine, "tiny-r2r", Limits(max_batch=9))
    create_app(engine, "tiny-r2r", Limits(max_batch=8))
    from roads_to_rome.backends.llamacpp import LlamaCppBackend

    with pytest.raises(R2RError, match="lower the batch size"):  # `r2r serve` sizes llama.cpp to --max-batch
        LlamaCppBackend(gguf_files[0], max_rows=300)


# 5. The body-size limit, and an event loop that stays free while big bodies are handled.
def test_5_bodies_over_the_limit_are_413_and_health_answers_while_bodies_are_tokenised(server, engine, expected,
                                                                                       monkeypatch):
    big = json.dumps(body("x" * 100_000)).encode()
    response = httpx.post(server + CHAT, content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit counts what arrives
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    response = httpx.post(server + CHAT, content=chunked(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    # Just under the limit: tokenised off the event loop (then refused: longer than the context). Tokenising is
    # held until /health has answered: were it on the event loop, /health could not answer and would time out.
    entered, released = threading.Event(), threading.Event()
    encode = engine.prompts.messages

    def held(*args, **kwargs):
        entered.set()
        released.wait(timeout=60)
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine.prompts, "messages", held)
    near = body("48 / 2 " * 8000)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        posts = [pool.submit(post, server, near) for _ in range(4)]
        assert entered.wait(timeout=60), "no request reached tokenisation"
        try:
            assert httpx.get(server + "/health", timeout=20).status_code == 200
        finally:
            released.set()
        assert all(p.result().status_code == 400 for p in posts)
    monkeypatch.undo()
    unharmed(server, expected)


MESSAGE = {"messages": [{"role": "user", "content": "What is 48 / 2?"}], "max_tokens": 8, "temperature": 0}


# A body is parsed and validated off the event loop (its time grows with it), and so is a Responses or Messages
# body's conversion to a chat: each is held until /health has answered, which it could not do from the loop.
@pytest.mark.parametrize("path, payload, held", [
    (CHAT, body(), (bodies, "validated")), ("/v1/completions", {"prompt": "48 / 2 =", "max_tokens": 4},
                                            (bodies, "validated")),
    ("/v1/responses", {"input": "What is 48 / 2?", "max_output_tokens": 8}, (ResponsesBody, "chat_request")),
    ("/v1/messages", MESSAGE, (MessagesBody, "chat_request")), ("/v1/messages/count_tokens", MESSAGE,
                                                              (CountTokensBody, "chat_request"))],
    ids=["chat", "completions", "responses", "messages", "count_tokens"])
def test_5_bodies_are_read_off_the_event_loop(server, expected, monkeypatch, path, payload, held):
    entered, released, threads = threading.Event(), threading.Event(), []
    owner, name = held
    work = getattr(owner, name)

    def holding(*args, **kwargs):
        threads.append(threading.current_thread().name)
        entered.set()
        released.wait(timeout=60)
        return work(*args, **kwargs)

    monkeypatch.setattr(owner, name, holding)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, server + path, json=payload, timeout=60)
        assert entered.wait(timeout=60), f"{path}: the body was not read"
        try:
            assert httpx.get(server + "/health", timeout=20).status_code == 200
        finally:
            released.set()
        assert reply.result().status_code == 200, reply.result().text
    assert threads and all(thread.startswith("r2r-tokenize") for thread in threads), threads
    monkeypatch.undo()
    unharmed(server, expected)


# 6. Unhandled errors are JSON: lone surrogates and deep nesting are 400s, anything else a 500 without internals.
@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "\\ud800x"}], "max_tokens": 4}',
                                 b'{"prompt": "ok", "stop": ["\\udfff"]}', b"[" * 30_000 + b"]" * 30_000,
                                 b'{"prompt": "ok \xff"}'],
                         ids=["lone surrogate", "surrogate in stop", "nested 100k deep", "not UTF-8"])
def test_6_malformed_text_and_deep_json_are_400s(server, expected, raw):
    path = "/v1/completions" if b"prompt" in raw else CHAT
    response = httpx.post(server + path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    unharmed(server, expected)


def test_6_errors_answered_at_once_start_no_threads(server, expected):
    """Each kind of error reply (a 400 from validation, a 404, a 400 of the server's own) is written on the event
    loop: a burst of them from 16 clients leaves the process with the threads it had."""
    bodies = [(CHAT, b'{"messages": ['), ("/v1/nowhere", b"{}"), (CHAT, json.dumps(body(model="nope")).encode())]

    def send(i):
        path, raw = bodies[i % len(bodies)]
        return httpx.post(server + path, content=raw, headers={"content-type": "application/json"}).status_code

    before = {t.ident for t in threading.enumerate()}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert set(pool.map(send, range(96))) == {400, 404}
    new = [t.name for t in threading.enumerate() if t.ident not in before]
    assert not new, f"error replies started threads: {new}"
    unharmed(server, expected)


def test_6_an_unexpected_error_is_a_json_500_without_internals(server, engine, expected, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("secret internals")

    monkeypatch.setattr(engine.prompts, "messages", broken)
    response = post(server, body())
    assert response.status_code == 500
    assert "secret" not in response.text and "KeyError" not in response.text
    assert response.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    unharmed(server, expected)


def test_6_an_engine_failure_while_a_prompt_is_read_fails_only_that_request(server, engine, slm, expected,
                                                                            monkeypatch):
    reference = answer(server, "def add(a, b):", max_tokens=60)
    running = Stream(server, body("def add(a, b):", max_tokens=60, r2r_policy="llm"))
    while not running.times:
        time.sleep(0.01)
    original = slm.forward

    def failing_on_long_reads(cache, new_ids, mask):
        if new_ids.shape[1] > 1:  # a chunk of a prompt, never a decode step
            raise RuntimeError("simulated failure")
        return original(cache, new_ids, mask)

    monkeypatch.setattr(slm, "forward", failing_on_long_reads)
    response = post(server, body("Paris is the capital of France. " * 5))
    assert response.status_code == 500 and "simulated" not in response.text
    monkeypatch.undo()
    assert running.wait().error is None and running.text == reference
    unharmed(server, expected)


# 7. A queued client that gives up leaves the queue.
def test_7_queued_clients_that_give_up_leave_the_queue(engine, slm, monkeypatch):
    slow_down(slm, monkeypatch)
    app = create_app(engine, "tiny-r2r", Limits(max_batch=1, max_queue=2, max_tokens=400, context_length=512))
    with BackgroundServer(app) as srv:
        busy = Stream(srv.url, body(LONG_RUNNING, max_tokens=400, r2r_policy="slm"))
        while not busy.times:
            time.sleep(0.01)
        for _ in range(2):  # two clients queue, then time out
            with pytest.raises(httpx.TimeoutException):
                httpx.post(srv.url + CHAT, json=body(), timeout=0.3)
        with pytest.raises(httpx.TimeoutException):
            with httpx.stream("POST", srv.url + CHAT, json={**body(), "stream": True}, timeout=0.3) as r:
                r.read()
        until(lambda: httpx.get(srv.url + "/health").json()["waiting"] == 0, "the clients that gave up leave the queue")
        queued = [concurrent.futures.ThreadPoolExecutor(1).submit(post, srv.url, body()) for _ in range(2)]
        assert all(q.result().status_code == 200 for q in queued)  # not 429
        assert busy.wait().error is None


# 9. Values no sampler should take, and error bodies that name the field, not the code.
@pytest.mark.parametrize("field, value", [("temperature", 1e308), ("temperature", "inf"), ("temperature", "nan"),
                                          ("top_p", "-inf"), ("r2r_threshold", "inf"), ("r2r_verify", "inf"),
                                          ("r2r_llm_rate", "nan"), ("seed", 2**64)])
def test_9_non_finite_and_out_of_range_values_are_400s(server, expected, field, value):
    response = post(server, body(**{field: value}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] and "Error" not in error["message"] and "Traceback" not in error["message"]
    unharmed(server, expected)


# A field sent as null takes its default (OpenAI declares them nullable, vLLM reads them so), and vLLM's top_k -1
# is no cut, as 0; a required field sent as null is still refused.
def test_9_null_fields_take_their_default_on_every_api(server, expected):
    nulls = dict.fromkeys(("top_p", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                           "min_tokens", "logprobs", "top_logprobs", "stream", "stream_options", "parallel_tool_calls",
                           "echo", "seed", "stop", "ignore_eos", "add_generation_prompt", "priority"))
    assert answer(server, **nulls, top_k=-1) == expected
    assert post(server, body(temperature=None, r2r_policy="llm")).status_code == 200
    reply = httpx.post(server + "/v1/responses", json={
        "input": "What is 48 / 2?", "max_output_tokens": 8, "temperature": 0, "r2r_policy": "llm", "top_k": -1,
        **dict.fromkeys(("stream", "store", "background", "parallel_tool_calls", "top_p"))}, timeout=60)
    assert reply.status_code == 200 and reply.json()["output"][0]["content"][0]["text"] == expected, reply.text
    message = {"messages": [{"role": "user", "content": "What is 48 / 2?"}], "max_tokens": 8, "temperature": 0,
               "r2r_policy": "llm", "top_k": -1, "stream": None, "top_p": None}
    reply = httpx.post(server + "/v1/messages", json=message, timeout=60)
    assert reply.status_code == 200 and reply.json()["content"][0]["text"] == expected, reply.text
    reply = httpx.post(server + "/v1/messages", json={**message, "max_tokens": None}, timeout=60)
    assert reply.status_code == 400 and "max_tokens" in reply.json()["error"]["message"]
    assert post(server, body(top_k=-2)).status_code == 400


# 10. Access: API key, Host and Origin on a loopback server, JSON-only posts, no docs unless asked.
def test_10_api_key_host_origin_content_type_and_docs(engine):
    app = create_app(engine, "tiny-r2r", Limits(max_tokens=16, context_length=512), api_key="sesame")
    with BackgroundServer(app) as srv:
        url = srv.url
        good = {"authorization": "Bearer sesame"}
        assert post(url, body()).status_code == 401
        assert post(url, body(), headers={"authorization": "Bearer wrong"}).json()["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        keyed = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
        assert 1 <= keyed.usage.completion_tokens == len(keyed.model_extra["r2r"]["token_ids"]) <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        for path, sent in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(url + path, json=sent).status_code == 401
            assert httpx.post(url + path, json=sent, headers=good).status_code == 200
        assert httpx.get(url + "/health").json() == {"status": "ok"}  # health checks need no key: the status only
        foreign = [{"host": "evil.example"}, {"origin": "http://evil.example"}, {"origin": "null"}]
        for headers in foreign:
            response = post(url, body(), headers={**good, **headers})
            assert response.status_code == 403, (headers, response.text)
        response = httpx.post(url + CHAT, content=json.dumps(body()), headers={**good, "content-type": "text/plain"})
        assert response.status_code == 415
        assert post(url, body(), headers={**good, "origin": url}).status_code == 200  # the playground itself
        assert httpx.get(url + "/docs").status_code == 404 and httpx.get(url + "/openapi.json").status_code == 404
    with BackgroundServer(create_app(engine, "tiny-r2r", docs=True)) as srv:
        document = httpx.get(srv.url + "/openapi.json")
        assert document.status_code == 200
        # each body a route reads itself is declared, and every schema it names is in the document
        named = set(re.findall(r'"#/components/schemas/([^"]+)"', document.text))
        assert named and named <= set(document.json()["components"]["schemas"]), named
        with_body = {path for path, operation in document.json()["paths"].items()
                     if "requestBody" in operation.get("post", {})}
        assert {CHAT, "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
                "/detokenize"} <= with_body, with_body


def test_10_a_server_bound_to_all_interfaces_answers_other_host_names(engine):
    app = create_app(engine, "tiny-r2r", Limits(max_tokens=16, context_length=512), loopback_only=False)
    with BackgroundServer(app) as srv:
        assert post(srv.url, body(), headers={"host": "r2r.internal:8000"}).status_code == 200


# 11. Greedy output and batch company: on torch float32 a request's tokens do not depend on the others in its
# batch; llama.cpp's batched kernels sum in another order than its one-row kernels (README: "What a client can rely
# on"), which the e2e suite measures on the real pair.
def test_11_torch_float32_greedy_output_does_not_depend_on_batch_company(server):
    prompts = ["What is 48 / 2?", "def add(a, b):", "Bonjour!", "Paris is the capital of"]
    for policy in ("slm", "llm"):
        alone = [answer(server, p, max_tokens=24, r2r_policy=policy) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(3):
                together = list(pool.map(lambda p: answer(server, p, max_tokens=24, r2r_policy=policy), prompts))
                assert together == alone


# 8. Shutdown: a deadline for in-flight streams, and a second signal exits at once.
SERVE_TINY = """
import sys, time
sys.path.insert(0, {tests!r})
from tiny import tiny_model, tiny_tokenizer
from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.server import create_app, run
from roads_to_rome.serving.limits import Limits
from roads_to_rome.backends.torch_backend import TorchBackend
tok = tiny_tokenizer()
slm = TorchBackend(tiny_model(tok, hidden=32, seed=0))
forward = slm.forward
slm.forward = lambda *args: (time.sleep(0.02), forward(*args))[1]  # a stream that lasts ~10 s
engine = Engine(slm, TorchBackend(tiny_model(tok, hidden=64, seed=1)), tok, RandomPolicy(0.3, seed=0))
run(create_app(engine, "tiny", Limits(max_tokens=480, drain_timeout={drain})), "127.0.0.1", {port})
"""


def start_tiny_server(drain: float):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = SERVE_TINY.format(tests=str(Path(__file__).parent), drain=drain, port=port)
    process = subprocess.Popen([sys.executable, "-c", code])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the tiny server did not start")


def refused(url) -> bool:
    """Whether the server at `url` turns a new connection away."""
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.HTTPError:
        return True
    return False


def endless(url):
    """A stream that runs for ~10 s."""
    stream = Stream(url, body(LONG_RUNNING, max_tokens=480, r2r_policy="slm"))
    while not stream.times and not stream.done.is_set():
        time.sleep(0.01)
    return stream


def test_8_sigterm_cuts_streams_at_the_drain_deadline_and_a_second_signal_exits_at_once():
    process, url = start_tiny_server(drain=1.0)
    try:
        stream = endless(url)
        assert not stream.done.is_set(), "the stream ended by itself"
        process.send_signal(signal.SIGTERM)
        stream.wait(30)
        # Cut at the deadline, not finished: the stream would have run ~10 s.
        assert stream.error is not None and "shutting down" in stream.error["message"]
        assert process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    finally:
        process.kill()
    process, url = start_tiny_server(drain=600.0)
    try:
        stream = endless(url)
        process.send_signal(signal.SIGTERM)
        until(lambda: refused(url), "the draining server turns new clients away")
        assert process.poll() is None and not stream.done.is_set()  # draining: the stream has 600 s
        with pytest.raises(httpx.HTTPError):  # and nobody new gets in
            post(url, body())
        process.send_signal(signal.SIGTERM)
        process.wait(15)  # the second signal: out at once, not after the 600 s
        assert stream.wait(30).error is not None  # and the stream it was draining for is cut
    finally:
        process.kill()


# Soak: everything at once, bounded.
BAD = [
    (body(seed=2**70), 400), (body(temperature="inf"), 400), ({"messages": "hi"}, 400),
    (body(max_tokens=10**6), 400), (body("48 / 2 " * 600), 400), (body(r2r_verify="always"), 400),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400), (body(model="gpt-17"), 404),
]


def test_soak_8_clients_200_requests_of_every_kind(engine, monkeypatch):
    # The engine's turns pass a gate, open but for the burst that fills the queue (below).
    gate, advance = threading.Event(), Scheduler.advance
    gate.set()

    def gated(scheduler):
        gate.wait(timeout=60)
        return advance(scheduler)

    monkeypatch.setattr(Scheduler, "advance", gated)
    app = create_app(engine, "tiny-r2r", Limits(max_batch=3, max_queue=4, max_tokens=64, context_length=512),
                     scheduling=Scheduling(prefill_chunk=16))
    prompts = [f"What is {n} / 2?" for n in range(40, 46)] + ["Paris is the capital of France. " * 12]
    process = psutil.Process(os.getpid())  # the server runs in this process

    def rss():
        # glibc keeps freed memory for reuse, so RSS is the high-water mark of how much was in use at once,
        # which on a loaded machine (more requests overlapping) is higher; hand it back to measure what is kept.
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        return process.memory_info().rss
    with BackgroundServer(app) as srv:
        url = srv.url
        answers = {p: answer(url, p, max_tokens=24) for p in prompts}
        counts = {"good": 0, "bad": 0, "disconnected": 0, "429": 0}
        lock = threading.Lock()

        def good(rng, i):
            prompt = prompts[i % len(prompts)] if i < 20 else rng.choice(prompts)
            while True:
                if rng.random() < 0.5:
                    stream = Stream(url, body(prompt, max_tokens=24, r2r_policy="llm")).wait()
                    if stream.error is None and stream.times:
                        return stream.text == answers[prompt]
                    response = post(url, body(prompt, max_tokens=24, r2r_policy="llm"))  # 429 mid-open? retry
                else:
                    response = post(url, body(prompt, max_tokens=24, r2r_policy="llm"))
                if response.status_code == 429:
                    with lock:
                        counts["429"] += 1
                    time.sleep(0.05)
                    continue
                return response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == \
                    answers[prompt]

        def one(i):
            rng = random.Random(i)
            # The first 20 (the memory baseline) go through every path once: each bad class, disconnects, each
            # prompt streamed and not; then a random mix.
            first = ["bad"] * len(BAD) + ["disconnected"] * 2 + ["good"] * (20 - len(BAD) - 2)
            kind = first[i] if i < 20 else rng.choices(["good", "bad", "disconnected"], [6, 3, 1])[0]
            if kind == "bad":
                payload, status = BAD[i % len(BAD)]
                response = httpx.post(url + CHAT, content=json.dumps(payload).encode("utf-8", "surrogatepass"),
                                      headers={"content-type": "application/json"}, timeout=60)
                ok = response.status_code == status or response.status_code == 429
            elif kind == "disconnected":
                with httpx.stream("POST", url + CHAT, json={**body(LONG_RUNNING, max_tokens=64, r2r_policy="slm"),
                                                            "stream": True}, timeout=60) as response:
                    for line in response.iter_lines():
                        if '"r2r"' in line:
                            break
                ok = True
            else:
                ok = good(rng, i)
            with lock:
                counts[kind] += 1
            return ok

        def run(first, n):
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                return list(pool.map(one, range(first, first + n)))

        assert all(run(0, 20))
        time.sleep(0.5)
        rss_after_20, threads, fds = rss(), process.num_threads(), process.num_fds()
        python_threads = set(threading.enumerate())
        assert all(run(20, 200))
        # The queue overflows, whatever the processor's speed: with the engine held before its next step, 8 clients
        # ask at once for the 7 places the limits give (3 in the batch, 4 waiting); the one refused retries, and
        # every client gets its answer once the engine goes on.
        refused = counts["429"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            gate.clear()
            try:
                burst = [pool.submit(good, random.Random(i), i) for i in range(220, 228)]
                until(lambda: counts["429"] > refused, "a client refused while the queue is full")
            finally:
                gate.set()
            assert all(b.result() for b in burst)
        assert_idle_soon(url)
        assert rss() <= 1.10 * rss_after_20
        # No request, sequence or job is kept. (type(), not isinstance: that would touch lazy proxies, importing
        # modules.)
        assert not [o for o in gc.get_objects() if type(o) in (Request, Sequence, Job)]
        for _ in range(40):  # client threads that just finished take a moment to exit
            if process.num_threads() <= threads:
                break
            time.sleep(0.05)
        assert process.num_threads() <= threads, [t.name for t in set(threading.enumerate()) - python_threads]
        assert process.num_fds() <= fds + 2, fds
        assert counts["good"] > 100 and counts["bad"] > 40 and counts["disconnected"] > 10, counts
