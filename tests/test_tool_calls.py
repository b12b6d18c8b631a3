"""Tool calling (roads_to_rome/tool_calls.py): the hermes parser on text (whole, and every prefix as a stream sees
it), the grammar that holds `required` and named replies to calls, and the server through the openai client: calls
whole and streamed, earlier calls and tools' answers in the prompt, and what cannot be done refused by name."""

import json

import httpx
import openai
import pytest
from tiny import CHAT_TEMPLATE, TOOLS_TEMPLATE, tiny_model, tiny_tokenizer

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app
from roads_to_rome.serving.streams import CallsSent
from roads_to_rome.tool_calls import (
    CallStream,
    Compactor,
    ToolCall,
    ToolParser,
    call_format,
    compact_json,
    resolve_tool_parser,
)

# Llama 3.1's template, cut the same way: the tools in the system turn, and the format it asks calls in.
LLAMA_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nGiven the following functions, respond with a JSON for a function call. "
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Mistral's template, cut the same way: the tools before the last user message, earlier calls written back after
# [TOOL_CALLS] with their ids, which it holds to 9 letters and digits, as Mistral's own templates do.
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{% if c.id is not string or c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "<|im_end|>{% elif m.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}, \"call_id\": "
    "\"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
PARSER = ToolParser(frozenset({"get_weather", "get_time"}))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
PARIS = ToolCall("get_weather", '{"city": "Paris", "days": 2}')
UTC = ToolCall("get_time", '{"zone": "UTC"}')


@pytest.mark.parametrize("text, content, calls", [
    ("The weather is fine.", "The weather is fine.", []),
    (CALL, "", [PARIS]),
    ("Let me look.\n" + CALL, "Let me look.\n", [PARIS]),
    (CALL + "\n" + CALL.replace("get_weather", "get_time").replace('"city": "Paris", "days": 2', '"zone": "UTC"')
     + "\n", "", [PARIS, UTC]),
    (CALL + "\nDone.", "\nDone.", [PARIS]),
    ("<tool_call>\nnot json\n</tool_call> then", "<tool_call>\nnot json\n</tool_call> then", []),  # kept as written
    (CALL[: -len("</tool_call>")], "", [PARIS]),  # cut before its closing tag: still a whole call
    ("<tool_call>\n{\"name\": \"get_wea", "<tool_call>\n{\"name\": \"get_wea", []),  # cut inside: text
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>', "", [UTC]),
    # Qwen2.5-Coder's bare objects: calls when they name an offered function, answers otherwise
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}', "", [PARIS]),
    ('  {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n{"name": "get_time", "arguments": '
     '{"zone": "UTC"}}', "", [PARIS, UTC]),
    ('{"name": "Ada", "arguments": {}}', '{"name": "Ada", "arguments": {}}', []),
    ('```json\n{\n  "name": "get_time",\n  "arguments": {"zone": "UTC"}\n}\n```', "", [UTC]),  # fenced
    ('```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```\nDone.', "\nDone.", [UTC]),
    ('```json\n{"answer": 72}\n```', '```json\n{"answer": 72}\n```', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ('{"why": 1, "name": "get_time", "arguments": {"zone": "UTC"}}', '{"why": 1, "name": "get_time", "arguments": '
     '{"zone": "UTC"}}', []),
    # written name first, arguments next: a call as it comes, whatever follows
    ('{"name": "get_time", "arguments": {"zone": "UTC"}, "why": 1}', "", [UTC]),
    ('{"name": "get_time", "arguments": { "zone" :"UTC" } }', "", [UTC]),
    ('{"answer": 72}', '{"answer": 72}', []),
    # Llama 3's: "parameters", `;` between calls, maybe after <|python_tag|>
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "get_time", '
     '"parameters": {"zone": "UTC"}}', "", [PARIS, UTC]),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}; and more', "; and more", [UTC]),
    ('{"name": "get_time", "arguments": {}, "parameters": {"zone": "UTC"}}', "", [ToolCall("get_time", "{}")]),
    ('{"arguments": {}, "name": "get_time", "parameters": {"zone": "UTC"}}', '{"arguments": {}, "name": '
     '"get_time", "parameters": {"zone": "UTC"}}', []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("{not json", "{not json", []),
    # Mistral's: a JSON list of calls, maybe after [TOOL_CALLS]
    ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "get_time", "arguments": '
     '{"zone": "UTC"}}]', "", [PARIS, UTC]),
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}] Done.', " Done.", [UTC]),
    ('[{"answer": 72}]', '[{"answer": 72}]', []),
    ("[1, 2]", "[1, 2]", []),
    ("  \n", "  \n", []),
])
def test_split(text, content, calls):
    split = PARSER.split(text)
    assert (split.content, split.calls) == (content, calls)
    # A stream sees every prefix: what it shows of one is never taken back by a longer one, and the calls it sends
    # as they are written (a call's name, then its arguments piece by piece) add up to the whole reply's.
    shown, sent, stream, added, kept = "", [], CallsSent(), {}, CallStream()
    for end in range(len(text) + 1):
        part = PARSER.split(text[:end], final=end == len(text))
        assert PARSER.split(text[:end], final=end == len(text), stream=kept) == part  # what a stream keeps: the same
        assert part.content.startswith(shown) and part.calls[: len(sent)] == sent, (end, part)
        shown, sent = part.content, part.calls
        for delta in stream.deltas(part, PARSER):
            name, arguments = added.get(delta.index, ("", ""))
            added[delta.index] = (name + (delta.function.name or ""), arguments + delta.function.arguments)
    assert (shown, sent) == (content, calls)
    assert [ToolCall(*added[k]) for k in sorted(added)] == calls


def test_auto_reads_the_chat_template():
    tools, llama, plain = tiny_tokenizer(), tiny_tokenizer(), tiny_tokenizer()
    tools.chat_template, llama.chat_template = TOOLS_TEMPLATE, LLAMA_TEMPLATE
    assert resolve_tool_parser("auto", tools) == "hermes" and resolve_tool_parser("auto", plain) is None
    assert resolve_tool_parser("auto", llama) == "llama3_json"
    plain.chat_template = MISTRAL_TEMPLATE
    assert resolve_tool_parser("auto", plain) == "mistral"
    assert resolve_tool_parser("hermes", plain) == "hermes" and resolve_tool_parser("none", tools) is None
    with pytest.raises(R2RError, match="auto, hermes, llama3_json, mistral, none"):
        resolve_tool_parser("qwen", tools)


@pytest.fixture(scope="module")
def tool_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # as in Qwen's tokenizers: added, not special
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tool_engine(tool_tokenizer):
    # (long enough for the tools' JSON, which this tiny vocabulary spells nearly byte by byte)
    slm = TorchBackend(tiny_model(tool_tokenizer, hidden=32, seed=0, max_positions=2048), name="slm")
    llm = TorchBackend(tiny_model(tool_tokenizer, hidden=64, seed=1, max_positions=2048), name="llm")
    return Engine(slm, llm, tool_tokenizer, RandomPolicy(0.3, seed=0), verify="1")


@pytest.mark.parametrize("one", [True, False])
def test_the_call_grammar_holds_r2rs_output_to_calls(tool_engine, tool_tokenizer, one):
    """Greedy and sampled, each reply is calls of the offered functions with arguments of their schemas, tagged (the
    tags written as the tokenizer's own tokens) or bare."""
    fmt = call_format([WEATHER["function"], TIME["function"]], one)
    prompt = tool_engine.prompts.messages([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME])
    params = [SamplingParams(max_new_tokens=60, output_format=fmt)] + [
        SamplingParams(max_new_tokens=60, output_format=fmt, temperature=1.0, seed=s) for s in range(4)]
    opened, examined = tool_tokenizer.convert_tokens_to_ids("<tool_call>"), 0
    for p in params:
        gen = tool_engine.generate([prompt], p)[0]
        if gen.finish_reason == "length":  # a random model may write a long string argument
            continue
        examined += 1
        calls = PARSER.split(gen.text).calls
        assert calls and PARSER.split(gen.text).content == "", gen.text
        assert (opened in gen.token_ids) == gen.text.startswith("<tool_call>") and "<tool" not in tool_tokenizer.decode(
            [t for t in gen.token_ids if t != opened]), gen.text
        assert len(calls) == 1 or not one
        for call in calls:
            arguments = json.loads(call.arguments)
            if call.name == "get_weather":
                assert arguments["city"] in ("Paris", "Tokyo") and 1 <= arguments["days"] <= 9
            else:
                assert call.name == "get_time" and arguments == {"zone": arguments["zone"]}
    assert examined, "every reply ended on its length: none was examined"


@pytest.fixture(scope="module")
def llama_engine(tool_engine):
    """The tool engine's models with a template that teaches Llama 3's calls (and a policy of their own: the tool
    engine's draws stay as its tests expect them)."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # the same ids as the models'
    tokenizer.chat_template = LLAMA_TEMPLATE
    return Engine(tool_engine.slm, tool_engine.llm, tokenizer, RandomPolicy(0.3, seed=0), verify="1")


def test_the_llama3_call_grammar_holds_r2rs_output_to_calls(llama_engine):
    """Llama 3's syntax: bare objects with "parameters", `; ` between them, arguments held to their schemas."""
    prompt = llama_engine.prompts.messages([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME])
    examined = 0
    for one in (True, False):
        fmt = call_format([WEATHER["function"], TIME["function"]], one, "llama3_json")
        for p in [SamplingParams(max_new_tokens=60, output_format=fmt)] + [
                SamplingParams(max_new_tokens=60, output_format=fmt, temperature=1.0, seed=s) for s in range(3)]:
            gen = llama_engine.generate([prompt], p)[0]
            if gen.finish_reason == "length":
                continue
            examined += 1
            split = PARSER.split(gen.text)
            assert split.calls and split.content == "" and gen.text.startswith('{"name": "'), gen.text
            assert '"parameters": ' in gen.text and '"arguments"' not in gen.text and "<tool" not in gen.text
            assert (len(split.calls) == 1 or not one) and gen.text.count("}; {") == len(split.calls) - 1
            for call in split.calls:
                arguments = json.loads(call.arguments)
                assert arguments["city"] in ("Paris", "Tokyo") if call.name == "get_weather" else \
                    arguments["zone"] in ("UTC", "CET")
    assert examined, "every reply ended on its length: none was examined"


def test_a_llama3_template_gets_llama3_calls_through_the_server(llama_engine):
    with BackgroundServer(create_app(llama_engine, "llama", Limits(max_batch=2, max_tokens=160,
                                                             context_length=2048))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.list().data[0].model_extra["r2r"]["tool_call_parser"] == "llama3_json"
        kw = {"model": "llama", "tools": [WEATHER, TIME], "max_tokens": 160,
              "tool_choice": {"type": "function", "function": {"name": "get_time"}},
              "temperature": 0, "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
        whole = client.chat.completions.create(**kw)
        assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
        assert '"parameters": ' in llama_engine.tokenizer.decode(whole.model_extra["r2r"]["token_ids"])
        calls = whole_calls(whole.choices[0].message)
        assert len(calls) == 1 and calls[0]["name"] == "get_time"
        content, streamed_calls, finish = streamed(client.chat.completions.create(stream=True, **kw))
        assert (content, finish) == ("", "tool_calls")
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed_calls] == calls
        written = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
        auto = client.chat.completions.create(**{**kw, "tool_choice": "auto",
                                                 "extra_body": {"structured_outputs": {"choice": [written]}}})
        assert whole_calls(auto.choices[0].message) == [{"name": "get_time", "arguments": UTC.arguments}]


def test_a_mistral_template_gets_a_list_of_calls_with_ids_it_takes_back(tool_engine):
    """Mistral's syntax: a JSON list of calls (held to it by tool_choice, read from it in auto), whole and streamed;
    each call's id is 9 letters and digits, which its template checks when the calls are handed back."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # the same ids as the models'
    tokenizer.chat_template = MISTRAL_TEMPLATE
    engine = Engine(tool_engine.slm, tool_engine.llm, tokenizer, RandomPolicy(0.3, seed=0), verify="1")
    with BackgroundServer(create_app(engine, "mistral", Limits(max_batch=2, max_tokens=160,
                                                             context_length=2048))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.list().data[0].model_extra["r2r"]["tool_call_parser"] == "mistral"
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        kw = {"model": "mistral", "tools": [WEATHER, TIME], "max_tokens": 160, "tool_choice": "required",
              "temperature": 0, "messages": question}
        whole = client.chat.completions.create(**kw)
        text = tokenizer.decode(whole.model_extra["r2r"]["token_ids"], skip_special_tokens=True)
        assert whole.choices[0].finish_reason == "tool_calls" and text.startswith('[{"name": "') and text[-1] == "]"
        message = whole.choices[0].message
        assert message.tool_calls and all(len(c.id) == 9 and c.id.isalnum() for c in message.tool_calls)
        content, streamed_calls, finish = streamed(client.chat.completions.create(stream=True, **kw))
        assert (content, finish) == ("", "tool_calls") and all(len(c["id"]) == 9 for c in streamed_calls)
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed_calls] == whole_calls(message)
        answered = question + [message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls]
        follow_up = client.chat.completions.create(**{**kw, "tool_choice": "none", "messages": answered})
        prompt = httpx.post(srv.url + "/tokenize", json={"messages": answered, "tools": [WEATHER, TIME]}).json()
        assert follow_up.usage.prompt_tokens == prompt["count"]  # the template took the ids back
        assert all(f'"id": "{c.id}"' in tokenizer.decode(prompt["tokens"]) for c in message.tool_calls)
        written = '[{"name": "get_time", "arguments": {"zone": "UTC"}}]'
        auto = client.chat.completions.create(**{**kw, "tool_choice": "auto",
                                                 "extra_body": {"structured_outputs": {"choice": [written]}}})
        assert whole_calls(auto.choices[0].message) == [{"name": "get_time", "arguments": UTC.arguments}]


@pytest.fixture(scope="module")
def client(tool_engine):
    app = create_app(tool_engine, "tools", Limits(max_batch=4, max_tokens=160, context_length=2048))
    with BackgroundServer(app) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, stream=False, messages=None, **kw):
    messages = messages or [{"role": "user", "content": "What is the weather in Paris?"}]
    return client.chat.completions.create(model="tools", messages=messages, max_tokens=160, temperature=0,
                                          stream=stream, **kw)


def streamed(chunks):
    """A stream's content and calls, put together as a client does (arguments added up per call index)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def whole_calls(message):
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_required_and_named_calls_whole_and_streamed(client, choice, parallel):
    kw = {"tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": parallel}
    whole = ask(client, **kw)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    calls = whole_calls(message)
    assert calls and all(c.id.startswith("call_") for c in message.tool_calls)
    assert len({c.id for c in message.tool_calls}) == len(calls)
    if not parallel or isinstance(choice, dict):
        assert len(calls) == 1
    if isinstance(choice, dict):
        assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")
    content, streamed_calls, finish = streamed(ask(client, stream=True, **kw))
    assert content == "" and finish == "tool_calls"
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed_calls] == calls
    assert all(c["id"].startswith("call_") for c in streamed_calls)


def test_auto_reads_the_calls_a_reply_writes(client, tool_tokenizer):
    """A reply held to text with a call in it (as a model that calls a tool would write it) comes back as content
    and a call, whole and streamed; a reply without one is plain content."""
    written = "Let me look.\n" + CALL
    kw = {"tools": [WEATHER], "extra_body": {"structured_outputs": {"choice": [written]}}}
    whole = ask(client, **kw)
    message = whole.choices[0].message
    assert message.content == "Let me look.\n" and whole_calls(message) == [
        {"name": "get_weather", "arguments": PARIS.arguments}]
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = list(ask(client, stream=True, **kw))
    content, calls, finish = streamed(chunks)
    assert (content, [c["name"] for c in calls], finish) == ("Let me look.\n", ["get_weather"], "tool_calls")
    assert calls[0]["arguments"] == PARIS.arguments
    pieces = [call.function.arguments for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert len(pieces) > 2 and "".join(pieces) == PARIS.arguments  # the arguments come as they are written
    plain = ask(client, tools=[WEATHER], extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    assert plain.choices[0].message.content == "It is sunny." and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_ends_the_reply_at_the_first_call(client):
    twice = CALL + "\n" + CALL.replace("Paris", "Tokyo")
    kw = {"tools": [WEATHER], "parallel_tool_calls": False, "extra_body": {"structured_outputs": {"choice": [twice]}}}
    whole = ask(client, **kw)
    assert whole_calls(whole.choices[0].message) == [{"name": "get_weather", "arguments": PARIS.arguments}]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.usage.completion_tokens < len(ask(client, tools=[WEATHER], extra_body=kw["extra_body"])
                                               .model_extra["r2r"]["token_ids"])  # it stopped there


def test_the_prompt_holds_the_tools_earlier_calls_and_their_answers(client, tool_engine):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}]
    out = ask(client, messages=history, tools=[WEATHER])
    expected = [*history[:3], {"role": "system", "content": "Be brief."}]
    expected[1] = {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
    ids = tool_engine.prompts.messages(expected, tools=[WEATHER])
    assert out.usage.prompt_tokens == len(ids)
    text = tool_engine.tokenizer.decode(ids)
    assert '"arguments": {"city": "Paris", "days": 2}}' in text and "<tool_response>\nsunny" in text
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the tools, in the system turn
    # tool_choice none: the tools stay out of the prompt
    none = ask(client, messages=history[:1], tools=[WEATHER], tool_choice="none")
    assert none.usage.prompt_tokens == ask(client, messages=history[:1]).usage.prompt_tokens


@pytest.mark.parametrize("fields, param, says", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "offers no tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "leave response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "cannot be followed"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name", "pattern"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
    ({"messages": [{"role": "tool", "tool_call_id": "1"}]}, "messages.0", "content is missing"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", None),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_what_cannot_be_done_is_a_400_naming_the_field(client, fields, param, says):
    body = {"model": "tools", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/chat/completions", body=body, cast_to=object)  # as sent: the typed call checks some itself
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"].startswith(param), error
    assert says is None or says in error["message"], error


def test_a_model_whose_template_takes_no_tools_refuses_them(slm, tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    app = create_app(Engine(slm, None, tokenizer), "plain", Limits(max_batch=2, max_tokens=8, context_length=256))
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser hermes") as refused:
            client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}],
                                           tools=[WEATHER])
        assert refused.value.body["param"] == "tools"
        assert client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}],
                                              tools=[WEATHER], tool_choice="none", max_tokens=2).choices
        assert client.models.list().data[0].model_extra["r2r"]["tool_call_parser"] is None



def test_a_template_that_cannot_write_a_message_is_a_400_not_a_500(slm):
    """A template that adds up text (as Llama's do) meets an assistant message whose content is null (calls only):
    transformers leaves the key out, and the template's error is the client's 400."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}\n{% endfor %}"
    app = create_app(Engine(slm, None, tokenizer), "adds", Limits(max_batch=2, max_tokens=8, context_length=256))
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="the chat template refused these messages"):
            client.chat.completions.create(model="adds", messages=history, max_tokens=2)
        assert client.chat.completions.create(model="adds", messages=history[:1], max_tokens=2).choices


def test_a_streamed_call_is_read_once_not_again_from_its_start_at_every_token(monkeypatch):
    """A call of 16,000 characters streamed a few characters at a time: with what the stream keeps, each character
    of its arguments is compacted once (without it, every token compacted them all again: 2.3 s of event-loop time
    for such a call), and the call that closed before it is parsed once, not again at every token."""

    class Counting(Compactor):
        fed = 0

        def __call__(self, text):
            self.fed += len(text) - (len(self.raw) if text.startswith(self.raw) else 0)
            return super().__call__(text)

    parsed_calls = []
    parse = ToolParser._call
    monkeypatch.setattr(ToolParser, "_call", lambda self, *a, **k: parsed_calls.append(a[0]) or parse(self, *a, **k))
    arguments = json.dumps({"text": "word " * 3200})
    text = CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": ' + arguments
    stream = CallStream()
    stream.compact = Counting()
    for end in [*range(len(CALL), len(text), 4), len(text)]:
        split = PARSER.split(text[:end], final=False, stream=stream)
    assert split.calls == [PARIS] and split.writing == ToolCall("get_time", compact_json(arguments))
    assert stream.compact.fed <= len(arguments) + 8, f"{stream.compact.fed} characters compacted for {len(arguments)}"
    assert len(parsed_calls) == 1
