"""Schemathesis against the server's own `/openapi.json`: generated bodies for `/v1/chat/completions`,
`/v1/completions`, `/v1/responses` (and its stored responses), `/v1/messages` and `/v1/models`, valid and invalid
ones, with a fixed seed. Every answer is a success or a 4xx in its API's error shape (OpenAI's; Anthropic's on
/v1/messages): never a 5xx, never a dropped connection.
R2R_FUZZ_EXAMPLES sets the examples per operation (a longer run: R2R_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py)."""

import os

import httpx
import hypothesis
import pytest
import schemathesis
from bystander import CHAT, during, slowed
from conftest import assert_idle_soon
from tiny import TOOLS_TEMPLATE, tiny_tokenizer

from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.schemas import MAX_CACHE_SALT_CHARS
from roads_to_rome.serving.server import create_app

EXAMPLES = int(os.environ.get("R2R_FUZZ_EXAMPLES", "50"))  # per operation and mode


@pytest.fixture(scope="module")
def api(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    app = create_app(engine, "tiny-r2r", Limits(max_batch=4, max_tokens=32, context_length=256), docs=True)
    with BackgroundServer(app) as server:
        yield schemathesis.openapi.from_url(server.url + "/openapi.json").include(path_regex="^/v1/")


NEGATIVE, POSITIVE = schemathesis.GenerationMode.NEGATIVE, schemathesis.GenerationMode.POSITIVE
# Valid and invalid bodies; `GET /v1/models` takes no input, so it has no invalid one.
RUNS = [("POST /v1/chat/completions", POSITIVE), ("POST /v1/chat/completions", NEGATIVE),
        ("POST /v1/completions", POSITIVE), ("POST /v1/completions", NEGATIVE), ("GET /v1/models", POSITIVE),
        ("POST /v1/responses", POSITIVE), ("POST /v1/responses", NEGATIVE),
        ("GET /v1/responses/{response_id}", POSITIVE), ("DELETE /v1/responses/{response_id}", POSITIVE),
        ("POST /v1/messages", POSITIVE), ("POST /v1/messages", NEGATIVE), ("POST /v1/messages/count_tokens", POSITIVE)]


# Hypothesis drives schemathesis's strategies directly (its pytest plugin does not run under this pytest).
@pytest.mark.parametrize("label, mode", RUNS, ids=[f"{label}-{mode.value}" for label, mode in RUNS])
def test_every_generated_request_gets_a_success_or_an_openai_error(api, label, mode):
    operation = api.find_operation_by_label(label)
    assert operation is not None, f"{label} is not in /openapi.json"

    answered = []

    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def check(case):
        if mode == POSITIVE and isinstance(case.body, dict):
            reach_the_engine(case.body)
        response = case.call(timeout=60)  # a dropped connection raises here
        assert response.status_code < 500, f"{label} {case.body!r}: {response.status_code} {response.text[:300]}"
        if response.status_code >= 400 and label.startswith("POST /v1/messages"):
            body = response.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, response.text
        elif response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
        answered.append(response.status_code == 200)

    check()
    if mode == POSITIVE and label.startswith("POST"):  # valid bodies get answers, not only refusals
        assert sum(answered) >= len(answered) // 4, f"{sum(answered)} of {len(answered)} answered"


def reach_the_engine(body: dict) -> None:
    """A valid body as a client would send it to this server: its model's name, a few new tokens, one choice (random
    strings and sizes would all be refused before the engine)."""
    body["model"] = "tiny-r2r"
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(name), (int, float)) and not isinstance(body[name], bool):  # (JSON's 7.0 is an integer)
            body[name] = 1 + int(abs(body[name])) % 32
    body.pop("n", None)
    # Token ids as this tiny vocabulary has them, and no more tokens required than asked for.
    vocab = 300
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        body["prompt"] = [t % vocab for t in prompt]
    elif isinstance(prompt, list) and all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
        body["prompt"] = [[t % vocab for t in p] for p in prompt]
    for name in ("stop_token_ids", "allowed_token_ids"):
        if isinstance(body.get(name), list) and all(isinstance(t, int) for t in body[name]):
            body[name] = [t % vocab for t in body[name]]
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(int(t) % vocab): b for t, b in body["logit_bias"].items() if str(t).isdigit()}
    body.pop("min_tokens", None)
    # Random grammars and schemas are nearly all refused (the refusals are fuzzed with the invalid bodies); a JSON
    # object, without allowed tokens beside it, reaches the engine.
    body.pop("structured_outputs", None)
    # This tiny model's template takes no tools: they are refused (tests/test_tool_calls.py has a server that takes
    # them). What the schema cannot say of a message: it has content, unless it is an assistant's with calls, whose
    # arguments are a JSON object's text.
    body.pop("tools", None)
    body.pop("tool_choice", None)
    # A Responses request: no stored response to go on from, an earlier call's arguments as a JSON object's text,
    # top_logprobs only with the log-probabilities included, a text format as for chat.
    body.pop("previous_response_id", None)
    body.pop("top_logprobs", None)
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if isinstance(item, dict) and item.get("type") == "function_call":
            item["arguments"] = "{}"
    if isinstance(body.get("text"), dict) and isinstance(body["text"].get("format"), dict) \
            and body["text"]["format"].get("type") == "json_schema":
        body["text"].pop("format")
    # A Messages request: its schemas as for chat
    body.pop("output_format", None)
    if isinstance(body.get("output_config"), dict):
        body["output_config"].pop("format", None)
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            calls = message.get("tool_calls") if message.get("role") == "assistant" else None
            if message.get("role") != "assistant":
                message.pop("tool_calls", None)
            if message.get("content") is None and not calls:
                message["content"] = "hi"
            # (a Messages request's: a user's message answers calls, an assistant's makes them)
            misplaced = "tool_use" if message.get("role") == "user" else "tool_result"
            if isinstance(message.get("content"), list):
                kept = [b for b in message["content"] if not (isinstance(b, dict) and b.get("type") == misplaced)]
                message["content"] = kept or "hi"
            for call in calls or []:
                if isinstance(call, dict) and isinstance(call.get("function"), dict):
                    call["function"]["arguments"] = "{}"
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") == "json_schema":
        body.pop("response_format")
    if body.get("response_format") is not None:
        body.pop("allowed_token_ids", None)
    if body.get("allowed_token_ids") == []:
        body.pop("allowed_token_ids")


def capped(limits: Limits, vocab: int) -> list[tuple[str, object, list[object]]]:
    """Every field a chat may send a list or a long text in: its value at this server's cap, and values just past
    it (one item too many; one item too long). The token ids at the cap repeat this tiny vocabulary's."""
    stops = [f"{i:03d}" + "x" * (limits.max_stop_chars - 3) for i in range(limits.max_stop_strings)]
    words = [f"w{i:04d}" + "x" * (limits.max_bad_word_chars - 5) for i in range(limits.max_bad_words)]
    ids = [i % vocab for i in range(limits.max_token_ids)]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(limits.max_tools)]
    return [("stop", stops, [stops + ["one more"], ["x" * (limits.max_stop_chars + 1)]]),
            ("bad_words", words, [words + ["one more"], ["x" * (limits.max_bad_word_chars + 1)]]),
            ("allowed_token_ids", ids, [ids + [1]]),
            ("stop_token_ids", ids, [ids + [1]]),
            ("logit_bias", {str(i): 1 for i in range(vocab)}, [{str(i): 1 for i in range(limits.max_token_ids + 1)}]),
            ("tools", tools, [tools + tools[:1]]),
            ("cache_salt", "s" * MAX_CACHE_SALT_CHARS, ["s" * (MAX_CACHE_SALT_CHARS + 1)])]


@pytest.fixture
def loaded_tool_server(slm, llm, monkeypatch):
    """The tiny pair, each forward 5 ms slower (a bystander stream lasts seconds), under a template that takes
    tools, at the default limits."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    slowed((slm, llm), monkeypatch)
    app = create_app(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny-r2r", Limits(max_tokens=480))
    with BackgroundServer(app) as server:
        yield server.url, len(tokenizer)


@pytest.mark.timed  # (a bystander's rate, measured: with the cores to itself, not beside another test process)
@pytest.mark.parametrize("field", [field for field, _, _ in capped(Limits(), 300)])
def test_each_list_at_its_cap_holds_up_nobody_and_past_it_is_a_400_naming_it(loaded_tool_server, field):
    """A bystander stream keeps at least half the rate it keeps beside the same requests without the field (a
    request of its own takes its share of each step, and this in-process client shares the server's GIL)."""
    url, vocab = loaded_tool_server
    _, at_cap, past = next(entry for entry in capped(Limits(), vocab) if entry[0] == field)
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}

    def four(payload):
        return lambda: [httpx.post(url + CHAT, json=payload, timeout=120) for _ in range(4)][-1]

    _, plain_rate, _, _ = during(url, four(body))
    before, while_sent, health_s, answer = during(url, four({**body, field: at_cap}))
    print(f"{field} at its cap: {answer.status_code}, bystander {before:.0f} -> {while_sent:.0f} tokens/s "
          f"({plain_rate:.0f} beside requests without it), /health {health_s:.2f} s")
    if field == "tools":  # rendered and tokenized, then too long for the tiny models' 512 positions
        assert answer.json()["error"]["code"] == "context_length_exceeded", answer.text
    else:
        assert answer.status_code == 200, answer.text
    assert health_s < 2.0 and while_sent >= 0.5 * plain_rate, (health_s, plain_rate, while_sent)
    for value in past:
        refused = httpx.post(url + CHAT, json={**body, field: value}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert "at most" in refused.json()["error"]["message"], refused.text
    assert_idle_soon(url)


def test_messages_and_responses_meet_the_same_caps(loaded_tool_server):
    url, _ = loaded_tool_server
    stops = ["x"] * (Limits().max_stop_strings + 1)
    refused = httpx.post(url + "/v1/messages", json={"model": "tiny-r2r", "max_tokens": 8, "stop_sequences": stops,
                                                     "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
    assert refused.status_code == 400 and "at most" in refused.json()["error"]["message"], refused.text
    tools = [{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}}
             for i in range(Limits().max_tools + 1)]
    refused = httpx.post(url + "/v1/responses", json={"model": "tiny-r2r", "input": "Hi", "tools": tools}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", refused.text
