"""The OpenAI-compatible server on a tiny pair, driven by the official openai client over loopback."""

import concurrent.futures
import dataclasses
import functools
import json
import os
import time

import httpx
import openai
import psutil
import pytest
from conftest import assert_idle_soon

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.routing.rate import CATCH_UP_TOKENS
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import SERVER_SCHEDULING, Limits
from roads_to_rome.serving.metrics import Metrics
from roads_to_rome.serving.server import create_app


@pytest.fixture(scope="module")
def server(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    app = create_app(engine, "tiny-r2r", Limits(max_batch=8, max_queue=64, max_tokens=64, context_length=256))
    with BackgroundServer(app) as srv:
        yield srv.url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, content, **kw):
    return client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def test_every_reply_carries_its_request_id(server):
    """X-Request-Id: the client's, where it is one a log line can carry as it is, else a fresh one; on refusals
    too (the guard's, a bad body's)."""
    given = httpx.get(server + "/health", headers={"X-Request-Id": "proxy-1.a:b"})
    assert given.headers["x-request-id"] == "proxy-1.a:b"
    fresh = [httpx.get(server + "/v1/models", headers=headers).headers["x-request-id"]
             for headers in ({}, {}, {"X-Request-Id": "x" * 200}, {"X-Request-Id": "a b\tc"})]
    assert len(set(fresh)) == 4 and all(len(i) == 32 for i in fresh)
    refused = httpx.post(server + "/v1/chat/completions", content=b"{", headers={"X-Request-Id": "bad-body",
                                                                              "Content-Type": "application/json"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-body"
    not_json = httpx.post(server + "/v1/chat/completions", content=b"hi", headers={"X-Request-Id": "plain"})
    assert not_json.status_code == 415 and not_json.headers["x-request-id"] == "plain"


def test_a_bodys_request_id_names_the_request_unless_its_header_does(server):
    """vLLM's `request_id` field: where the client sends no X-Request-Id, it is the request's id: in the header, in
    the reply's id (`chatcmpl-<id>`, `cmpl-<id>`, as vLLM's) and in the log; the header wins over it. One a log
    line cannot carry as it is is a 400 naming it."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "job-7.step:3"}
    named = httpx.post(server + "/v1/chat/completions", json=chat)
    assert named.headers["x-request-id"] == "job-7.step:3" and named.json()["id"] == "chatcmpl-job-7.step:3"
    header = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "request_id": "body"},
                        headers={"X-Request-Id": "proxy-9"})
    assert header.headers["x-request-id"] == "proxy-9" and header.json()["id"] == "cmpl-proxy-9"
    fresh = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert fresh.json()["id"] == "cmpl-" + fresh.headers["x-request-id"]
    streamed = httpx.post(server + "/v1/chat/completions", json={**chat, "stream": True})
    ids = {json.loads(line[6:])["id"] for line in streamed.text.splitlines() if line.startswith("data: {")}
    assert streamed.headers["x-request-id"] == "job-7.step:3" and ids == {"chatcmpl-job-7.step:3"}
    for bad in ("a b", "x" * 129, ""):
        r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "request_id": bad})
        assert r.status_code == 400 and "request_id" in r.text, bad


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny-r2r"]
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_chat_non_streaming_carries_provenance_and_usage(client):
    out = chat(client, "What is 48 / 2?", max_tokens=20)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("stop", "length")
    usage = out.usage.model_extra
    assert {"llm_tokens", "llm_rate", "avg_activated_params_b"} <= set(usage)
    r2r = out.model_extra["r2r"]
    assert len(r2r["sources"]) == out.usage.completion_tokens
    assert usage["llm_tokens"] == r2r["sources"].count("llm")


def test_streamed_answer_equals_non_streamed_under_greedy(client):
    for prompt in ("What is 48 / 2?", "def add(a, b):"):
        whole = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=30, extra_body={"r2r_policy": "llm"})
        chunks = list(client.chat.completions.create(
            model="tiny-r2r", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=30,
            stream=True, stream_options={"include_usage": True}, extra_body={"r2r_policy": "llm"}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        provenance = [c.model_extra["r2r"] for c in chunks if c.model_extra.get("r2r")]
        assert [p["token_id"] for p in provenance] == whole.model_extra["r2r"]["token_ids"]
        assert all(p["source"] == "llm" for p in provenance)
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.model_extra["llm_rate"] == 1.0


def test_skip_special_tokens_false_shows_them_in_the_text_as_streamed(client, tokenizer):
    """vLLM's skip_special_tokens: false writes the special tokens the model wrote into the text (streamed the same),
    and stop strings see them; the end of sequence that ended it stays out unless include_stop_str_in_output."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])

    def ask(stream=False, **extra):
        sent = dict(model="tiny-r2r", messages=[{"role": "user", "content": "What is 48 / 2?"}], temperature=0,
                    max_tokens=3, extra_body={"r2r_policy": "slm", **extra})
        if not stream:
            return client.chat.completions.create(**sent).choices[0].message.content
        chunks = client.chat.completions.create(**sent, stream=True)
        return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]

    started = {"logit_bias": {str(start): 100}}
    assert ask(**started) == "" and ask(**started, skip_special_tokens=True) == ""
    assert ask(True, **started, skip_special_tokens=False) == ["<|im_start|>"] * 3  # each as it is written
    for stream in (False, True):
        text = functools.partial(lambda *a, **k: "".join(ask(*a, **k)), stream)
        assert text(**started, skip_special_tokens=False) == "<|im_start|>" * 3
        assert text(**started, skip_special_tokens=False, stop=["m_start|><|im"]) == "<|i"
        ended = {"logit_bias": {str(end): 100}, "skip_special_tokens": False}
        assert text(**ended) == ""
        assert text(**ended, include_stop_str_in_output=True) == "<|im_end|>"
    assert ask(**started, spaces_between_special_tokens=False) == ""  # accepted: it changes nothing here


def test_continuous_usage_stats_give_each_chunk_its_usage_so_far(client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each token's chunk carries the tokens
    written so far; the last chunk the whole request's usage."""
    chunks = list(client.chat.completions.create(
        model="tiny-r2r", messages=[{"role": "user", "content": "What is 48 / 2?"}], max_tokens=12, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    tokens = [c for c in chunks if c.model_extra.get("r2r")]
    assert [c.usage.completion_tokens for c in tokens] == list(range(1, 13))
    assert {c.usage.prompt_tokens for c in tokens} == {chunks[-1].usage.prompt_tokens}
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    plain = list(client.chat.completions.create(
        model="tiny-r2r", messages=[{"role": "user", "content": "What is 48 / 2?"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices and c.choices[0].finish_reason is None)  # at the end only


def test_completions_streaming_and_not(client):
    whole = client.completions.create(model="tiny-r2r", prompt="def add(a, b):", max_tokens=15, temperature=0,
                                      extra_body={"r2r_policy": "slm"})
    assert whole.model_extra["r2r"]["sources"] == ["slm"] * whole.usage.completion_tokens
    streamed = list(client.completions.create(model="tiny-r2r", prompt="def add(a, b):", max_tokens=15,
                                              temperature=0, stream=True, extra_body={"r2r_policy": "slm"}))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert all(c.model_extra["r2r"]["source"] == "slm" for c in streamed)


def test_stop_string_is_not_streamed(client):
    whole = chat(client, "Bonjour!", max_tokens=40, extra_body={"r2r_policy": "slm"})
    text = whole.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = chat(client, "Bonjour!", max_tokens=40, stop=[stop], extra_body={"r2r_policy": "slm"})
    streamed = list(chat(client, "Bonjour!", max_tokens=40, stop=[stop], stream=True,
                         extra_body={"r2r_policy": "slm"}))
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut.choices[0].message.content
    kept = list(chat(client, "Bonjour!", max_tokens=40, stop=[stop], stream=True,
                     extra_body={"r2r_policy": "slm", "include_stop_str_in_output": True}))
    assert "".join(c.choices[0].delta.content or "" for c in kept if c.choices) == text[: text.find(stop) + len(stop)]


def test_routing_knobs(client):
    none = chat(client, "What is 48 / 2?", max_tokens=20, extra_body={"r2r_threshold": 0.0})
    assert none.usage.model_extra["llm_tokens"] == 0  # random policy: route when the draw is below 0
    every = chat(client, "What is 48 / 2?", max_tokens=20, extra_body={"r2r_threshold": 1.0})
    assert every.usage.model_extra["llm_rate"] == 1.0
    half = chat(client, "What is 48 / 2?", max_tokens=64, extra_body={"r2r_llm_rate": 0.5})
    # Random draws aim at 0.5 plus what the request owes over CATCH_UP_TOKENS: owing 0.5 x that, every token is
    # routed, ahead by as much none is, so what it owes never leaves ±(0.5 x CATCH_UP_TOKENS + 0.5), however long.
    owed = 0.5 * half.usage.completion_tokens - half.usage.model_extra["llm_tokens"]
    assert abs(owed) <= 0.5 * CATCH_UP_TOKENS + 0.5


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "tiny-r2r", "messages": [', 400),
    ("not an object", b'[1, 2]', 400),
    ("wrong type", json.dumps({"model": "tiny-r2r", "messages": "hello"}).encode(), 400),
    ("wrong type in field", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": "many"}).encode(), 400),
    ("unknown model", json.dumps({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),
    ("prompt longer than the context", json.dumps({"messages": [{"role": "user", "content": "48 / 2 " * 400}],
                                                   "max_tokens": 5}).encode(), 400),
    ("negative max_tokens", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(),
     400),
    ("too many max_tokens", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}).encode(),
     400),
    ("bad routing knob", json.dumps({"messages": [{"role": "user", "content": "hi"}], "r2r_llm_rate": 2}).encode(),
     400),
    ("threshold outside the policy's range", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                         "r2r_threshold": 2}).encode(), 400),
    ("bad verify", json.dumps({"messages": [{"role": "user", "content": "hi"}], "r2r_verify": "always"}).encode(), 400),
    ("negative tolerance", json.dumps({"messages": [{"role": "user", "content": "hi"}], "r2r_verify": -1}).encode(),
     400),
    ("bad verify interval", json.dumps({"messages": [{"role": "user", "content": "hi"}], "r2r_verify": "strict",
                                        "r2r_max_unverified": 0}).encode(), 400),
    ("a verify interval with verification off", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                            "r2r_verify": "off", "r2r_max_unverified": 3}).encode(),
     400),
    ("the LLM alone verified", json.dumps({"messages": [{"role": "user", "content": "hi"}], "r2r_policy": "llm",
                                           "r2r_verify": "strict"}).encode(), 400),
    ("stream_options without a stream", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    "stream_options": {"include_usage": True}}).encode(), 400),
]


def test_an_error_names_the_field_the_client_sent(server):
    for path, body, param in [
            ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
            ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
            ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options")]:
        prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
        response = httpx.post(server + path, json={**prompt, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert param in response.json()["error"]["message"]


def test_content_parts_are_read_as_text_and_a_part_no_model_here_reads_is_named(server):
    """Text parts join into the message's text, and an assistant's refusal handed back reads as its text (vLLM's
    rule); an image or audio part is a 400 that names its type, not a schema dump."""
    def tokens(user, assistant):
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant},
                    {"role": "user", "content": "Why?"}]
        return httpx.post(server + "/tokenize", json={"messages": messages})
    plain = tokens("What is 48 / 2?", "I cannot say.")
    parts = tokens([{"type": "text", "text": "What is "}, {"type": "text", "text": "48 / 2?"}],
                   [{"type": "refusal", "refusal": "I cannot say."}])
    assert plain.status_code == parts.status_code == 200 and plain.json()["tokens"] == parts.json()["tokens"]
    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                 {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}):
        response = httpx.post(server + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "messages.0.content.0", response.text
        assert repr(part["type"]) in error["message"] and "text only" in error["message"]
    response = httpx.post(server + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 2})
    assert response.status_code == 400 and "holds its text" in response.json()["error"]["message"]


@pytest.mark.parametrize("name, body, status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, name, body, status):
    response = httpx.post(server + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    after = chat(client, "What is 48 / 2?", max_tokens=3)  # the server still answers, in full
    assert 1 <= after.usage.completion_tokens == len(after.model_extra["r2r"]["token_ids"]) <= 3
    assert after.choices[0].finish_reason in ("stop", "length") and isinstance(after.choices[0].message.content, str)


@pytest.mark.parametrize("n", [1, 3])
def test_disconnected_stream_frees_its_slot(server, client, n):
    with httpx.stream("POST", server + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 64,
                            "temperature": 0, "r2r_policy": "slm", "stop": None, "n": n}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"r2r"' in line:
                break  # one token, then hang up
    assert_idle_soon(server)


def test_load_8_concurrent_streaming_clients(server, client):
    """Bounded loopback load: 8 concurrent streaming clients, 40 requests, right content; no memory growth."""
    prompts = [f"What is {n} / 2?" for n in range(40, 48)]

    def expected(prompt):
        return chat(client, prompt, max_tokens=24, extra_body={"r2r_policy": "llm"}).choices[0].message.content

    answers = {p: expected(p) for p in prompts}

    def one(i):
        prompt = prompts[i % len(prompts)]
        stream = chat(client, prompt, max_tokens=24, stream=True, extra_body={"r2r_policy": "llm"})
        return prompt, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def run(n):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, range(n)))

    process = psutil.Process(os.getpid())  # the server runs in this process
    run(20)
    rss_after_20 = process.memory_info().rss
    results = run(40)
    assert len(results) == 40
    for prompt, text in results:
        assert text == answers[prompt]
    for _ in range(7):
        run(20)
    rss_after_200 = process.memory_info().rss
    assert rss_after_200 <= 1.10 * rss_after_20, (rss_after_20, rss_after_200)


def test_an_engine_failure_fails_only_the_requests_in_flight(server, client, slm, monkeypatch, caplog):
    """The failed request's error names its id (the client's X-Request-Id), under which the log has what happened;
    the client sees no internals."""
    original = slm.forward
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(slm, "forward", failing_once)
    response = httpx.post(server + "/v1/chat/completions", headers={"X-Request-Id": "trace-4711"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert response.status_code == 500 and response.headers["x-request-id"] == "trace-4711"
    error = response.json()["error"]
    assert error["type"] == "server_error" and "simulated" not in error["message"]  # internals stay in the log
    assert "the server's log has the details under request trace-4711" in error["message"]
    logged = [r for r in caplog.records if "trace-4711" in r.getMessage()]
    assert logged and "simulated device failure" in str(logged[0].exc_info[1])
    assert chat(client, "What is 48 / 2?", max_tokens=3).usage.completion_tokens >= 1


def test_strict_verification_streams_the_llms_own_answer(client):
    """r2r_verify strict: the answer is the LLM's greedy one, streamed token by token as it is checked, with
    verification's fixes marked in the provenance."""
    for prompt in ("What is 48 / 2?", "Bonjour!"):
        llm_only = chat(client, prompt, max_tokens=30, extra_body={"r2r_policy": "llm"})
        knobs = {"r2r_verify": "strict", "r2r_max_unverified": 3, "r2r_threshold": 0.1}
        whole = chat(client, prompt, max_tokens=30, extra_body=knobs)
        assert whole.model_extra["r2r"]["token_ids"] == llm_only.model_extra["r2r"]["token_ids"]
        chunks = list(chat(client, prompt, max_tokens=30, stream=True, extra_body=knobs))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == llm_only.choices[0].message.content
        provenance = [c.model_extra["r2r"] for c in chunks if c.model_extra.get("r2r")]
        assert [p["token_id"] for p in provenance] == whole.model_extra["r2r"]["token_ids"]
        assert {p["source"] for p in provenance} <= {"slm", "llm", "fix"}  # the random policy draws anew each time
        assert whole.usage.model_extra["llm_tokens"] == sum(s != "slm" for s in whole.model_extra["r2r"]["sources"])


def test_n_choices_are_each_the_answer_of_their_own_seed_whole_and_streamed(client):
    """`n` choices decode side by side; with a seed, choice i is the answer a request with seed + i gets alone
    (vLLM's rule); usage sums them; a stream interleaves their chunks, each under its index."""
    settings = {"max_tokens": 16, "temperature": 0.9, "seed": 5, "extra_body": {"r2r_policy": "slm"}}
    whole = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": "Bonjour!"}],
                                           n=3, **settings)
    alone = [client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": "Bonjour!"}],
                                            **{**settings, "seed": 5 + i}) for i in range(3)]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [a.choices[0].message.content for a in alone]
    assert [c.model_extra["r2r"]["token_ids"] for c in whole.choices] == [a.model_extra["r2r"]["token_ids"]
                                                                          for a in alone]
    assert len({c.message.content for c in whole.choices}) > 1
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens
    streamed = list(client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": "Bonjour!"}],
                                                   n=3, stream=True, stream_options={"include_usage": True},
                                                   **settings))
    texts, reasons = {}, {}
    for chunk in streamed[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [reasons[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == whole.usage.completion_tokens
    completions = client.completions.create(model="tiny-r2r", prompt="def add(a, b):", n=2, **settings)
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.choices[0].text != completions.choices[1].text


def test_several_prompts_as_text_or_token_ids_each_get_n_choices(client, tokenizer):
    """/v1/completions takes OpenAI's four shapes of prompt; choice i * n + j is prompt i's j-th, the answer a
    request for that prompt with seed + j gets alone; usage counts each prompt once."""
    settings = {"max_tokens": 10, "temperature": 0.9, "seed": 7, "extra_body": {"r2r_policy": "slm"}}
    prompts = ["def add(a, b):", "Bonjour! Paris is"]
    both = client.completions.create(model="tiny-r2r", prompt=prompts, n=2, **settings)
    alone = [client.completions.create(model="tiny-r2r", prompt=p, **{**settings, "seed": 7 + j})
             for p in prompts for j in range(2)]
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    one = client.completions.create(model="tiny-r2r", prompt=ids[1], **settings)
    assert one.choices[0].text == alone[2].choices[0].text
    by_ids = client.completions.create(model="tiny-r2r", prompt=ids, **settings)
    assert [c.text for c in by_ids.choices] == [alone[0].choices[0].text, alone[2].choices[0].text]
    streamed = list(client.completions.create(model="tiny-r2r", prompt=prompts, n=2, stream=True, **settings))
    texts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in both.choices]


def test_logit_bias_min_p_and_vllms_stopping_fields_reach_the_engine_through_the_openai_client(client, slm, llm,
                                                                                              tokenizer):
    """OpenAI's logit_bias and vLLM's min_p, allowed_token_ids, stop_token_ids, min_tokens, ignore_eos and
    include_stop_str_in_output: each answer is the engine's own for the same settings."""
    from roads_to_rome.core.request import Request

    engine = Engine(slm, llm, tokenizer)
    prompt = "What is 48 / 2?"
    plain = chat(client, prompt, max_tokens=12, extra_body={"r2r_policy": "llm", "ignore_eos": True})
    ids = plain.model_extra["r2r"]["token_ids"]
    assert len(ids) == 12
    cases = [({"logit_bias": {str(ids[0]): -100, str(ids[2]): 5}}, {}),
             ({"temperature": 0.9, "seed": 3}, {"allowed_token_ids": sorted(set(ids[1:])), "min_p": 0.2}),
             ({}, {"stop_token_ids": [ids[5]], "include_stop_str_in_output": True}),
             ({}, {"stop_token_ids": [ids[5]], "min_tokens": 8})]
    for fields, extra in cases:
        answer = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=12, **{"temperature": 0, **fields},
                                                extra_body={"r2r_policy": "llm", **extra})
        settings = {**fields, **extra}
        if "logit_bias" in settings:
            settings["logit_bias"] = {int(t): b for t, b in settings["logit_bias"].items()}
        params = SamplingParams(max_new_tokens=12, **{k: tuple(v) if isinstance(v, list) else v
                                                      for k, v in settings.items()})
        own = engine.run([Request(engine.prompts.chat(prompt), params, force="llm")])[0]
        assert answer.model_extra["r2r"]["token_ids"] == own.token_ids, settings
        assert answer.choices[0].message.content == own.text and answer.choices[0].finish_reason == own.finish_reason
        assert own.token_ids != ids
    assert own.token_ids[:5] == ids[:5] and ids[5] not in own.token_ids[5:8]


def test_bad_words_never_come_whichever_model_writes_and_each_answer_is_the_engines_own(client, slm, llm, tokenizer):
    """vLLM's bad_words: each word as the tokenizer writes it at a text's start and after a space; the answer, R2R's
    under strict verification (its routed tokens and its fixes) and the LLM's alone, is the engine's own with those
    words banned, holds none of them, and differs from the plain one."""
    from roads_to_rome.core.request import Request
    from roads_to_rome.serving.adapter import bad_words

    engine = Engine(slm, llm, tokenizer)
    prompt = "What is 48 / 2?"
    plain = chat(client, prompt, max_tokens=16, extra_body={"r2r_policy": "llm", "ignore_eos": True})
    ids = plain.model_extra["r2r"]["token_ids"]
    words = [tokenizer.decode(ids[3:5]), tokenizer.decode(ids[8:9])]
    sequences = bad_words(words, tokenizer)
    holds = lambda out: any(tuple(out[i : i + len(w)]) == w for w in sequences for i in range(len(out)))  # noqa: E731
    assert holds(ids)
    for extra in ({"r2r_policy": "llm"}, {"r2r_verify": "strict", "r2r_threshold": 0.1}):
        answer = chat(client, prompt, max_tokens=16, extra_body={"ignore_eos": True, "bad_words": words, **extra})
        got = answer.model_extra["r2r"]["token_ids"]
        own = engine.run([Request(engine.prompts.chat(prompt), SamplingParams(
            max_new_tokens=16, ignore_eos=True, bad_words=sequences), force="llm")])[0]
        assert got == own.token_ids and not holds(got)
    refused = httpx.post(f"{client.base_url}chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "bad_words": ["  "]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words"


def test_continue_final_message_goes_on_writing_the_assistants_message(client, slm, llm, tokenizer):
    """vLLM's add_generation_prompt and continue_final_message: the prompt is the template's with the last (assistant)
    message left open, or with no turn opened; the answer is the engine's own from those tokens, with echo the
    message it goes on; what cannot be done is a 400 naming the field."""
    from roads_to_rome.core.request import Request

    engine = Engine(slm, llm, tokenizer)
    messages = [{"role": "user", "content": "What is 48 / 2?"}, {"role": "assistant", "content": "Let us see: 48"}]
    prefill = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(prefill).endswith("<|im_start|>assistant\nLet us see: 48")
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=False)
    assert tokenizer.decode(closed).endswith("Let us see: 48<|im_end|>\n")
    for options, prompt in (({"add_generation_prompt": False, "continue_final_message": True}, prefill),
                            ({"add_generation_prompt": False}, closed)):
        answer = client.chat.completions.create(model="tiny-r2r", messages=messages, temperature=0, max_tokens=12,
                                                extra_body={"r2r_policy": "llm", "ignore_eos": True, **options})
        own = engine.run([Request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), force="llm")])[0]
        assert answer.usage.prompt_tokens == len(prompt), options
        assert answer.model_extra["r2r"]["token_ids"] == own.token_ids and answer.choices[0].message.content == own.text
    # vLLM's chat echo: the content starts with the last message's, an assistant's, whole and streamed
    options = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    own = engine.run([Request(prefill, SamplingParams(max_new_tokens=12, ignore_eos=True), force="llm")])[0]
    kw = {"model": "tiny-r2r", "messages": messages, "temperature": 0, "max_tokens": 12,
          "extra_body": {"r2r_policy": "llm", "ignore_eos": True, **options}}
    echoed = client.chat.completions.create(**kw)
    assert echoed.choices[0].message.content == "Let us see: 48" + own.text
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let us see: 48" + own.text
    plain, asked = (client.chat.completions.create(model="tiny-r2r", messages=messages[:1], temperature=0,
                                                   max_tokens=4, extra_body={"r2r_policy": "llm", "echo": echo})
                    for echo in (False, True))
    assert asked.choices[0].message.content == plain.choices[0].message.content  # a user's message is not echoed
    url = f"{client.base_url}chat/completions"
    for sent, field in (({"messages": messages, "continue_final_message": True}, "add_generation_prompt"),
                        ({"messages": messages[:1], "continue_final_message": True, "add_generation_prompt": False},
                         "messages"),
                        ({"messages": [*messages[:1], {"role": "assistant", "content": ""}],
                          "continue_final_message": True, "add_generation_prompt": False}, "messages")):
        refused = httpx.post(url, json=sent)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert "continue_final_message" in refused.json()["error"]["message"]


def test_tokenize_and_detokenize_as_vllm_has_them(server, client, tokenizer):
    """vLLM's /tokenize (a text; or messages, as a chat request's prompt holds them) and /detokenize."""
    text = "Bonjour! What is 48 / 2?"
    out = httpx.post(server + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert out["tokens"] == tokenizer.encode(text) and out["count"] == len(out["tokens"])
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"]) and out["max_model_len"] == 256
    assert httpx.post(server + "/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "It is"}]
    for options in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        sent = messages if options else messages[:1]
        ids = httpx.post(server + "/tokenize", json={"model": "tiny-r2r", "messages": sent, **options}).json()["tokens"]
        assert ids == tokenizer.apply_chat_template(sent, tokenize=True, return_dict=False,
                                                    **(options or {"add_generation_prompt": True}))
        reply = client.chat.completions.create(model="tiny-r2r", messages=sent, max_tokens=1, extra_body=options)
        assert reply.usage.prompt_tokens == len(ids)  # the prompt a chat request holds
    for path, sent, status, param in (
            ("/tokenize", {"prompt": text, "chat_template": "{{ x }}"}, 400, "chat_template"),
            ("/tokenize", {"messages": messages, "continue_final_message": True}, 400, "add_generation_prompt"),
            ("/tokenize", {"messages": []}, 400, "messages"),
            ("/tokenize", {"prompt": text, "model": "other"}, 404, "model"),
            ("/detokenize", {"tokens": [len(tokenizer) + 5]}, 400, "tokens"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens.0")):
        refused = httpx.post(server + path, json=sent)
        assert refused.status_code == status and refused.json()["error"]["param"] == param, (sent, refused.text)


def test_reasoning_effort_reaches_the_chat_template(slm, llm, tokenizer):
    """OpenAI's chat `reasoning_effort` is the template's `reasoning_effort` (as the Responses API's
    `reasoning.effort`); one given in chat_template_kwargs wins."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %} effort={{ reasoning_effort | default('') }}"
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    app = create_app(engine, "tiny-r2r", Limits(max_batch=2, max_tokens=8, context_length=256),
                     trust_request_chat_template=True)
    sent = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template, "max_tokens": 1}
    with BackgroundServer(app) as srv:
        for extra, said in (({}, ""), ({"reasoning_effort": "high"}, "high"),
                            ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "minimal"}},
                             "minimal")):
            # (the first starts the process request templates run in: seconds on a loaded machine)
            reply = httpx.post(srv.url + "/v1/chat/completions", json={**sent, **extra}, timeout=60)
            assert reply.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(f"hi effort={said}")), extra
        response = httpx.post(srv.url + "/v1/responses", json={"input": "hi", "reasoning": {"effort": "medium"},
                                                               "chat_template": template, "max_output_tokens": 1},
                              timeout=60)
        assert response.json()["usage"]["input_tokens"] == len(tokenizer.encode("hi effort=medium")), response.text


def test_a_requests_chat_template_needs_a_server_that_trusts_them(server, slm, llm, tokenizer):
    """vLLM's `chat_template` on a chat request (and /tokenize): refused, naming the flag, unless the server was
    started with --trust-request-chat-template; then the prompt is the messages in that template."""
    template = "{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}\n{% endfor %}answer:"
    sent = {"messages": [{"role": "user", "content": "What is 48 / 2?"}], "chat_template": template, "max_tokens": 2}
    in_kwargs = {**sent, "chat_template": None, "chat_template_kwargs": {"chat_template": template}}
    for asked in (sent, in_kwargs):  # vLLM takes it from chat_template_kwargs too
        refused = httpx.post(server + "/v1/chat/completions", json=asked)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template", refused.text
        assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    app = create_app(engine, "tiny-r2r", Limits(max_batch=2, max_tokens=8, context_length=256),
                     trust_request_chat_template=True)
    expected = tokenizer.encode("user says What is 48 / 2?\nanswer:")
    with BackgroundServer(app) as srv:
        for asked in (sent, in_kwargs):
            # (the first starts the process request templates run in: seconds on a loaded machine)
            reply = httpx.post(srv.url + "/v1/chat/completions", json=asked, timeout=60)
            assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(expected), reply.text
        tokens = httpx.post(srv.url + "/tokenize", json={k: sent[k] for k in ("messages", "chat_template")})
        assert tokens.json()["tokens"] == expected
        plain = httpx.post(srv.url + "/tokenize", json={"messages": sent["messages"]}).json()["tokens"]
        assert plain == tokenizer.apply_chat_template(sent["messages"], add_generation_prompt=True, return_dict=False)
        broken = httpx.post(srv.url + "/v1/chat/completions", json={**sent, "chat_template": "{% if x %}"})
        assert broken.status_code == 400 and "not valid Jinja (line 1" in broken.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_penalties_reach_the_engine_through_the_openai_client(client):
    """presence_penalty and frequency_penalty (OpenAI's fields) and repetition_penalty (vLLM's) shape the answer:
    with strict verification it is the LLM's own penalised answer, which differs from its plain one."""
    penalties = {"presence_penalty": 0.8, "frequency_penalty": 0.5}
    extra = {"repetition_penalty": 1.4}
    for prompt in ("What is 48 / 2?", "Bonjour!"):
        plain = chat(client, prompt, max_tokens=30, extra_body={"r2r_policy": "llm"})
        llm_only = chat(client, prompt, max_tokens=30, **penalties, extra_body={"r2r_policy": "llm", **extra})
        strict = chat(client, prompt, max_tokens=30, **penalties,
                      extra_body={"r2r_verify": "strict", "r2r_threshold": 0.1, **extra})
        ids = llm_only.model_extra["r2r"]["token_ids"]
        assert ids != plain.model_extra["r2r"]["token_ids"]
        assert strict.model_extra["r2r"]["token_ids"] == ids


def test_structured_outputs_through_the_openai_client_are_the_engines_own_answers(client, slm, llm, tokenizer):
    """OpenAI's response_format (json_object, json_schema) and vLLM's structured_outputs (regex, choice, compact
    JSON, structural tags, also as its response_format): each answer, whole and streamed, is the engine's own under
    that format, and follows it."""
    from roads_to_rome.core.grammar import OutputFormat
    from roads_to_rome.core.request import Request

    engine = Engine(slm, llm, tokenizer)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    tag = {"triggers": ["e"], "structures": [{"begin": "e=", "schema": {"type": "integer"}, "end": ";"}]}
    tagged = {"type": "triggered_tags", "triggers": ["e"], "tags": [  # the same, in xgrammar's format form
        {"begin": "e=", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": ";"}]}
    cases = [({"response_format": {"type": "json_object"}}, OutputFormat("json_object")),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              OutputFormat.json_schema(schema)),
             ({"extra_body": {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}},
              OutputFormat.json_schema(schema, any_whitespace=False)),
             ({"extra_body": {"structured_outputs": {"regex": "[0-9]{2}-[a-z]{1,3}"}}},
              OutputFormat("regex", "[0-9]{2}-[a-z]{1,3}")),
             ({"extra_body": {"structured_outputs": {"structural_tag": json.dumps(tag)}}},
              OutputFormat("structural_tag", tag)),
             ({"response_format": {"type": "structural_tag", **tag}}, OutputFormat("structural_tag", tag)),
             ({"response_format": {"type": "structural_tag", "format": tagged}},
              OutputFormat("structural_tag", {"type": "structural_tag", "format": tagged})),
             ({"extra_body": {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": tagged}}}},
              OutputFormat("structural_tag", {"type": "structural_tag", "format": tagged})),
             ({"extra_body": {"structured_outputs": {"choice": ["red", "green"]}}},
              OutputFormat("choice", ["red", "green"]))]
    prompt = "What is 48 / 2?"
    for fields, fmt in cases:
        extra = {"r2r_policy": "llm", **fields.pop("extra_body", {})}
        answer = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=24, temperature=0, extra_body=extra, **fields)
        own = engine.run([Request(engine.prompts.chat(prompt), SamplingParams(max_new_tokens=24, output_format=fmt),
                                  force="llm")])[0]
        assert answer.model_extra["r2r"]["token_ids"] == own.token_ids, fields
        assert answer.choices[0].message.content == own.text
        streamed = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=24, temperature=0, extra_body=extra, stream=True,
                                                  **fields)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == own.text
    assert own.text in ("red", "green")
    compact = cases[2][1]
    text = engine.run([Request(engine.prompts.chat(prompt), SamplingParams(max_new_tokens=24, output_format=compact),
                               force="llm")])[0].text
    assert set(json.loads(text)) == {"ok", "n"}


def test_echo_starts_each_choices_text_with_its_prompt_whole_and_streamed(server, client, tokenizer):
    prompts = ["def add(a, b):", "Paris is"]
    plain = client.completions.create(model="tiny-r2r", prompt=prompts, max_tokens=6, temperature=0, n=2, seed=1,
                                      extra_body={"r2r_policy": "slm"})
    echoed = client.completions.create(model="tiny-r2r", prompt=prompts, max_tokens=6, temperature=0, n=2, seed=1,
                                       echo=True, extra_body={"r2r_policy": "slm"})
    heads = ["def add(a, b):"] * 2 + ["Paris is"] * 2
    assert [c.text for c in echoed.choices] == [h + c.text for h, c in zip(heads, plain.choices)]
    streamed = client.completions.create(model="tiny-r2r", prompt=prompts, max_tokens=6, temperature=0, n=2, seed=1,
                                         echo=True, stream=True, extra_body={"r2r_policy": "slm"})
    texts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in echoed.choices]
    ids = tokenizer.encode("Paris is")
    as_ids = client.completions.create(model="tiny-r2r", prompt=ids, max_tokens=6, temperature=0, echo=True,
                                       extra_body={"r2r_policy": "slm"})
    assert as_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[2].text
    streamed_logprobs = httpx.post(server + "/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1,
                                                                     "stream": True})
    assert streamed_logprobs.status_code == 400 and streamed_logprobs.json()["error"]["param"] == "stream"


def test_truncate_prompt_tokens_and_tokens_named_by_id(server, client, tokenizer):
    """vLLM's truncate_prompt_tokens (the prompt's last N tokens: the answer is that prompt's) and
    return_tokens_as_token_ids (log-probabilities name tokens `token_id:N`, text offsets still the text's)."""
    text = "Natalia sold clips to 48 of her friends in April."
    ids = tokenizer.encode(text)
    kw = {"model": "tiny-r2r", "max_tokens": 5, "temperature": 0}
    llm = {"r2r_policy": "llm"}  # (the server's random policy draws anew for each request)
    short = client.completions.create(prompt=ids[-4:], extra_body=llm, **kw)
    cut = client.completions.create(prompt=text, echo=True, extra_body={"truncate_prompt_tokens": 4, **llm}, **kw)
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == tokenizer.decode(ids[-4:]) + short.choices[0].text
    chat = [{"role": "user", "content": text}]
    whole = client.chat.completions.create(messages=chat, **kw)
    kept = client.chat.completions.create(messages=chat, extra_body={"truncate_prompt_tokens": 6}, **kw)
    assert kept.usage.prompt_tokens == 6 and whole.usage.prompt_tokens > 6
    everything = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": -1}, **kw)
    assert everything.usage.prompt_tokens == len(ids)  # (shorter than the server holds: all of it)
    refused = httpx.post(server + "/v1/completions", json={"prompt": text, "truncate_prompt_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
    named = client.completions.create(prompt=text, logprobs=2, echo=True,
                                      extra_body={"return_tokens_as_token_ids": True, **llm}, **kw)
    plain = client.completions.create(prompt=text, logprobs=2, echo=True, extra_body=llm, **kw)
    lp, plain_lp = named.choices[0].logprobs, plain.choices[0].logprobs
    every = ids + named.model_extra["r2r"]["token_ids"]
    assert lp.tokens == [f"token_id:{t}" for t in every] and lp.text_offset == plain_lp.text_offset
    assert all(key.startswith("token_id:") for top in lp.top_logprobs[1:] for key in top)
    chat_named = client.chat.completions.create(messages=chat, logprobs=True, top_logprobs=1,
                                                extra_body={"return_tokens_as_token_ids": True}, **kw)
    tokens = chat_named.model_extra["r2r"]["token_ids"]
    assert [e.token for e in chat_named.choices[0].logprobs.content] == [f"token_id:{t}" for t in tokens]


def test_a_suffix_asks_the_model_to_fill_in_the_middle(server, slm, llm, tokenizer):
    """The prompt and the suffix framed by the model's fill-in-the-middle tokens (three of the tiny vocabulary's ids
    stand in for them): the answer is the engine's own for that framing. A model without them refuses a suffix."""
    from roads_to_rome.core.request import Request

    no_fim = httpx.post(server + "/v1/completions", json={"prompt": "def f(", "suffix": "\n", "max_tokens": 4})
    assert no_fim.status_code == 400 and "no fill-in-the-middle tokens" in no_fim.json()["error"]["message"]
    engine = Engine(slm, llm, tokenizer)
    engine.prompts.fim_ids = (10, 11, 12)
    with BackgroundServer(create_app(engine, "tiny-r2r", Limits(max_tokens=64, context_length=256))) as fim:
        client = openai.OpenAI(base_url=fim.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model="tiny-r2r", prompt="def add(a, b):", suffix="\nprint(add(1, 2))",
                                           max_tokens=8, temperature=0, extra_body={"r2r_policy": "llm"})
        ids_prompt = httpx.post(fim.url + "/v1/completions", json={"prompt": [5, 6], "suffix": "x", "max_tokens": 2})
    framed = [10, *tokenizer.encode("def add(a, b):"), 11, *tokenizer.encode("\nprint(add(1, 2))"), 12]
    own = engine.run([Request(framed, SamplingParams(max_new_tokens=8), force="llm")])[0]
    assert answer.model_extra["r2r"]["token_ids"] == own.token_ids and answer.usage.prompt_tokens == len(framed)
    assert ids_prompt.status_code == 400 and ids_prompt.json()["error"]["param"] == "suffix"


def test_priority_orders_waiting_requests_on_a_server_that_schedules_by_it(server, slm, llm, tokenizer, monkeypatch):
    """vLLM's `priority` with `--scheduling-policy priority`: of the requests waiting for the one slot, the lowest
    priority goes first, whichever came first; a server scheduling first come first served refuses the field."""
    refused = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": -1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    read = slm._read

    def slow(*args, **kwargs):  # so that the first request holds the slot until its client hangs up
        time.sleep(0.02)
        return read(*args, **kwargs)

    monkeypatch.setattr(slm, "_read", slow)
    finished, count_step = [], Metrics.step

    def step(self, event, *args):  # the order the engine finishes requests in (its clients may hear it in another)
        if event.finished:
            finished.append(event.sequence.request.priority)
        return count_step(self, event, *args)

    monkeypatch.setattr(Metrics, "step", step)
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    app = create_app(engine, "tiny-r2r", Limits(max_batch=1, max_tokens=480, context_length=512),
                     scheduling=dataclasses.replace(SERVER_SCHEDULING, by_priority=True))
    with BackgroundServer(app) as srv:

        def complete(priority):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": f"priority {priority}", "max_tokens": 2, "priority": priority})
            assert r.status_code == 200, r.text

        body = {"prompt": "hold the slot", "max_tokens": 480, "ignore_eos": True, "stream": True, "priority": -10}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body) as running:
                lines = running.iter_lines()
                next(lines)  # it holds the slot; then the others queue, the least urgent first
                waiting = []
                for priority in (10, 3, -5):
                    waiting.append(pool.submit(complete, priority))
                    for _ in range(200):
                        if httpx.get(srv.url + "/health").json()["waiting"] == len(waiting):
                            break
                assert httpx.get(srv.url + "/health").json()["waiting"] == 3
            for future in waiting:  # the stream hung up: its slot goes to the waiting ones in turn
                future.result()
        assert finished == [-5, 3, 10]


def test_a_more_urgent_request_preempts_a_stream_which_then_goes_on_where_it_was(slm, llm, tokenizer, monkeypatch):
    """Scheduling by priority with one slot: a stream of priority 5 is preempted for a request of priority -1, which
    answers while the stream waits; the stream then goes on where it was, its text as it is alone, each token shown
    once. /metrics counts the preemption."""
    read = slm._read

    def slow(*args, **kwargs):  # so that the stream is still running when the urgent request comes
        time.sleep(0.02)
        return read(*args, **kwargs)

    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    app = create_app(engine, "tiny-r2r", Limits(max_batch=1, max_tokens=200, context_length=256),
                     scheduling=dataclasses.replace(SERVER_SCHEDULING, by_priority=True))
    with BackgroundServer(app) as srv:
        body = {"prompt": "A story about a lighthouse", "max_tokens": 120, "ignore_eos": True, "temperature": 0,
                "r2r_policy": "slm"}
        alone = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        monkeypatch.setattr(slm, "_read", slow)
        shown = []
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True, "priority": 5},
                          timeout=60) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: {"):
                    continue
                shown.append(json.loads(line[6:])["choices"][0]["text"])
                if len(shown) == 3:
                    urgent = httpx.post(srv.url + "/v1/completions", timeout=60,
                                        json={"prompt": "Quick!", "max_tokens": 4, "priority": -1})
                    assert urgent.status_code == 200, urgent.text
                    load = httpx.get(srv.url + "/health").json()
                    assert load["running"] + load["waiting"] == 1  # the stream is not done: the urgent one went first
        assert "".join(shown) == alone  # it went on from where it was
        metrics = httpx.get(srv.url + "/metrics").text
        assert "r2r:num_preemptions_total 1.0" in metrics


def test_return_token_ids_gives_the_prompts_and_each_choices_token_ids_whole_and_streamed(server, client, tokenizer):
    """vLLM's `return_token_ids`: a chat reply's prompt ids beside its choices, a completion choice's in it, each
    choice's own ids; streamed, the prompt's in a choice's first chunk and each chunk's token. Without it, neither."""
    messages = [{"role": "user", "content": "What is 48 / 2?"}]
    prompt = httpx.post(server + "/tokenize", json={"messages": messages}).json()["tokens"]
    extra = {"return_token_ids": True, "r2r_policy": "slm"}
    whole = client.chat.completions.create(model="tiny-r2r", messages=messages, max_tokens=5, temperature=0, n=2,
                                           extra_body=extra)
    assert whole.model_extra["prompt_token_ids"] == prompt
    for choice in whole.choices:
        assert choice.model_extra["token_ids"] == choice.model_extra["r2r"]["token_ids"] and choice.model_extra[
            "token_ids"]
    chunks = list(client.chat.completions.create(model="tiny-r2r", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body=extra))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert not any("prompt_token_ids" in (c.model_extra or {}) for c in chunks[1:])
    streamed = [t for c in chunks for choice in c.choices for t in choice.model_extra.get("token_ids", [])]
    assert streamed == whole.choices[0].model_extra["token_ids"]
    prompts = ["Count to five.", "def add(a, b):"]
    done = client.completions.create(model="tiny-r2r", prompt=prompts, max_tokens=4, temperature=0, extra_body=extra)
    for choice, text in zip(done.choices, prompts):
        assert choice.model_extra["prompt_token_ids"] == tokenizer.encode(text)
        assert choice.model_extra["token_ids"] == choice.model_extra["r2r"]["token_ids"]
    parts = list(client.completions.create(model="tiny-r2r", prompt=prompts[0], max_tokens=4, temperature=0,
                                           stream=True, extra_body=extra))
    assert parts[0].choices[0].model_extra["prompt_token_ids"] == tokenizer.encode(prompts[0])
    assert [t for p in parts for c in p.choices for t in c.model_extra.get("token_ids", [])] == \
        done.choices[0].model_extra["token_ids"]
    plain = client.chat.completions.create(model="tiny-r2r", messages=messages, max_tokens=2, temperature=0)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra
