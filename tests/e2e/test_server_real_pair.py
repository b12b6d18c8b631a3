"""The hardened server on the real default pair (llama.cpp), on loopback: admission against the shared KV
pool, a stream that keeps going while a long prompt is read, bad requests that hurt no one, and the same
answer for the same request on an idle server. Needs `r2r models prepare`; scripts/server-checks.py runs
the full list against `r2r serve`."""

import importlib.util
import json
import threading
import time

import httpx
import pytest
from conftest import assert_idle_soon

from roads_to_rome.models import load_engine
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                                  reason="llama-cpp-python is not installed")]
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


@pytest.fixture(scope="module")
def url():
    engine = load_engine(device="cpu", backend="llamacpp", llama={"max_rows": 4, "n_ctx": 4096})
    with BackgroundServer(create_app(engine, "r2r", Limits(max_batch=4, max_tokens=2048))) as srv:
        yield srv.url + "/v1/chat/completions"


def body(content=QUESTION, **kw):
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 48, **kw}


def stream_times(url, payload, times, errors, enough=None):
    """Stream `payload`, noting when each token arrives, until its end or until `enough` is set (then hang up)."""
    with httpx.stream("POST", url, json={**payload, "stream": True}, timeout=600) as response:
        for line in response.iter_lines():
            if enough is not None and enough.is_set():
                break
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                elif event.get("r2r"):
                    times.append(time.monotonic())


def test_the_hardened_server_on_the_real_pair(url):
    answer = httpx.post(url, json=body(), timeout=600).json()["choices"][0]["message"]["content"]
    assert httpx.post(url, json=body(), timeout=600).json()["choices"][0]["message"]["content"] == answer  # idle
    # Beyond the 4096-token pool: refused at once, not after a prefill.
    start = time.monotonic()
    response = httpx.post(url, json=body("clips " * 5000), timeout=600)
    assert response.status_code == 400 and time.monotonic() - start < 5
    # A stream keeps getting tokens while a ~1,100-token prompt is read (64-token chunks), and a bad seed is
    # refused without touching it.
    times, errors, enough = [], [], threading.Event()
    # Unverified, so that each token streams as it is written (verification sends them at the LLM's catch-ups).
    running = threading.Thread(target=stream_times, args=(url, body(max_tokens=400, r2r_verify="off"), times, errors,
                                                          enough))
    running.start()
    while len(times) < 3:
        time.sleep(0.05)
    assert httpx.post(url, json=body(seed=2**70), timeout=60).status_code == 400
    submitted = time.monotonic()
    newcomer_times = []
    stream_times(url, body(" ".join([QUESTION] * 35), max_tokens=4), newcomer_times, errors)
    enough.set()  # the running stream has shown what it had to; its client hangs up, which frees its slot
    running.join()
    assert not errors and newcomer_times
    assert sum(submitted < t < newcomer_times[0] for t in times) >= 5
    assert_idle_soon(url.removesuffix("/v1/chat/completions"))


def test_the_playground_compares_the_three_systems_on_the_real_pair(url, browser):
    page = browser.new_page()
    page.goto(url.removesuffix("/v1/chat/completions") + "/")
    page.check("#compare")
    page.fill("#maxTokens", "64")
    page.fill("#question", QUESTION + " Reason step by step.")
    page.press("#question", "Enter")
    page.wait_for_function("[...document.querySelectorAll('.pane .status')].every(s => "
                           "s.textContent.startsWith('finished in'))", timeout=300_000)
    shares = {}
    for system in ("slm", "r2r", "llm"):
        pane = page.locator(f'.pane[data-system="{system}"]')
        stats = pane.locator(".stats").text_content()
        assert f"{pane.locator('.raw span').count()} tokens" in stats, stats
        shares[system] = float(stats.split("LLM share ")[1].split("%")[0])
        raw = pane.locator(".raw").text_content()
        if "\\[" in raw and "\\]" in raw or "\\(" in raw and "\\)" in raw:  # the model wrote a formula
            assert pane.locator(".rendered .katex").count() >= 1
    assert shares["slm"] == 0 and shares["llm"] == 100 and shares["r2r"] < 100
    page.close()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


def test_the_real_pair_calls_a_tool(url):
    """Qwen2.5-Coder answers a question its tool serves with a call (written as a bare object, which the parser
    reads); `required` holds it to the tagged syntax its template teaches, with the same call; a stream hands the
    same call."""
    ask = body("What's the weather like in Paris today?", max_tokens=64, tools=[WEATHER])
    for extra in ({}, {"tool_choice": "required"}, {"stream": True}):
        if extra.get("stream"):
            calls, finish = {}, None
            with httpx.stream("POST", url, json={**ask, **extra}, timeout=600) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and (choices := json.loads(line[6:]).get("choices")):
                        for call in choices[0]["delta"].get("tool_calls") or []:  # added up, as clients do
                            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                            entry["name"] += call["function"].get("name") or ""
                            entry["arguments"] += call["function"].get("arguments") or ""
                        finish = choices[0]["finish_reason"] or finish
            message = {"tool_calls": [{"function": calls[k]} for k in sorted(calls)]}
        else:
            choice = httpx.post(url, json={**ask, **extra}, timeout=600).json()["choices"][0]
            message, finish = choice["message"], choice["finish_reason"]
        assert finish == "tool_calls" and len(message["tool_calls"]) == 1, (extra, message)
        function = message["tool_calls"][0]["function"]
        assert function["name"] == "get_weather" and json.loads(function["arguments"])["city"] == "Paris", extra


def test_the_real_pair_through_the_responses_api_calls_a_tool_and_answers_with_its_result(url):
    """An agent's loop through OpenAI's Responses API (the openai client's `responses.create`): asked the weather,
    the pair's reply is a `function_call` item; handed the tool's answer after it (`previous_response_id`, with
    `tool_choice: "none"`: offered the tool again, this 1.5B model calls it again), it answers with a message that
    uses it, whole and streamed alike; the prompt is the chat's of the same turns."""
    import openai

    client = openai.OpenAI(base_url=url.removesuffix("/chat/completions"), api_key="unused", max_retries=0,
                           timeout=600)
    tool = {"type": "function", **WEATHER["function"]}
    asked = client.responses.create(model="r2r", input="What's the weather like in Paris today?", tools=[tool],
                                    max_output_tokens=64, temperature=0)
    [call] = [item for item in asked.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris", asked.output
    kw = {"model": "r2r", "previous_response_id": asked.id, "tools": [tool], "tool_choice": "none",
          "max_output_tokens": 64,
          "temperature": 0, "input": [{"type": "function_call_output", "call_id": call.call_id,
                                       "output": "Sunny, 21 degrees Celsius"}]}
    answered = client.responses.create(**kw)
    assert answered.status == "completed" and "21" in answered.output_text, answered.output
    turns = [{"role": "user", "content": "What's the weather like in Paris today?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                    "function": {"name": call.name,
                                                                                 "arguments": call.arguments}}]},
             {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 degrees Celsius"}]
    chat = httpx.post(url, json={"messages": turns, "max_tokens": 64, "temperature": 0}, timeout=600).json()
    assert chat["usage"]["prompt_tokens"] == answered.usage.input_tokens
    streamed = list(client.responses.create(stream=True, **kw))
    assert streamed[-1].type == "response.completed"
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == answered.output_text


def test_the_real_pair_through_the_messages_api_uses_a_tool_and_answers_with_its_result(url):
    """The same agent's loop through Anthropic's Messages API (the anthropic client): a `tool_use` block, then,
    handed the `tool_result`, a text answer that uses it; the prompt is the chat's of the same turns."""
    import anthropic

    client = anthropic.Anthropic(base_url=url.removesuffix("/v1/chat/completions"), api_key="unused", max_retries=0,
                                 timeout=600)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    ask = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    asked = client.messages.create(model="r2r", max_tokens=64, tools=[tool], messages=ask,
                                   extra_body={"temperature": 0})
    [call] = [block for block in asked.content if block.type == "tool_use"]
    assert asked.stop_reason == "tool_use" and call.name == "get_weather" and call.input["city"] == "Paris"
    turns = ask + [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in asked.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": "Sunny, 21 degrees Celsius"}]}]
    answered = client.messages.create(model="r2r", max_tokens=64, tools=[tool], tool_choice={"type": "none"},
                                      messages=turns, extra_body={"temperature": 0})
    assert answered.stop_reason == "end_turn" and "21" in answered.content[-1].text, answered.content
