"""Schemathesis against the server's own `/openapi.json`: generated bodies for `/v1/chat/completions`,
`/v1/completions`, `/v1/responses` (and its stored responses), `/v1/messages` and `/v1/models`, valid and invalid
ones, with a fixed seed. Every answer is a success or a 4xx in its API's error shape (OpenAI's; Anthropic's on
/v1/messages): never a 5xx, never a dropped connection.
R2R_FUZZ_EXAMPLES sets the examples per operation (a longer run: R2R_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py)."""

import os

import hypothesis
import pytest
import schemathesis

from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.schemas import Limits
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
        if isinstance(body.get(name), int):
            body[name] = 1 + abs(body[name]) % 32
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
            for call in calls or []:
                if isinstance(call, dict) and isinstance(call.get("function"), dict):
                    call["function"]["arguments"] = "{}"
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") == "json_schema":
        body.pop("response_format")
    if body.get("response_format") is not None:
        body.pop("allowed_token_ids", None)
    if body.get("allowed_token_ids") == []:
        body.pop("allowed_token_ids")
