"""Anthropic's Messages API (serving/messages.py) through the anthropic client: each message is the answer the chat
path gives the same conversation, whole and streamed as the API's events; tool use and tool results, thinking,
structured outputs, stop sequences, token counts, and errors in Anthropic's shape."""

import json

import anthropic
import httpx
import openai
import pytest
from test_reasoning import thinker  # noqa: F401 (a fixture)
from test_responses import FLAT, client_of, serve
from test_tool_calls import TIME, WEATHER, tool_engine, tool_tokenizer  # noqa: F401 (fixtures)
from tiny import tiny_model

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import RandomPolicy

GREEDY = {"extra_body": {"temperature": 0, "r2r_policy": "llm"}}  # the same tokens every time
TOOLS = [{"name": f["name"], "input_schema": f["parameters"], **({"description": f["description"]} if "description"
                                                                 in f else {})} for f in FLAT]


@pytest.fixture(scope="module")
def srv(slm, llm, tokenizer):
    with serve(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny", max_tokens=64, context_length=512) \
            as running:
        yield running


def anthropic_of(srv, **kw):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60, **kw)


def events_of(srv, body: dict) -> list[dict]:
    """A stream's events as sent: each `event:` line's name is its data's type."""
    events = []
    with httpx.stream("POST", srv.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as response:
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                assert events[-1]["type"] == kind
    return events


def blocks_streamed(events: list[dict]) -> list[dict]:
    """The content blocks a client puts together from the events."""
    blocks = []
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"], partial_json=""))
        elif e["type"] == "content_block_delta":
            block, delta = blocks[e["index"]], e["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[
                delta["type"]]
            block[key] = block.get(key, "") + delta["text" if key == "text" else key]
    return blocks


def test_a_message_is_the_chat_answer_to_the_same_conversation_whole_and_streamed(srv):
    client, chat = anthropic_of(srv), client_of(srv)
    messages = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "42"},
                {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "6 * 8?"}]}]
    asked = chat.chat.completions.create(model="tiny", max_tokens=20, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 6 * 8?"}],
        extra_body={"r2r_policy": "llm"})
    whole = client.messages.create(model="tiny", max_tokens=20, system="Be brief.", messages=messages, **GREEDY)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == asked.choices[0].message.content
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == "tiny"
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens  # (the API's rule: kept tokens apart)
    assert prompt == asked.usage.prompt_tokens and whole.usage.cache_read_input_tokens > 0  # the chat's prompt kept
    assert whole.usage.output_tokens == asked.usage.completion_tokens and whole.usage.model_extra["llm_rate"] == 1.0
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[asked.choices[0].finish_reason]
    assert whole.model_extra["r2r"]["token_ids"] == asked.model_extra["r2r"]["token_ids"]
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    assert counted.input_tokens == prompt

    body = {"model": "tiny", "max_tokens": 20, "system": [{"type": "text", "text": "Be brief."}],
            "messages": messages, "temperature": 0, "r2r_policy": "llm"}
    events = events_of(srv, body)
    assert [e["type"] for e in events[:2]] == ["message_start", "content_block_start"]
    assert [e["type"] for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == prompt  # (before the prompt is looked up)
    assert events[-2]["usage"]["input_tokens"] + events[-2]["usage"]["cache_read_input_tokens"] == prompt
    assert [(b["type"], b["text"]) for b in blocks_streamed(events)] == [("text", whole.content[0].text)]
    assert events[-2]["delta"]["stop_reason"] == whole.stop_reason
    assert events[-2]["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(model="tiny", max_tokens=20, system="Be brief.", messages=messages, **GREEDY) \
            as stream:  # the anthropic client's own accumulator of the events
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason


def test_a_stop_sequence_ends_the_text_and_is_named(srv):
    """Anthropic's stop_reason "stop_sequence" names the sequence; vLLM's chat `stop_reason` does too."""
    held = {"temperature": 0, "r2r_policy": "llm", "structured_outputs": {"choice": ["It is sunny today."]}}
    whole = anthropic_of(srv).messages.create(model="tiny", max_tokens=30, stop_sequences=["sunny"],
                                              messages=[{"role": "user", "content": "Weather?"}], extra_body=held)
    assert (whole.stop_reason, whole.stop_sequence, whole.content[0].text) == ("stop_sequence", "sunny", "It is ")
    events = events_of(srv, {"model": "tiny", "max_tokens": 30, "stop_sequences": ["sunny"],
                             "messages": [{"role": "user", "content": "Weather?"}], **held})
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "sunny"}
    chat = client_of(srv).chat.completions.create(model="tiny", max_tokens=30, stop=["sunny"], messages=[
        {"role": "user", "content": "Weather?"}], extra_body=held)
    assert chat.choices[0].model_extra["stop_reason"] == "sunny" and chat.choices[0].message.content == "It is "
    ended = anthropic_of(srv).messages.create(model="tiny", max_tokens=30, messages=[
        {"role": "user", "content": "Weather?"}], extra_body=held)
    assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None)


@pytest.fixture(scope="module")
def tools_srv(tool_engine):  # noqa: F811
    with serve(tool_engine, "tools") as running:
        yield running


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_calls_are_tool_use_blocks_whole_and_streamed(tools_srv, choice):
    kw = {"model": "tools", "max_tokens": 160, "tools": TOOLS, "tool_choice": choice,
          "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    whole = anthropic_of(tools_srv).messages.create(**kw, **GREEDY)
    assert whole.stop_reason == "tool_use" and {b.type for b in whole.content} == {"tool_use"}
    assert all(b.id.startswith("toolu_") and isinstance(b.input, dict) for b in whole.content)
    if choice["type"] == "tool" or choice.get("disable_parallel_tool_use"):
        assert len(whole.content) == 1
    if choice["type"] == "tool":
        assert whole.content[0].name == "get_time" and whole.content[0].input["zone"] in ("UTC", "CET")
    events = events_of(tools_srv, {**kw, **GREEDY["extra_body"]})
    streamed = blocks_streamed(events)
    assert [(b["name"], json.loads(b["partial_json"])) for b in streamed] == [(b.name, b.input) for b in whole.content]
    assert sum(e["type"] == "content_block_delta" for e in events) > len(streamed)  # as written
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_tool_results_go_back_as_the_chats_tool_messages(tools_srv):
    written = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n' \
              '</tool_call>'
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    client = anthropic_of(tools_srv)
    whole = client.messages.create(model="tools", max_tokens=160, tools=TOOLS, messages=ask, extra_body={
        "temperature": 0, "r2r_policy": "llm", "structured_outputs": {"choice": [written]}})
    assert [b.type for b in whole.content] == ["text", "tool_use"] and whole.content[0].text == "Let me look.\n"
    call = whole.content[1]
    assert (call.name, call.input, whole.stop_reason) == ("get_weather", {"city": "Paris", "days": 2}, "tool_use")
    turns = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                                                {"type": "text", "text": "Thanks."}]}]
    counted = client.messages.count_tokens(model="tools", tools=TOOLS, messages=turns)
    chat = client_of(tools_srv).chat.completions.create(model="tools", max_tokens=4, tools=[WEATHER, TIME], messages=[
        ask[0], {"role": "assistant", "content": "Let me look.\n", "tool_calls": [{"id": call.id, "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}, {"role": "user", "content": "Thanks."}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_thinking_is_a_thinking_block_whole_and_streamed(thinker):  # noqa: F811
    tokenizer, model = thinker
    engine = Engine(TorchBackend(model, name="thinker"), TorchBackend(tiny_model(tokenizer, hidden=64, seed=1)),
                    tokenizer, RandomPolicy(0.0, seed=0))
    ask = [{"role": "user", "content": "What is 48 / 2?"}]
    with serve(engine, "thinker", max_tokens=64, context_length=256) as running:
        chat = client_of(running).chat.completions.create(model="thinker", max_tokens=24, temperature=0,
                                                          messages=ask)
        whole = anthropic_of(running).messages.create(model="thinker", max_tokens=24, messages=ask,
                                                      extra_body={"temperature": 0})
        events = events_of(running, {"model": "thinker", "max_tokens": 24, "messages": ask, "temperature": 0})
    message = chat.choices[0].message
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == message.model_extra["reasoning"] and whole.content[1].text == message.content
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in blocks_streamed(events)] == \
        [("thinking", whole.content[0].thinking), ("text", whole.content[1].text)]


def test_an_output_format_holds_the_text_to_a_schema(srv, slm, llm, tokenizer):
    from roads_to_rome.core.grammar import OutputFormat
    from roads_to_rome.core.request import Request
    from roads_to_rome.core.sampling import SamplingParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    engine = Engine(slm, llm, tokenizer)
    own = engine.run([Request(engine.prompts.chat("A digit"), SamplingParams(
        max_new_tokens=24, output_format=OutputFormat.json_schema(schema)), force="llm")])[0]
    for field in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"extra_body": {"output_format": {"type": "json_schema", "schema": schema}}}):
        extra = {**GREEDY["extra_body"], **field.pop("extra_body", {})}
        message = anthropic_of(srv).messages.create(model="tiny", max_tokens=24, messages=[
            {"role": "user", "content": "A digit"}], extra_body=extra, **field)
        assert message.model_extra["r2r"]["token_ids"] == own.token_ids and message.content[0].text == own.text


@pytest.mark.parametrize("fields, says", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens is at most 64"),
    ({"model": "nope"}, "does not exist"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0: a content block here is text, tool_use, tool_result or thinking: this server reads no "
     "images"),
    ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "MCP"),
    ({"tool_choice": {"type": "any"}}, "no tools"),
    ({"stop_sequences": ["."] * 50}, "stop_sequences holds 50 strings"),  # the request's names, not the chat's
    ({"output_format": {"type": "json_schema", "schema": {"type": "bogus"}}}, "output_format.schema: "),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}},
     "output_config.format.schema: "),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "assistant's"),
])
def test_errors_come_in_anthropics_shape(srv, fields, says):
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(srv.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
    assert error["error"]["type"] == ("not_found_error" if r.status_code == 404 else "invalid_request_error")
    assert says in error["error"]["message"], error
    # OpenAI's routes keep OpenAI's shape
    assert "param" in httpx.post(srv.url + "/v1/chat/completions", json={"messages": []}).json()["error"]


def test_the_api_key_comes_as_anthropics_header_and_a_refusal_in_its_shape(slm, llm, tokenizer):
    app_engine = Engine(slm, llm, tokenizer)
    from roads_to_rome.serving.background import BackgroundServer
    from roads_to_rome.serving.limits import Limits
    from roads_to_rome.serving.server import create_app

    with BackgroundServer(create_app(app_engine, "tiny", Limits(max_tokens=8), api_key="sekret")) as running:
        keyed = anthropic.Anthropic(base_url=running.url, api_key="sekret", max_retries=0, timeout=60)
        assert keyed.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).id
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=running.url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert refused.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):  # the OpenAI routes take it as a Bearer token
            openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=running.url + "/v1", api_key="sekret").models.list().data
