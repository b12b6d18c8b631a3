"""The Responses API (serving/responses.py) through the openai client: each response is the answer the chat path
gives the same conversation, whole and streamed as the API's events; input items, tools, thinking, structured
outputs, log-probabilities, stored responses to go on from, and what cannot be done refused by name."""

import json
import time

import anthropic
import httpx
import openai
import pytest
from conftest import assert_idle_soon
from test_reasoning import thinker  # noqa: F401 (a fixture)
from test_tool_calls import TIME, WEATHER, tool_engine, tool_tokenizer  # noqa: F401 (fixtures)
from tiny import tiny_model, tiny_tokenizer

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.response_store import ResponseStore, conversation_of
from roads_to_rome.serving.responses_schemas import ResponsesBody
from roads_to_rome.serving.server import create_app

GREEDY = {"temperature": 0, "extra_body": {"r2r_policy": "llm"}}  # the same tokens every time


def serve(engine, name, **limits):
    app = create_app(engine, name, Limits(max_batch=4, **{"max_tokens": 160, "context_length": 2048, **limits}))
    return BackgroundServer(app)


def client_of(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def srv(slm, llm, tokenizer):
    with serve(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny", max_tokens=64, context_length=512) \
            as running:
        yield running


@pytest.fixture
def client(srv):
    return client_of(srv)


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def items_streamed(events) -> list[dict]:
    """The output items a client puts together from the events: each added, its deltas summed, then done."""
    items = {}
    for e in events:
        if e.type == "response.output_item.added":
            items[e.output_index] = {"type": e.item.type, "text": "", "arguments": "",
                                     "name": getattr(e.item, "name", None)}
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e.output_index]["text"] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            items[e.output_index]["arguments"] += e.delta
        elif e.type == "response.output_item.done":
            done = e.item
            kept = items[e.output_index]
            if done.type == "message":
                assert kept["text"] == done.content[0].text
            elif done.type == "reasoning":
                assert kept["text"] == done.content[0].text
            else:
                assert kept["arguments"] == done.arguments
    return [items[k] for k in sorted(items)]


def test_a_response_is_the_chat_answer_to_the_same_conversation_whole_and_streamed(client):
    kw = {"model": "tiny", "max_output_tokens": 20, **GREEDY}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "48 / 2?"}],
        max_tokens=20, **GREEDY)
    whole = client.responses.create(instructions="Be brief.", input="48 / 2?", **kw)
    assert whole.output_text == chat.choices[0].message.content and whole.object == "response"
    assert whole.id.startswith("resp_") and whole.model == "tiny" and whole.instructions == "Be brief."
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.usage.model_extra["llm_rate"] == 1.0 and whole.max_output_tokens == 20
    assert whole.model_extra["r2r"]["token_ids"] == chat.model_extra["r2r"]["token_ids"]
    length = chat.choices[0].finish_reason == "length"
    assert whole.status == ("incomplete" if length else "completed")
    assert (whole.incomplete_details.reason if length else whole.incomplete_details) == \
        ("max_output_tokens" if length else None)
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")

    events = events_of(client.responses.create(instructions="Be brief.", input="48 / 2?", stream=True, **kw))
    assert [e.type for e in events[2:4]] == ["response.output_item.added", "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", f"response.{whole.status}"]
    assert items_streamed(events) == [{"type": "message", "text": whole.output_text, "arguments": "", "name": None}]
    last = events[-1].response
    assert last.output_text == whole.output_text and last.usage.output_tokens == whole.usage.output_tokens
    assert last.model_extra["r2r"]["token_ids"] == whole.model_extra["r2r"]["token_ids"]


def test_input_items_are_the_chat_they_say(client):
    """Messages with text parts, a developer message, an assistant's earlier output handed back: the prompt and the
    answer are the chat's."""
    items = [{"role": "developer", "content": "Answer in digits."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                              {"type": "input_text", "text": "6 * 7?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "42", "annotations": []}]},
             {"role": "user", "content": "And 6 * 8?"}]
    messages = [{"role": "system", "content": "Answer in digits."}, {"role": "user", "content": "What is 6 * 7?"},
                {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 6 * 8?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **GREEDY)
    response = client.responses.create(model="tiny", input=items, max_output_tokens=12, **GREEDY)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_stored_responses_are_gone_on_from_retrieved_and_deleted(client):
    first = client.responses.create(model="tiny", instructions="Be brief.", input="Hi", max_output_tokens=8,
                                    **GREEDY)
    follow = client.responses.create(model="tiny", input="Go on", previous_response_id=first.id,
                                     max_output_tokens=8, **GREEDY)
    # The instructions of the response gone on from are not carried over (OpenAI's rule); its answer is.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Go on"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content and follow.previous_response_id == first.id
    again = client.responses.create(model="tiny", input="More", previous_response_id=follow.id,
                                    max_output_tokens=8, **GREEDY)
    chat = client.chat.completions.create(model="tiny", max_tokens=8, **GREEDY, messages=messages + [
        {"role": "assistant", "content": follow.output_text}, {"role": "user", "content": "More"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # The input a response was asked with, listed back a page at a time, as the openai client pages it
    items = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on"}]}]
    listed = client.responses.create(model="tiny", input=items, max_output_tokens=2)
    shown = list(client.responses.input_items.list(listed.id, order="asc", limit=2))
    assert [(i.role, i.content[0].text) for i in shown] == [("user", "Hi"), ("assistant", first.output_text),
                                                            ("user", "Go on")]
    assert shown[1].content[0].type == "output_text" and len({i.id for i in shown}) == 3
    newest = client.responses.input_items.list(listed.id, limit=1)
    assert [i.id for i in newest.data] == [shown[-1].id] and newest.has_more
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert gone.value.code == "previous_response_not_found" and gone.value.param == "previous_response_id"
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    streamed = events_of(client.responses.create(model="tiny", input="Hi", max_output_tokens=4, stream=True))
    assert client.responses.retrieve(streamed[-1].response.id).output_text == streamed[-1].response.output_text


def test_the_store_keeps_the_most_recently_used_within_its_budget():
    class Draft:
        conversation = [{"role": "user", "content": "x" * 100}]
        body = ResponsesBody(input="y" * 100)

    one = ResponseStore(budget=10**6)
    one.put({"id": "a", "output": []}, Draft())
    budget = 7 * one.size + one.size // 2  # room for 7 of these
    store = ResponseStore(budget)
    for name in "abc":
        store.put({"id": name, "output": []}, Draft())
    assert list(store.kept) == ["a", "b", "c"] and store.size == 3 * one.size
    store.put({"id": "b", "output": []}, Draft())  # kept again (a background response done): in its place
    assert list(store.kept) == ["a", "c", "b"] and store.size == 3 * one.size
    store.get("a")  # used: kept longest
    for name in "defgh":
        store.put({"id": name, "output": []}, Draft())
    assert list(store.kept) == ["b", "a", "d", "e", "f", "g", "h"] and store.size <= budget
    store.put({"id": "big", "output": [], "pad": "y" * budget}, Draft())  # over the whole budget: not kept
    assert "big" not in store.kept and store.delete("a") and not store.delete("a")
    assert store.size == 6 * one.size


LONG = 8000  # tokens without an end of sequence: longer to write than a slot may take to be freed (5 s)


@pytest.fixture(scope="module")
def long_srv(tokenizer):
    slm = TorchBackend(tiny_model(tokenizer, hidden=32, seed=0, max_positions=LONG + 192))
    with serve(Engine(slm, None, tokenizer), "long", max_tokens=LONG, context_length=LONG + 192) as running:
        yield running


def test_background_responses_are_fetched_when_done_and_cancelled_while_written(srv, client, long_srv):
    kw = {"model": "tiny", "input": "48 / 2?", "max_output_tokens": 20, **GREEDY}
    foreground = client.responses.create(**kw)
    queued = client.responses.create(background=True, **kw)
    assert queued.background and queued.status in ("queued", "in_progress") and queued.output == []
    fetched = queued
    for _ in range(600):
        fetched = client.responses.retrieve(queued.id)
        if fetched.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert fetched.status == foreground.status and fetched.output_text == foreground.output_text
    assert fetched.model_extra["r2r"]["token_ids"] == foreground.model_extra["r2r"]["token_ids"]
    assert client.responses.cancel(queued.id).status == fetched.status  # done: left as it is
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(foreground.id)
    assert refused.value.param == "response_id"
    for fields, param in (({"store": False}, "store"), ({"stream": True}, "stream")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(background=True, **fields, **kw)
        assert refused.value.param == param

    # A long one: going on from it while it is written is refused; cancelled, it stops, its slot freed.
    long = client_of(long_srv)
    started = long.responses.create(model="long", input="Go on", max_output_tokens=LONG, background=True,
                                    extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError) as refused:
        long.responses.create(model="long", input="x", previous_response_id=started.id)
    assert refused.value.param == "previous_response_id"
    assert long.responses.cancel(started.id).status == "cancelled"
    assert long.responses.retrieve(started.id).status == "cancelled"
    assert_idle_soon(long_srv.url)


@pytest.fixture(scope="module")
def tools_client(tool_engine):  # noqa: F811
    with serve(tool_engine, "tools") as running:
        yield client_of(running)


FLAT = [{"type": "function", **tool["function"]} for tool in (WEATHER, TIME)]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_calls_are_function_call_items_whole_and_streamed(tools_client, choice):
    kw = {"model": "tools", "input": "What is the weather in Paris?", "tools": FLAT, "tool_choice": choice,
          "max_output_tokens": 160, **GREEDY}
    whole = tools_client.responses.create(**kw)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    assert whole.status == "completed" and not [i for i in whole.output if i.type == "message"]
    if isinstance(choice, dict):
        assert [c.name for c in calls] == ["get_time"]
        assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
    events = events_of(tools_client.responses.create(stream=True, **kw))
    assert [(i["type"], i["name"], i["arguments"]) for i in items_streamed(events)] == \
        [("function_call", c.name, c.arguments) for c in calls]
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > len(calls)  # as written
    assert [i.arguments for i in events[-1].response.output] == [c.arguments for c in calls]


def test_a_reply_with_text_and_a_call_and_the_calls_answer_handed_back(tools_client):
    written = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n' \
              '</tool_call>'
    kw = {"model": "tools", "input": "What is the weather in Paris?", "tools": FLAT, "max_output_tokens": 160,
          "temperature": 0, "extra_body": {"structured_outputs": {"choice": [written]}, "r2r_policy": "llm"}}
    whole = tools_client.responses.create(**kw)
    assert [item.type for item in whole.output] == ["message", "function_call"]
    assert whole.output_text == "Let me look.\n" and whole.output[1].name == "get_weather"
    events = events_of(tools_client.responses.create(stream=True, **kw))
    assert [(i["type"], i["text"]) for i in items_streamed(events)] == [("message", "Let me look.\n"),
                                                                        ("function_call", "")]
    with tools_client.responses.stream(**kw) as stream:  # the openai client's own accumulator of the events
        final = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == \
        [(i.type, getattr(i, "arguments", None)) for i in whole.output] and final.output_text == whole.output_text
    call = whole.output[1]
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answered = tools_client.responses.create(model="tools", input=items, tools=FLAT, max_output_tokens=24,
                                             temperature=0)
    messages = [items[0], {"role": "assistant", "content": None, "tool_calls": [{
        "id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    chat = tools_client.chat.completions.create(model="tools", messages=messages, tools=[WEATHER, TIME],
                                                max_tokens=24, temperature=0)
    assert answered.usage.input_tokens == chat.usage.prompt_tokens
    # ... and going on from the stored response with the tool's answer is the same prompt
    gone_on = tools_client.responses.create(model="tools", previous_response_id=whole.id, tools=FLAT,
                                            max_output_tokens=24, temperature=0, input=[
                                                {"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "Sunny, 21 C"}])
    messages[1]["content"] = "Let me look.\n"
    chat = tools_client.chat.completions.create(model="tools", messages=messages, tools=[WEATHER, TIME],
                                                max_tokens=24, temperature=0)
    assert gone_on.usage.input_tokens == chat.usage.prompt_tokens


def test_thinking_is_a_reasoning_item_whole_and_streamed(thinker):  # noqa: F811
    tokenizer, model = thinker
    engine = Engine(TorchBackend(model, name="thinker"), TorchBackend(tiny_model(tokenizer, hidden=64, seed=1)),
                    tokenizer, RandomPolicy(0.0, seed=0))
    with serve(engine, "thinker", max_tokens=64, context_length=256) as running:
        client = client_of(running)
        chat = client.chat.completions.create(model="thinker", max_tokens=24, temperature=0,
                                              messages=[{"role": "user", "content": "What is 48 / 2?"}])
        kw = {"model": "thinker", "input": "What is 48 / 2?", "max_output_tokens": 24, "temperature": 0}
        whole = client.responses.create(**kw)
        events = events_of(client.responses.create(stream=True, **kw))
        cut = client.responses.create(**{**kw, "max_output_tokens": 2})
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == chat.choices[0].message.model_extra[
        "reasoning"] and reasoning.summary == []
    assert message.content[0].text == chat.choices[0].message.content
    assert whole.usage.output_tokens_details.reasoning_tokens == \
        chat.usage.completion_tokens_details.reasoning_tokens
    assert items_streamed(events) == [{"type": "reasoning", "text": reasoning.content[0].text, "arguments": "",
                                       "name": None},
                                      {"type": "message", "text": message.content[0].text, "arguments": "",
                                       "name": None}]
    assert cut.status == "incomplete" and [item.type for item in cut.output] == ["reasoning"]


def test_text_format_holds_the_output_to_a_schema_and_vllms_structured_outputs_go_through(client, slm, llm,
                                                                                         tokenizer):
    """text.format (json_object, json_schema) gives the engine's own answer under that format; vLLM's
    structured_outputs, an extra field, goes to the chat path as it is."""
    from roads_to_rome.core.grammar import OutputFormat
    from roads_to_rome.core.request import Request
    from roads_to_rome.core.sampling import SamplingParams

    engine = Engine(slm, llm, tokenizer)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    prompt = engine.prompts.chat("A number")
    for fmt, own_format in ((({"type": "json_schema", "name": "number", "schema": schema}),
                             OutputFormat.json_schema(schema)), ({"type": "json_object"}, OutputFormat("json_object"))):
        response = client.responses.create(model="tiny", input="A number", max_output_tokens=24, **GREEDY,
                                           text={"format": fmt})
        own = engine.run([Request(prompt, SamplingParams(max_new_tokens=24, output_format=own_format),
                                  force="llm")])[0]
        assert response.model_extra["r2r"]["token_ids"] == own.token_ids and response.output_text == own.text
        assert response.text.format.type == fmt["type"]
    compact = client.responses.create(model="tiny", input="A number", max_output_tokens=24, temperature=0,
                                      extra_body={"r2r_policy": "llm", "structured_outputs": {
                                          "json": schema, "disable_any_whitespace": True}})
    assert 0 <= json.loads(compact.output_text)["n"] <= 99


def test_the_answers_log_probabilities_come_when_included(client):
    kw = {"model": "tiny", "input": "Hi", "max_output_tokens": 6, **GREEDY}
    whole = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    entries = whole.output[0].content[0].logprobs
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in entries] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    events = events_of(client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2,
                                               stream=True, **kw))
    streamed = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert [e.token for e in streamed] == [e.token for e in entries][:len(streamed)]
    assert [e.token for e in events[-1].response.output[0].content[0].logprobs] == [e.token for e in entries]
    assert client.responses.create(**kw).output[0].content[0].logprobs == []


def test_errors_name_the_fields_as_the_responses_api_does(client):
    """The chat path's errors say a Responses request's own names, in their text and their param (the body knows the
    API's names: `CommonBody.in_api`), never the chat field it became."""
    kw = {"model": "tiny", "input": "Hi", **GREEDY}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**kw, max_output_tokens=10**6)
    assert refused.value.param == "max_output_tokens" and refused.value.message.count("max_output_tokens") == 1
    assert "max_tokens" not in refused.value.message.replace("max_output_tokens", "")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**kw, max_output_tokens=0)
    assert refused.value.param == "max_output_tokens" and "max_tokens" not in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{**kw, "extra_body": {**GREEDY["extra_body"], "structured_outputs": {"regex": "a"}}},
                                text={"format": {"type": "json_object"}})
    assert "text.format or structured_outputs" in refused.value.message
    assert "response_format" not in refused.value.message


def test_truncation_auto_drops_the_oldest_turns_until_the_conversation_fits(srv, client):
    """A conversation longer than the server holds (512 tokens) is refused as it is, and answered without its oldest
    turns under truncation "auto", its instructions kept: the prompt is the chat's of what is left."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "words " * 30}
             for i in range(12)] + [{"role": "user", "content": "Last"}]
    kw = {"model": "tiny", "instructions": "Be brief.", "input": turns, "max_output_tokens": 16, **GREEDY}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**kw)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "input"
    fitted = client.responses.create(truncation="auto", **kw)
    assert fitted.truncation == "auto" and fitted.usage.input_tokens + 16 <= 512
    for dropped in range(1, len(turns)):
        messages = [{"role": "system", "content": "Be brief."}] + turns[dropped:]
        if httpx.post(srv.url + "/tokenize", json={"messages": messages}).json()["count"] + 16 <= 512:
            break
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, **GREEDY)
    assert (fitted.usage.input_tokens, fitted.output_text) == (chat.usage.prompt_tokens,
                                                               chat.choices[0].message.content)


@pytest.mark.parametrize("fields, param, says", [
    ({"messages": [{"role": "user", "content": "x"}]}, "messages", "input"),
    ({"max_tokens": 5}, "max_tokens", "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens is at most"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.message.content",
     "input_text"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input.0.function_call.arguments", "JSON object"),
    ({"top_logprobs": 2}, "top_logprobs", "include"),
    ({"include": ["message.output_text.logprob"]}, "include.0", "message.output_text.logprobs"),  # misspelt
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema",
     ""),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 items"),  # OpenAI's limits
    ({"metadata": {"k": "v" * 513}}, "metadata.k", "at most 512 characters"),
])
def test_what_cannot_be_done_is_a_400_naming_the_field(srv, client, fields, param, says):
    body = {"model": "tiny", "input": "Hi", **fields}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"] or "").startswith(param) and says in error["message"], error
    assert client.responses.create(model="tiny", input="Hi", max_output_tokens=2).status in ("completed",
                                                                                          "incomplete")


# A template that shows an assistant's thinking (as Qwen3's does for a tool loop's turns) and its calls.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_thinking_handed_back_reaches_templates_that_show_it_from_every_api():
    """A tool loop's earlier thinking, handed back as a chat message's `reasoning_content`, a Responses reasoning
    item or a Messages thinking block, is the same prompt; a stored response's thinking goes on with it."""


    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    engine = Engine(TorchBackend(tiny_model(tokenizer, hidden=32, seed=0)), None, tokenizer)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    chat = [{"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "Let me see.", "reasoning_content": "Ask the clock.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    items = [{"role": "user", "content": "Time?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Ask the clock."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "UTC"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]
    blocks = [{"role": "user", "content": "Time?"},
              {"role": "assistant", "content": [{"type": "thinking", "thinking": "Ask the clock.", "signature": ""},
                                                {"type": "text", "text": "Let me see."},
                                                {"type": "tool_use", "id": "call_1", "name": "get_time",
                                                 "input": {"zone": "UTC"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "12:00"}]}]
    tools = [{"type": "function", "function": TIME["function"]}]
    with serve(engine, "thinking", max_tokens=8, context_length=512) as running:
        shown = httpx.post(running.url + "/tokenize", json={"messages": chat}).json()
        assert "<think>Ask the clock.</think>" in tokenizer.decode(shown["tokens"])
        bare = httpx.post(running.url + "/tokenize", json={"messages": [
            {k: v for k, v in m.items() if k != "reasoning_content"} for m in chat]}).json()
        assert bare["count"] < shown["count"]
        assert httpx.post(running.url + "/tokenize", json={"messages": [
            {"role": "user", "content": "x", "reasoning_content": "y"}]}).status_code == 400
        response = client_of(running).responses.create(model="thinking", input=items, max_output_tokens=2,
                                                       tools=[{"type": "function", **TIME["function"]}])
        counted = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0).messages.count_tokens(
            model="thinking", messages=blocks, tools=[{"name": "get_time",
                                                      "input_schema": TIME["function"]["parameters"]}])
        with_tools = httpx.post(running.url + "/tokenize", json={"messages": chat, "tools": tools}).json()
    assert response.usage.input_tokens == counted.input_tokens == with_tools["count"]
    assert conversation_of({"output": [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "message", "content": [{"type": "output_text", "text": "Yes."}]}]}) == [
        {"role": "assistant", "content": "Yes.", "reasoning_content": "Hm."}]


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "hi", "max_output_tokens": LONG}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": LONG, "background": True}),  # deleted while written
])
def test_a_client_that_leaves_frees_its_slot(long_srv, path, body):
    """A stream the client hangs up on after its first token, and a background response deleted while it is
    written: each frees its slot (written out, they would hold it longer than `assert_idle_soon` waits)."""
    srv = long_srv
    body = {"model": "long", "temperature": 0, "ignore_eos": True, **body}
    if body.get("background"):
        started = httpx.post(srv.url + path, json=body, timeout=60).json()
        assert httpx.delete(f"{srv.url}{path}/{started['id']}", timeout=60).json()["deleted"]
    else:
        with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and "delta" in line:
                    break  # one token, then hang up
    assert_idle_soon(srv.url)


def test_the_stores_budget_counts_what_the_responses_hold_in_memory():
    """Responses of many small items (a parsed JSON object takes several times its text): what the store holds, as
    tracemalloc counts it, is within a tenth of what its budget counts."""
    import tracemalloc

    class Draft:
        conversation = [{"role": "user", "content": f"turn {i}"} for i in range(200)]
        body = ResponsesBody(input="y" * 100)

    store = ResponseStore(budget=1 << 30)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(100):
        store.put({"id": f"resp_{i}", "output": [{"type": "message", "content": [{"type": "output_text", "text": w}]}
                                                 for w in "the answer is twelve".split() * 20]}, Draft())
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held <= 1.1 * store.size, f"the store holds {held} bytes and counts {store.size}"
    assert store.stored("resp_7").response["output"][0]["content"][0]["text"] == "the"


def test_a_response_its_own_settings_end_fails_with_their_reason_streamed_and_in_the_background(client):
    """A format whose only answer bad_words bans: the door cannot see it, the first step can. A stream and a
    background response fail with the code its 400 would give, not as a server error."""
    doomed = {"model": "tiny", "input": "48 / 2?", "max_output_tokens": 8, **GREEDY,
              "extra_body": {"structured_outputs": {"choice": ["a"]}, "bad_words": ["a"]}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**doomed)
    assert refused.value.code == "nothing_to_write"
    events = events_of(client.responses.create(stream=True, **doomed))
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "nothing_to_write"
    assert "bad_words" in events[-1].response.error.message
    queued = client.responses.create(background=True, **doomed)
    for _ in range(600):
        fetched = client.responses.retrieve(queued.id)
        if fetched.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert fetched.status == "failed" and fetched.error.code == "nothing_to_write", fetched
