"""Every request on its own (issue "Every request on its own"): a row whose own settings fail it ends alone, with an
error that names them, while the rows beside it go on token for token as they would have without it; what the door
can see is a 400."""

import asyncio
import functools
import json
import re
import threading
import time

import httpx
import pytest
import torch
from bystander import Stream, during, slowed
from conftest import assert_idle_soon
from helpers import encode

from roads_to_rome.core.chat_template import encode_messages
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.grammar import FormatTooComplex, OutputFormat, grammar_tokenizer
from roads_to_rome.core.request import Failure, Request
from roads_to_rome.core.sampling import LogitRules, NothingToWrite, SamplingParams, adjust_logits
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.guard import TemplateLane
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app

CHAT = "/v1/chat/completions"


# A format that compiles but that llguidance cannot follow past its first token: after "w" an Earley row holds every
# alternative, past its limit of 2,000 items a row.
OVER_BRANCHING = "root ::= " + " | ".join(f'"w{i}"' for i in range(2001))


def only_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {ids} in the tiny tokenizer"
    return ids[0]


def test_settings_that_leave_nothing_say_which_they_are(tokenizer):
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=4, allowed_token_ids=(eos,), min_tokens=2)
    rules = LogitRules.of(params, [1, 2], [eos])
    with pytest.raises(NothingToWrite, match="allowed_token_ids.*min_tokens=2"):
        adjust_logits(torch.zeros(len(tokenizer)), rules, [])
    assert adjust_logits(torch.zeros(len(tokenizer)), rules, [5, 6])[eos] == 0  # long enough: the end is allowed
    banned = SamplingParams(max_new_tokens=4, allowed_token_ids=(7, 8), bad_words=((3, 7), (8,)))
    rules = LogitRules.of(banned, [1], [eos])
    assert adjust_logits(torch.zeros(len(tokenizer)), rules, [1, 2])[7] == 0  # (3, 7) bans 7 only after a 3
    with pytest.raises(NothingToWrite, match="allowed_token_ids allows 2.*bad_words bans 2"):
        adjust_logits(torch.zeros(len(tokenizer)), rules, [1, 3])


def test_contradictions_visible_at_the_door_are_refused_there(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    eos, prompt = tokenizer.eos_token_id, encode(engine)[0]
    cases = [(SamplingParams(allowed_token_ids=(eos,), min_tokens=2), "only tokens that end the output"),
             (SamplingParams(allowed_token_ids=(7, 8), bad_words=((7,), (8,))), "bans every token allowed"),
             (SamplingParams(bad_words=tuple((t,) for t in range(len(tokenizer)))), "every token of the vocabulary")]
    for params, said in cases:
        with pytest.raises(R2RError, match=said):
            engine.sequence(Request(prompt, params))
    engine.sequence(Request(prompt, SamplingParams(allowed_token_ids=(eos, 7), min_tokens=2)))  # 7 can be written


def test_a_row_its_settings_leave_nothing_fails_alone(kind_pair, tokenizer):
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    prompts = encode(engine)[:2]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    # (strict verification: each row's output is the LLM's greedy one, whichever rows random routing sends it)
    alone = engine.run([Request(p, greedy, verify="strict") for p in prompts])
    a = only_token(tokenizer, "a")
    # A format whose only answer bad_words bans: the door cannot see it; the first step can.
    doomed = Request(prompts[1], SamplingParams(max_new_tokens=12, output_format=OutputFormat("choice", ["a"]),
                                                bad_words=((a,),)))
    scheduler = engine.scheduler(max_batch=4)
    # A format the door compiles, and whose walk meets llguidance's limits after its first token.
    unfollowable = Request(prompts[0], SamplingParams(max_new_tokens=12,
                                                      output_format=OutputFormat("grammar", OVER_BRANCHING)))
    sequences = [engine.sequence(Request(p, greedy, verify="strict"), i) for i, p in enumerate(prompts)]
    sequences[1:1] = [engine.sequence(doomed, 2), engine.sequence(unfollowable, 3)]
    for s in sequences:
        scheduler.add(s)
    failures = []
    while not scheduler.idle:
        failures += [e for e in scheduler.turn() if isinstance(e, Failure)]
    assert [f.sequence for f in failures] == sequences[1:3]
    assert isinstance(failures[0].error, NothingToWrite)
    assert "bad_words" in str(failures[0].error) and "choice structured output" in str(failures[0].error)
    assert isinstance(failures[1].error, FormatTooComplex), failures[1].error
    assert re.fullmatch(r"the grammar structured output could not be followed at output token 0 \(token id \d+\): "
                        r"Parser Error: Current row has \d+ items; max is 2000;.*; simplify it", str(failures[1].error))
    assert [sequences[0].generation.token_ids, sequences[3].generation.token_ids] == [g.token_ids for g in alone]
    assert scheduler.kv_in_use == 0


@pytest.fixture(scope="module")
def kind_server(kind_pair, tokenizer):
    slm, llm = kind_pair
    app = create_app(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny-r2r",
                     Limits(max_batch=4, max_queue=16, max_tokens=400, context_length=512))
    with BackgroundServer(app) as srv:
        yield srv.url


def chat(content="What is 48 / 2?", **kw):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **kw}


def test_beside_two_streams_each_bad_request_gets_its_own_answer(kind, kind_server, tokenizer):
    url, eos, a = kind_server, tokenizer.eos_token_id, only_token(tokenizer, "a")
    # (strict verification: each stream writes the LLM's greedy text, whichever rows random routing sends it)
    long_ones = [chat("Tell me a story.", max_tokens=200, ignore_eos=True, r2r_verify="strict"),
                 chat("Count to ten.", max_tokens=150, ignore_eos=True, stop=["zzzz"], r2r_verify="strict")]
    expected = [httpx.post(url + CHAT, json=p, timeout=120).json()["choices"][0]["message"]["content"]
                for p in long_ones]
    streams = [Stream(url, p) for p in long_ones]
    refused = httpx.post(url + CHAT, json=chat(allowed_token_ids=[eos], min_tokens=2), timeout=60)
    assert refused.status_code == 400 and "min_tokens" in refused.json()["error"]["message"], refused.text
    doomed = chat(structured_outputs={"choice": ["a"]}, bad_words=["a"])
    whole = httpx.post(url + CHAT, json=doomed, timeout=60)
    assert whole.status_code == 400, whole.text
    assert "bad_words" in whole.json()["error"]["message"] and "loosen" in whole.json()["error"]["message"]
    streamed = Stream(url, doomed)
    streamed.thread.join(60)
    assert streamed.error is not None and "bad_words" in streamed.error["message"]
    assert (streamed.error["type"], streamed.error["code"]) == ("invalid_request_error", "nothing_to_write")
    unfollowable = chat(structured_outputs={"grammar": OVER_BRANCHING})
    whole = httpx.post(url + CHAT, json=unfollowable, timeout=60)
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "format_too_complex", whole.text
    assert "could not be followed" in whole.json()["error"]["message"] and len(whole.text) < 1000
    for stream, text in zip(streams, expected):
        stream.thread.join(120)
        assert stream.error is None and stream.finish_reason == "length", stream.error
        # (llama.cpp reads a batch with other kernels than one row: near-ties of the random pair may differ there)
        assert stream.text == text or kind == "llamacpp"
    assert a < len(tokenizer)
    assert_idle_soon(url)


def big_schema(kib: int) -> dict:
    """A JSON schema of about `kib` KiB: many objects, each with a few typed fields."""
    field = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "count": {"type": "integer"},
                                              "kind": {"enum": ["x", "y", "z"]}}, "required": ["name"]}
    size = len(json.dumps({"field_00000": field}))
    properties = {f"field_{i:05d}": field for i in range(kib * 1024 // size)}
    return {"type": "object", "properties": properties, "required": list(properties)[:50]}


def grammar_tokenizer_built_by(build, monkeypatch) -> None:
    """Engines build the tokenizer as structured outputs read it with `build(engine)`, once each, as they do."""
    built_once = functools.cached_property(build)
    built_once.__set_name__(Engine, "grammar_tokenizer")
    monkeypatch.setattr(Engine, "grammar_tokenizer", built_once)


def test_a_schema_past_the_compile_limit_is_a_400_naming_it_and_the_compile_lane_stays_bounded(slm, llm, tokenizer,
                                                                                                 monkeypatch):
    def slow_to_build(engine):  # (as a 150k vocabulary is: seconds, past the compile limit)
        time.sleep(1.0)
        return grammar_tokenizer(engine.tokenizer, engine.writer.vocab_size, engine.eos_ids)

    grammar_tokenizer_built_by(slow_to_build, monkeypatch)
    app = create_app(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny-r2r",
                     Limits(max_batch=4, max_tokenizing=1, max_compile_seconds=0.25))
    big = chat("Fill it in.", response_format={"type": "json_schema",
                                                "json_schema": {"name": "big", "schema": big_schema(500)}})
    small = chat("Fill it in.", response_format={"type": "json_schema", "json_schema": {
        "name": "small", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
    with BackgroundServer(app) as srv:
        # The first schema's time does not count what every compile needs, built once for the server
        first = httpx.post(srv.url + CHAT, json=small, timeout=60)
        assert first.status_code == 200, first.text
        late = httpx.post(srv.url + CHAT, json=big, timeout=60)
        assert late.status_code == 400, late.text
        error = late.json()["error"]
        assert error["code"] == "format_too_complex" and error["param"] == "response_format.json_schema.schema"
        assert "--max-compile-seconds" in error["message"]
        # (the late compile goes on in its lane, seconds for 500 KiB: the lane's one place is taken)
        busy = httpx.post(srv.url + CHAT, json=big, timeout=60)
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "compiler_busy", busy.text
        assert httpx.post(srv.url + CHAT, json=chat(), timeout=60).status_code == 200
        for _ in range(600):  # once the lane is free, a small schema compiles within the limit
            answer = httpx.post(srv.url + CHAT, json=small, timeout=60)
            if answer.status_code != 429:
                break
            time.sleep(0.1)
        assert answer.status_code == 200, answer.text
        assert_idle_soon(srv.url)


def test_a_tokenizer_structured_outputs_cannot_read_is_a_400_each_time_and_holds_no_place_in_the_lane(
        slm, llm, tokenizer, monkeypatch):
    def unreadable(engine):
        raise R2RError("structured outputs need a fast (Rust) tokenizer; this one is SlowTokenizer")

    grammar_tokenizer_built_by(unreadable, monkeypatch)
    app = create_app(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny-r2r",
                     Limits(max_batch=4, max_tokenizing=1))
    structured = chat(response_format={"type": "json_object"})
    with BackgroundServer(app) as srv:
        for _ in range(3):  # (with one place in the lane, a place kept by a failure would make the next a 429)
            refused = httpx.post(srv.url + CHAT, json=structured, timeout=60)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "response_format" and "fast (Rust)" in refused.text
        assert httpx.post(srv.url + CHAT, json=chat(), timeout=60).status_code == 200
        assert_idle_soon(srv.url)


@pytest.fixture
def loaded_server(slm, llm, tokenizer, monkeypatch):
    """A server whose models each take 5 ms more per forward: a bystander stream that lasts seconds. Its compile
    limit is past any processor's time for a large schema while the bystander shares the cores (the tests here ask
    whether a compile holds anyone up, not how long it takes; the limit's own refusal is tested below)."""
    slowed((slm, llm), monkeypatch)
    app = create_app(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny-r2r",
                     Limits(max_batch=8, max_queue=32, max_tokens=480, max_compile_seconds=100))
    with BackgroundServer(app) as srv:
        yield srv.url


@pytest.mark.timed  # (a bystander's rate, measured: with the cores to itself)
def test_a_large_schema_with_many_choices_holds_up_neither_health_nor_a_stream(loaded_server):
    url, schema = loaded_server, big_schema(500)
    payload = chat("Fill it in.", n=16, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "big", "schema": schema}})
    assert 450 * 1024 < len(json.dumps(payload)) < 1 << 20
    before, while_sent, health_s, response = during(url, lambda: httpx.post(url + CHAT, json=payload, timeout=120))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 16
    print(f"500 KiB schema, n=16: bystander {before:.0f} -> {while_sent:.0f} tokens/s, /health {health_s:.2f} s")
    assert health_s < 2.0, f"/health took {health_s:.2f} s"
    assert while_sent >= 0.5 * before, f"the bystander fell from {before:.0f} to {while_sent:.0f} tokens/s"
    assert_idle_soon(url)


@pytest.mark.timed  # (a bystander's rate, measured: with the cores to itself)
def test_bad_words_at_their_cap_hold_up_neither_health_nor_a_stream_and_past_it_are_refused(loaded_server):
    url, limits = loaded_server, Limits()
    words = [f"w{i:04d}" + "x" * (limits.max_bad_word_chars - 5) for i in range(limits.max_bad_words)]
    at_cap = chat("Say hello.", bad_words=words)
    before, while_sent, health_s, response = during(url, lambda: httpx.post(url + CHAT, json=at_cap, timeout=120))
    assert response.status_code == 200, response.text
    print(f"bad_words at the cap: bystander {before:.0f} -> {while_sent:.0f} tokens/s, /health {health_s:.2f} s")
    assert health_s < 2.0 and while_sent >= 0.5 * before, (health_s, before, while_sent)
    for too_many in (words + ["one more"], [words[0] + "x"], ["zq"] * 150_000):
        refused = httpx.post(url + CHAT, json=chat("Say hello.", bad_words=too_many), timeout=60)
        assert refused.status_code in (400, 413), refused.text
        assert refused.json()["error"]["param"] in ("bad_words", None), refused.text
    assert_idle_soon(url)


def test_a_format_compiles_once_for_all_choices(kind_server, monkeypatch):
    compiles = []
    make = OutputFormat._make_grammar
    monkeypatch.setattr(OutputFormat, "_make_grammar", lambda self: compiles.append(self.kind) or make(self))
    response = httpx.post(kind_server + CHAT, json=chat(n=4, max_tokens=6, temperature=1, seed=3,
                                                        structured_outputs={"regex": "[a-c]{2,5}"}), timeout=60)
    assert response.status_code == 200, response.text
    assert compiles == ["regex"]
    assert all(re.fullmatch("[a-c]{2,5}", c["message"]["content"]) or c["finish_reason"] == "length"
               for c in response.json()["choices"])


@pytest.fixture(scope="module")
def trusting_server(slm, llm, tokenizer):
    """A server that takes chat templates from requests (--trust-request-chat-template)."""
    app = create_app(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny-r2r",
                     Limits(max_batch=4, max_queue=16, max_tokens=400, context_length=512),
                     trust_request_chat_template=True)
    with BackgroundServer(app) as srv:
        yield srv.url


def message(**kw):
    return {"model": "tiny-r2r", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **kw}


@pytest.mark.parametrize("field,value", [("n", 2), ("logprobs", True), ("top_logprobs", 2), ("echo", True),
                                         ("prompt_logprobs", 1)])
def test_messages_refuses_by_name_what_its_replies_have_no_place_for(trusting_server, field, value):
    response = httpx.post(trusting_server + "/v1/messages", json=message(**{field: value}), timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith(field), response.text
    assert httpx.post(trusting_server + "/v1/messages", json=message(), timeout=60).status_code == 200


def nested_tag(depth: int) -> dict:
    fmt: dict = {"type": "const_string", "value": "x"}
    for i in range(depth):
        fmt = {"type": "tag", "begin": f"<t{i}>", "content": fmt, "end": f"</t{i}>"}
    return fmt


@pytest.mark.parametrize("extra,said", [
    ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
    ({"chat_template_kwargs": {"documents": 3}}, "may not set documents"),
    ({"chat_template": "{{ range(10**9)|length }}"}, "chat template failed"),
    ({"chat_template": "{% for m in messages %}{{ m.nope.deeper }}{% endfor %}"}, "chat template"),
    ({"response_format": {"type": "structural_tag", "format": nested_tag(400)}}, "nest it less"),
])
def test_a_clients_mistake_is_a_400_with_no_traceback_in_the_log(trusting_server, caplog, extra, said):
    response = httpx.post(trusting_server + CHAT, json=chat(**extra), timeout=60)
    assert response.status_code == 400, response.text
    assert said in response.json()["error"]["message"], response.text
    assert not [r for r in caplog.records if r.exc_info], "a client's mistake left a traceback in the log"
    assert httpx.post(trusting_server + CHAT, json=chat(), timeout=60).status_code == 200


def leave_after_first_event(url, path, payload):
    """Stream a request, read one event, and hang up."""
    with httpx.stream("POST", url + path, json={**payload, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break


@pytest.mark.parametrize("path,payload", [
    (CHAT, chat("Bonjour!", n=3, max_tokens=400, ignore_eos=True)),
    ("/v1/completions", {"prompt": ["Bonjour!", "Hello"], "n": 2, "max_tokens": 400, "ignore_eos": True}),
    ("/v1/messages", message(max_tokens=400, ignore_eos=True)),
    ("/v1/responses", {"input": "Bonjour!", "max_output_tokens": 400, "ignore_eos": True}),
])
def test_a_client_that_leaves_cancels_every_choice_it_started(loaded_server, path, payload):
    import time

    leave_after_first_event(loaded_server, path, payload)
    left = time.monotonic()
    while httpx.get(loaded_server + "/health").json()["running"]:
        assert time.monotonic() - left < 1.0, "a choice kept running after its client left"
        time.sleep(0.02)


def test_responses_with_two_thousand_turns_and_truncation_auto_answers_within_two_seconds(kind_server):
    import time

    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(2000)]
    payload = {"input": turns, "truncation": "auto", "max_output_tokens": 8, "temperature": 0}
    start = time.monotonic()
    response = httpx.post(kind_server + "/v1/responses", json=payload, timeout=60)
    took = time.monotonic() - start
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["input_tokens"] + 8 <= 512
    # the fewest turns went: with one more turn kept, the conversation would not fit
    kept = response.json()["usage"]["input_tokens"]
    assert kept > 512 - 8 - 40, f"only {kept} prompt tokens kept: more turns went than had to"
    print(f"2,000 turns, truncation auto: answered in {took:.2f} s")
    assert took < 2.0, f"took {took:.2f} s"


LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"  # 82 characters of work


def test_a_request_templates_time_counts_once_its_process_has_started(tokenizer):
    """The process that writes requests' templates takes longer to start (a spawned Python importing the tokenizer's
    library) than this lane's limit of half a second: the first template is still written, its time counted from when
    the process said it had started (it once failed the first request on a busy machine)."""
    lane = TemplateLane(tokenizer, seconds=0.5, memory_bytes=128 << 20, limit=2)
    job = ([{"role": "user", "content": "hi"}], None, None, True, False, "{{ messages[0]['content'] }} then")
    try:
        assert asyncio.run(lane(*job)) == encode_messages(tokenizer, *job)
    finally:
        lane.shutdown()


def test_a_request_template_that_loops_or_builds_a_large_text_holds_up_no_ordinary_chat(trusting_server):
    import time

    url, outcomes = trusting_server, {}

    def send(name, template):
        start = time.monotonic()
        response = httpx.post(url + CHAT, json=chat(chat_template=template), timeout=60)
        outcomes[name] = (response, time.monotonic() - start)

    warm = httpx.post(url + CHAT, json=chat(chat_template="{{ messages[0].content }}"), timeout=60)
    assert warm.status_code == 200, warm.text  # (the template process started)
    looping = threading.Thread(target=send, args=("loops", LOOPS))
    looping.start()
    time.sleep(0.3)
    for _ in range(5):  # ordinary chats, in the server's own template, while the template loops
        start = time.monotonic()
        assert httpx.post(url + CHAT, json=chat(), timeout=60).status_code == 200
        assert time.monotonic() - start < 2.0
    looping.join(30)
    response, took = outcomes["loops"]
    assert response.status_code == 400 and "within" in response.json()["error"]["message"], response.text
    assert response.json()["error"]["param"] == "chat_template" and took < Limits().max_template_seconds + 5
    send("builds", "{% set x = 'a' * 100000000 %}{{ x|length }}")
    response, _ = outcomes["builds"]
    assert response.status_code == 400 and "MiB" in response.json()["error"]["message"], response.text
    assert httpx.post(url + CHAT, json=chat(chat_template="{{ messages[0].content }}"), timeout=60).status_code == 200


def test_a_scored_prompt_past_its_cap_is_a_400_naming_the_field(slm, llm, tokenizer):
    app = create_app(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny-r2r",
                     Limits(max_batch=4, context_length=512, max_scored_prompt_tokens=32))
    scored = {"max_tokens": 1, "echo": True, "logprobs": 1}
    with BackgroundServer(app) as srv:
        for extra, field in ((scored, "echo"), ({"max_tokens": 1, "prompt_logprobs": 1}, "prompt_logprobs")):
            refused = httpx.post(srv.url + "/v1/completions", json={"prompt": list(range(5, 45)), **extra}, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
            assert "at most 32" in refused.json()["error"]["message"]
            assert httpx.post(srv.url + "/v1/completions", json={"prompt": list(range(5, 37)), **extra},
                              timeout=60).status_code == 200
