"""A server you can put on a network: no request can stall the rest (stop lists, tokenizing, slow bodies, connections,
whole answers' deadline), a supervised engine thread, what /health says without the key, fields that would change the
answer refused by name, logprobs from the model that wrote each token, and one table of per-request counters."""

import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from helpers import until

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.request import COUNTERS
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app, run

CHAT = "/v1/chat/completions"
KEY = "sesame"


@pytest.fixture(scope="module")
def engine(slm, llm, tokenizer):
    return Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=0))


def limits(**kw) -> Limits:
    return Limits(**{"max_batch": 4, "max_tokens": 400, "context_length": 512, **kw})


def body(content="What is 48 / 2?", **kw):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **kw}


def post(url, payload, **kw):
    return httpx.post(url + CHAT, json=payload, timeout=60, **kw)


def normal_request_answers(url, within: float = 10.0, **kw) -> None:
    start = time.monotonic()
    response = post(url, body(max_tokens=10), **kw)
    assert response.status_code == 200, response.text
    assert time.monotonic() - start < within


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, "tiny-r2r", limits(max_tokenizing=1, max_head_seconds=1.5, max_body_seconds=1.5,
                                                max_request_seconds=2, max_connections=12))
    with BackgroundServer(app) as srv:
        yield srv.url


@pytest.mark.parametrize("stop,why", [(["a", "b", "c", "d", "e"], "at most 4"), (["x" * 257], "at most 256")])
def test_stop_lists_past_the_limits_are_400s_before_any_tokenizing(server, engine, monkeypatch, stop, why):
    tokenized = []
    monkeypatch.setattr(engine.prompts, "messages", lambda m, *_, **__: tokenized.append(m) or [1])
    response = post(server, body(stop=stop))
    assert response.status_code == 400 and why in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "stop" and not tokenized


def test_a_flood_of_stop_lists_beside_a_normal_request(server):
    def flood_one():
        for _ in range(5):
            assert post(server, body(stop=["y" * 256] * 200)).status_code == 400

    flood = [threading.Thread(target=flood_one) for _ in range(8)]  # below the connection cap (12)
    for t in flood:
        t.start()
    normal_request_answers(server)
    for t in flood:
        t.join()


def test_a_tokenizer_flood_gets_429_before_it_queues_and_a_short_prompt_still_answers(server, engine, monkeypatch):
    encode = engine.prompts.messages

    def slow(messages, *args, **kwargs):  # a long prompt that takes a while to tokenize
        if len(messages[0]["content"]) > 16384:
            time.sleep(1.0)
        return encode(messages, *args, **kwargs)

    monkeypatch.setattr(engine.prompts, "messages", slow)
    results = []
    flood = [threading.Thread(target=lambda: results.append(post(server, body("48 / 2 " * 4000))))
             for _ in range(6)]
    for t in flood:
        t.start()
    time.sleep(0.2)
    normal_request_answers(server, within=3.0)
    for t in flood:
        t.join()
    codes = sorted(r.status_code for r in results)
    busy = [r for r in results if r.status_code == 429]
    assert busy and all(r.json()["error"]["code"] == "tokenizer_busy" for r in busy), codes
    assert set(codes) <= {400, 429}  # the ones tokenized are too long for the context: refused, never queued


WHOLE_HEAD = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              "Content-Length: 1000\r\n\r\n")
HALF_HEAD = f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nX-Slow: "


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


def trickle(url: str, seconds: float, begun: str = WHOLE_HEAD) -> tuple[float, bytes]:
    """Send `begun`, then one byte every 0.2 s (of the body after a whole head, of a header after half of one): when
    the server answers, and what."""
    start = time.monotonic()
    with connect(url) as s:
        s.sendall(begun.encode())
        s.settimeout(0.2)
        answer = b""
        while time.monotonic() - start < seconds:
            try:
                s.sendall(b" " if begun.endswith("\r\n\r\n") else b"a")
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
                if b"\r\n\r\n" in answer:
                    break
            except TimeoutError:
                continue
            except OSError:
                break
    return time.monotonic() - start, answer


def test_a_client_trickling_its_body_is_cut_off_and_others_answer_meanwhile(server):
    outcome = []
    t = threading.Thread(target=lambda: outcome.append(trickle(server, 30)))
    t.start()
    normal_request_answers(server)
    t.join()
    took, answer = outcome[0]
    assert took < 5 and b" 408 " in answer.split(b"\r\n")[0], (took, answer[:200])


def test_a_client_trickling_its_headers_is_cut_off_and_others_answer_meanwhile(server):
    outcome = []
    t = threading.Thread(target=lambda: outcome.append(trickle(server, 30, HALF_HEAD)))
    t.start()
    normal_request_answers(server)
    t.join()
    took, answer = outcome[0]
    assert took < 5 and b" 408 " in answer.split(b"\r\n")[0], (took, answer[:200])
    assert b"--max-head-seconds" in answer and b'"code":"request_timeout"' in answer


def test_the_next_request_on_a_kept_connection_has_the_same_deadline(server):
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        s.settimeout(5)
        answer = b""
        while b'"status"' not in answer:
            answer += s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200 ")
        s.sendall(HALF_HEAD.encode())
        s.settimeout(0.2)
        start, answer = time.monotonic(), b""
        while time.monotonic() - start < 30 and b"\r\n\r\n" not in answer:
            try:
                s.sendall(b"a")
                answer += s.recv(4096)
            except TimeoutError:
                continue
        assert time.monotonic() - start < 5 and answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_a_connection_that_says_nothing_is_closed_without_a_word(server):
    with connect(server) as s:
        s.settimeout(10)
        start = time.monotonic()
        assert s.recv(4096) == b""
        assert 1 < time.monotonic() - start < 5


def test_connections_past_twice_the_cap_are_closed_as_they_open(engine):
    app = create_app(engine, "tiny-r2r", limits(max_connections=2, max_head_seconds=30))
    with BackgroundServer(app) as srv:
        server_state = srv.server.server_state
        held = [connect(srv.url) for _ in range(4)]
        until(lambda: len(server_state.connections) == 4, "the server holds four connections")
        with connect(srv.url) as fifth:
            fifth.settimeout(10)
            try:
                assert fifth.recv(4096) == b""
            except ConnectionResetError:
                pass
        assert len(server_state.connections) == 4
        for s in held:
            s.close()
        until(lambda: not server_state.connections, "the server lets the held connections go")
        assert httpx.get(srv.url + "/health").status_code == 200


def test_requests_past_the_connection_cap_get_429_and_health_still_answers(engine):
    app = create_app(engine, "tiny-r2r", limits(max_connections=2, max_body_seconds=5))
    with BackgroundServer(app) as srv:
        holders = [threading.Thread(target=trickle, args=(srv.url, 3)) for _ in range(2)]
        for t in holders:
            t.start()
        until(lambda: post(srv.url, body()).status_code == 429, "the third request is refused")
        refused = post(srv.url, body())
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_connections"
        assert httpx.get(srv.url + "/health").status_code == 200
        for t in holders:
            t.join()
        normal_request_answers(srv.url)


def test_a_whole_answer_past_its_deadline_is_408_and_frees_its_slot(server, engine, monkeypatch):
    slow = engine.slm.forward
    monkeypatch.setattr(engine.slm, "forward", lambda *a: (time.sleep(0.05), slow(*a))[1])
    for n in (1, 2):
        response = post(server, body(max_tokens=400, r2r_policy="slm", n=n))
        assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"
    monkeypatch.undo()
    until(lambda: httpx.get(server + "/health").json()["running"] == 0, "the cut request leaves the batch")


@pytest.mark.parametrize("field,value", [("best_of", 2), ("functions", [{"name": "f"}]),
                                         ("guided_json", {"type": "object"}), ("suffix", "x"),
                                         ("use_beam_search", True), ("logits_processors", ["a.b"]),
                                         ("web_search_options", {}), ("audio", {"voice": "alloy", "format": "wav"}),
                                         ("modalities", ["text", "audio"])])
def test_fields_that_would_change_the_answer_are_400s_naming_them(server, field, value):
    response = post(server, body(**{field: value}))
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    neutral = post(server, body(max_tokens=1, modalities=["text"], web_search_options=None))
    assert neutral.status_code == 200, neutral.text


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01),
                                         ("repetition_penalty", 0), ("repetition_penalty", 0.001),
                                         ("repetition_penalty", 101), ("min_p", 1.5), ("min_tokens", -1),
                                         ("min_tokens", 65), ("stop_token_ids", [-1]), ("allowed_token_ids", [1.5]),
                                         ("n", 0), ("n", 69)])
def test_sampling_settings_out_of_range_are_400s_naming_them(server, field, value):
    response = post(server, body(max_tokens=64, **{field: value}))
    assert response.status_code == 400 and response.json()["error"]["param"].startswith(field), response.text


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": [{"begin": "<g>"}]}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "any_text", "excluded_str": ["x"]}}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "any_text"}, "triggers": ["<f"]}},
     "response_format"),
    ({"structured_outputs": {"json_object": True, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": "[ "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+"}, "allowed_token_ids": [5]}, None),
])
def test_a_structured_output_that_cannot_be_followed_is_a_400_naming_the_field(server, fields, param):
    response = post(server, body(**fields))
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("value", [{"5": 101}, {"five": 1}, {"5": "a lot"}, {"-3": 1}])
def test_a_bad_logit_bias_is_a_400_naming_it(server, value):
    response = post(server, body(logit_bias=value))
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("logit_bias"), response.text


@pytest.mark.parametrize("prompt", [[5, 100000], [[5, 6], [7, 100000]]])
def test_a_prompt_of_token_ids_beyond_the_vocabulary_is_a_400(server, prompt):
    response = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60)
    assert response.status_code == 400 and "the prompt holds token 100000" in response.json()["error"]["message"]


@pytest.mark.parametrize("prompt, param, said", [([1, 2, -5], "prompt.2", "greater than or equal to 0"),
                                                  ([[1, -2]], "prompt.0.1", "greater than or equal to 0"),
                                                  ([], "prompt", "at least 1 item"),
                                                  ([[]], "prompt.0", "at least 1 item"),
                                                  ([1.5], "prompt.0", "fractional part")])
def test_a_bad_prompt_is_refused_for_what_it_meant_to_be_not_the_unions_first_shape(server, prompt, param, said):
    """A prompt is text, texts, token ids or lists of them: the error is of the shape it nearly is."""
    response = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and said in error["message"], response.text


@pytest.mark.parametrize("field,value", [("logit_bias", {"100000": 1}), ("stop_token_ids", [100000]),
                                         ("allowed_token_ids", [3, 100000])])
def test_token_ids_beyond_the_vocabulary_are_400s_naming_the_field(server, field, value):
    response = post(server, body(**{field: value}))
    assert response.status_code == 400 and f"{field} names token 100000" in response.json()["error"]["message"]


@pytest.mark.parametrize("field,value", [("n", 1), ("tools", []), ("presence_penalty", 0), ("logit_bias", {}),
                                         ("response_format", {"type": "text"}), ("user", "me"), ("min_p", 0),
                                         ("chat_template_kwargs", {}), ("skip_special_tokens", True)])
def test_neutral_values_of_those_fields_are_accepted(server, field, value):
    assert post(server, body(**{field: value})).status_code == 200


def test_health_says_only_the_status_without_the_key(engine):
    app = create_app(engine, "tiny-r2r", limits(), api_key=KEY)
    with BackgroundServer(app) as srv:
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        full = httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert full["status"] == "ok" and full["model"] == "tiny-r2r" and "running" in full
    with pytest.raises(R2RError, match="empty"):
        create_app(engine, "tiny-r2r", limits(), api_key=" ")


def test_an_engine_thread_that_dies_fails_requests_in_flight_and_health_says_failed(engine, monkeypatch):
    app = create_app(engine, "tiny-r2r", limits())
    thread = app.state.r2r.engine_thread
    served = threading.Thread(target=lambda: result.append(run(app, "127.0.0.1", port)), daemon=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, result = f"http://127.0.0.1:{port}", []
    calls = {"n": 0}
    advance = thread.scheduler.advance

    def fails_on_the_third_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a bug outside the scheduler's own error handling")
        return advance()

    monkeypatch.setattr(thread.scheduler, "advance", fails_on_the_third_step)
    served.start()
    until(lambda: _up(url), "the server starts")
    response = post(url, body(max_tokens=50), headers={"X-Request-Id": "dying-1"})
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_failed", response.text
    assert "RuntimeError" not in response.text and "bug" not in response.text
    assert "under request dying-1" in response.json()["error"]["message"]
    served.join(10)
    assert result == [1], "run() returns 1 once the engine's thread has failed, for a supervisor to restart"


def _up(url) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_health_is_503_failed_and_new_requests_503_once_the_engine_failed(engine, monkeypatch):
    app = create_app(engine, "tiny-r2r", limits())
    thread = app.state.r2r.engine_thread
    monkeypatch.setattr(thread.scheduler, "advance", lambda: 1 / 0)
    with BackgroundServer(app) as srv:
        failed = post(srv.url, body())
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_failed"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "failed"}
        again = post(srv.url, body())
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_failed"


# Log-probabilities, and the counters.

def expected_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


def test_each_tokens_logprob_comes_from_the_model_that_wrote_it(engine, slm, llm):
    app = create_app(engine, "tiny-r2r", limits())
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": "48 / 2?"}],
                                               max_tokens=24, temperature=0, logprobs=True, top_logprobs=3)
    r2r = reply.model_extra["r2r"]
    entries = reply.choices[0].logprobs.content
    assert len(entries) == len(r2r["token_ids"]) == reply.usage.completion_tokens
    assert {"slm", "llm"} <= set(r2r["sources"]) | {"llm"} and "slm" in r2r["sources"]
    prompt = engine.prompts.messages([{"role": "user", "content": "48 / 2?"}])
    for k, (token, source, entry) in enumerate(zip(r2r["token_ids"], r2r["sources"], entries)):
        model = slm.model if source == "slm" else llm.model
        want = expected_logprobs(model, prompt + r2r["token_ids"][:k])
        assert entry.logprob == pytest.approx(float(want[token]), abs=1e-3), (k, source)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(want.topk(3).values.tolist(), abs=1e-3)


def test_logprobs_streamed_and_on_completions_through_the_openai_client(engine):
    app = create_app(engine, "tiny-r2r", limits())
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        same = {"r2r_policy": "llm"}  # the random policy's draws differ from one request to the next
        whole = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": "Paris?"}],
                                               max_tokens=16, temperature=0, logprobs=True, top_logprobs=2,
                                               extra_body=same)
        streamed = []
        for chunk in client.chat.completions.create(model="tiny-r2r", stream=True, max_tokens=16, temperature=0,
                                                    messages=[{"role": "user", "content": "Paris?"}],
                                                    logprobs=True, top_logprobs=2, extra_body=same):
            if chunk.choices and chunk.choices[0].logprobs:
                streamed += chunk.choices[0].logprobs.content
        assert [(e.token, e.logprob) for e in streamed] == \
            [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
        assert all(len(e.top_logprobs) == 2 for e in streamed)
        completion = client.completions.create(model="tiny-r2r", prompt="def add(a, b):", max_tokens=12,
                                               temperature=0, logprobs=4, extra_body=same)
        lp = completion.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == completion.usage.completion_tokens
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs) and lp.text_offset[0] == 0
        offsets = []
        for chunk in client.completions.create(model="tiny-r2r", prompt="def add(a, b):", max_tokens=12,
                                               temperature=0, logprobs=4, stream=True, extra_body=same):
            if chunk.choices and chunk.choices[0].logprobs:
                offsets += chunk.choices[0].logprobs.text_offset
        assert offsets == lp.text_offset  # a stream's offsets run on from chunk to chunk, as the whole answer's
        plain = client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": "Paris?"}],
                                               max_tokens=4)
        assert plain.choices[0].logprobs is None
        bad = httpx.post(srv.url + CHAT, json=body(top_logprobs=2))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
        assert httpx.post(srv.url + CHAT, json=body(logprobs=True, top_logprobs=21)).status_code == 400


def test_every_counter_shows_in_the_reply_the_usage_and_the_metrics(engine):
    app = create_app(engine, "tiny-r2r", limits())
    with BackgroundServer(app) as srv:
        reply = post(srv.url, body(max_tokens=24)).json()
        metrics = httpx.get(srv.url + "/metrics").text
    for name in COUNTERS:
        assert name in reply["r2r"] and name in reply["usage"], name
    assert reply["r2r"]["deferred_kept"] == reply["usage"]["deferred_kept"]
    assert "r2r:deferred_kept_total" in metrics and "r2r:llm_call_rows_total" in metrics
