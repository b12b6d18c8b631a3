"""Tool calling on the default pair, through the server (in this process, the openai client on loopback): the SLM
alone, the LLM alone and R2R (the shipped router, the server's verification) answer the same requests with four
tools offered and `tool_choice: auto`, each request every way in turn, the order rotating, greedy. Requests that a
tool serves (weather, time, currency, search; cities, amounts and currencies drawn from fixed lists with a fixed
seed) expect one call of that tool with those arguments; GSM8K dev items expect an answer in text (no tool
computes). Prints, for each way, the right replies (the expected call and arguments; an answer in text, neither a
call nor a call of a function that was not offered), the calls read (tagged or bare), the paired sign test on the
requests only one way gets right, seconds per request (the ~600-token prompt with the tools is read for each) and
the LLM's share. `--summary-of FILE`: the summary again from a run's rows. `--stream`: R2R alone, each request
answered whole and then streamed: when a streamed call's name arrives, when its arguments are complete and when the
stream ends (seconds from the request), how many pieces the arguments came in, and whether the calls a client adds
up from the stream are the whole reply's.

    python scripts/tool-check.py --prompts 30 --plain 10 --out runs/tool-check.json
    python scripts/tool-check.py --stream --prompts 12 --out runs/tool-stream.json
"""

import argparse
import json
import random
import re
import time

import openai

from roads_to_rome.data.benchmarks import gsm8k
from roads_to_rome.data.stats import sign_test
from roads_to_rome.hardware import measured_on
from roads_to_rome.models import EngineConfig, load_engine
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app


def tool(name, description, properties, required):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    tool("get_weather", "Get the current weather in a city",
         {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    tool("get_time", "Get the current local time in a city", {"city": {"type": "string"}}, ["city"]),
    tool("convert_currency", "Convert an amount of money from one currency to another",
         {"amount": {"type": "number"}, "from_currency": {"type": "string", "description": "ISO code, e.g. USD"},
          "to_currency": {"type": "string", "description": "ISO code, e.g. EUR"}},
         ["amount", "from_currency", "to_currency"]),
    tool("search_web", "Search the web for recent news", {"query": {"type": "string"}}, ["query"]),
]
CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Toronto", "Mumbai", "Sydney", "Cairo", "Berlin"]
CURRENCIES = {"USD": "US dollars", "EUR": "euros", "JPY": "Japanese yen", "GBP": "British pounds"}
TOPICS = ["the Mars sample return mission", "electric car sales in Norway", "the latest Python release",
          "coral reef bleaching", "the price of copper"]


def tool_requests(n: int, seed: int = 0) -> list[dict]:
    """`n` requests a tool serves, each with the call it expects: (name, {argument: value}) to compare."""
    rng, out = random.Random(seed), []
    for k in range(n):
        city = rng.choice(CITIES)
        kind = k % 4
        if kind == 0:
            text = rng.choice(["What's the weather like in {c} right now?", "Is it raining in {c} today?",
                               "How warm is it in {c} at the moment?"]).format(c=city)
            out.append({"question": text, "call": ("get_weather", {"city": city})})
        elif kind == 1:
            text = rng.choice(["What time is it in {c}?", "Tell me the current local time in {c}."]).format(c=city)
            out.append({"question": text, "call": ("get_time", {"city": city})})
        elif kind == 2:
            source, target = rng.sample(sorted(CURRENCIES), 2)
            amount = rng.choice([20, 75, 120, 300, 1500])
            text = f"How much is {amount} {CURRENCIES[source]} in {CURRENCIES[target]}?"
            out.append({"question": text, "call": ("convert_currency", {"amount": amount, "from_currency": source,
                                                                        "to_currency": target})})
        else:
            topic = TOPICS[(k // 4) % len(TOPICS)]
            out.append({"question": f"Find the latest news about {topic}.", "call": ("search_web", None)})
    return out


def invented(content: str | None) -> bool:
    """A reply that calls a function nobody offered: a JSON object with a "name", maybe fenced, where an answer was
    due."""
    text = re.sub(r"^\s*```(?:json)?\s*", "", content or "")
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return bool(re.match(r'\{\s*"name"', text))  # an object a model broke (a comment, arithmetic)
    return isinstance(value, dict) and "name" in value


def right(expected, calls: list[dict], content: str | None) -> bool:
    """The expected call alone, with the expected arguments (strings compared without case; a search's query is
    free); or an answer in text where no tool serves."""
    if expected is None:
        return not calls and not invented(content)
    if len(calls) != 1 or calls[0]["name"] != expected[0]:
        return False
    try:
        arguments = json.loads(calls[0]["arguments"])
    except ValueError:
        return False
    for key, value in (expected[1] or {}).items():
        got = arguments.get(key)
        if isinstance(value, str) and not (isinstance(got, str) and got.strip().lower() == value.lower()):
            return False
        if isinstance(value, int | float) and not (isinstance(got, int | float) and float(got) == float(value)):
            return False
    return True


parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=30, help="requests a tool serves")
parser.add_argument("--plain", type=int, default=10, help="GSM8K items 0..N-1, which no tool serves")
parser.add_argument("--tokens", type=int, default=128)
parser.add_argument("--out", help="JSON file for every row and the summary")
parser.add_argument("--summary-of", help="a run's JSON file: summarize its rows again (nothing is run)")
parser.add_argument("--stream", action="store_true", help="R2R alone, whole then streamed: when a call arrives")
args = parser.parse_args()


def streamed_calls(client, question: str) -> dict:
    """One streamed answer: the calls a client adds up, and when their pieces came (seconds from the request)."""
    start, calls, named, complete, pieces = time.perf_counter(), {}, None, None, 0
    for chunk in client.chat.completions.create(
            model="r2r", messages=[{"role": "user", "content": question}], tools=TOOLS, temperature=0,
            max_tokens=args.tokens, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
            named = named or time.perf_counter() - start
            pieces += bool(delta.function.arguments)
            try:
                json.loads(entry["arguments"])
                complete = complete or time.perf_counter() - start
            except ValueError:
                pass
    return {"calls": [calls[k] for k in sorted(calls)], "named_s": named, "arguments_complete_s": complete,
            "end_s": time.perf_counter() - start, "argument_pieces": pieces}


def summarize(rows: list[dict], ways: list[str]) -> dict:
    summary = {}
    for row in rows:
        row["right"] = right(row["expected"], row["calls"], row["content"])
    for name in ways:
        mine = [r for r in rows if r["way"] == name]
        tokens, seconds = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
        served, plain = [r for r in mine if r["expected"] is not None], [r for r in mine if r["expected"] is None]
        summary[name] = {"right": sum(r["right"] for r in mine), "of": len(mine),
                         "right_where_a_tool_serves": sum(r["right"] for r in served), "tool_requests": len(served),
                         "answered_in_text_where_none_serves": sum(r["right"] for r in plain),
                         "called_an_offered_tool_where_none_serves": sum(bool(r["calls"]) for r in plain),
                         "invented_a_function_where_none_serves": sum(invented(r["content"]) for r in plain),
                         "plain_requests": len(plain), "called": sum(bool(r["calls"]) for r in mine),
                         "tagged": sum(r["tagged"] for r in mine), "seconds_per_request": seconds / len(mine),
                         "tokens_per_request": tokens / len(mine),
                         "llm_rate": sum(r["llm_tokens"] for r in mine) / tokens}
    by_way = {name: {r["k"]: r["right"] for r in rows if r["way"] == name} for name in ways}
    for a, b in (("r2r", "slm"), ("r2r", "llm"), ("llm", "slm")):
        only_a = sum(by_way[a][k] and not by_way[b][k] for k in by_way[a])
        only_b = sum(by_way[b][k] and not by_way[a][k] for k in by_way[a])
        summary[f"{a}_vs_{b}"] = {f"only_{a}": only_a, f"only_{b}": only_b, "sign_test_p": sign_test(only_a, only_b)}
    summary["r2r_seconds_over_llm"] = summary["r2r"]["seconds_per_request"] / summary["llm"]["seconds_per_request"]
    return summary


if args.summary_of:
    with open(args.summary_of) as f:
        run = json.load(f)
    summary = {**summarize(run["rows"], ["slm", "llm", "r2r"]), "settings": run["summary"]["settings"]}
    print(json.dumps(summary, indent=1))
    raise SystemExit

requests = tool_requests(args.prompts) + [{"question": item["question"], "call": None}
                                          for item in gsm8k()[: args.plain]]
engine = load_engine(EngineConfig())
if args.stream:
    rows = []
    with BackgroundServer(create_app(engine, "r2r", Limits(max_batch=1, max_tokens=args.tokens))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        client.chat.completions.create(model="r2r", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        for k, request in enumerate(tool_requests(args.prompts)):
            whole = client.chat.completions.create(
                model="r2r", messages=[{"role": "user", "content": request["question"]}], tools=TOOLS,
                temperature=0, max_tokens=args.tokens)
            expected = [{"name": c.function.name, "arguments": c.function.arguments}
                        for c in whole.choices[0].message.tool_calls or []]
            row = {"k": k, "question": request["question"], "whole_calls": expected, **streamed_calls(
                client, request["question"])}
            row["same_as_whole"] = row["calls"] == expected
            rows.append(row)
            print(k, {key: row[key] for key in ("named_s", "arguments_complete_s", "end_s", "argument_pieces",
                                                "same_as_whole")}, flush=True)
    called = [r for r in rows if r["calls"]]
    summary = {"requests": len(rows), "with_calls": len(called), "same_as_whole": sum(r["same_as_whole"] for r in rows),
               "argument_pieces_per_call": sum(r["argument_pieces"] for r in called) / max(len(called), 1),
               **{f"mean_{key}": sum(r[key] for r in called) / max(len(called), 1)
                  for key in ("named_s", "arguments_complete_s", "end_s")},
               "named_over_end": sum(r["named_s"] / r["end_s"] for r in called) / max(len(called), 1),
               "settings": {**vars(args), "verify": engine.verify, **measured_on(engine)}}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    raise SystemExit
ways = {"slm": {"r2r_policy": "slm"}, "llm": {"r2r_policy": "llm"}, "r2r": {}}
rows = []
app = create_app(engine, "r2r", Limits(max_batch=1, max_tokens=args.tokens))
with BackgroundServer(app) as server:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    client.chat.completions.create(model="r2r", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    for k, request in enumerate(requests):
        names = list(ways)
        for name in names[k % len(names):] + names[: k % len(names)]:
            start = time.perf_counter()
            out = client.chat.completions.create(
                model="r2r", messages=[{"role": "user", "content": request["question"]}], tools=TOOLS,
                temperature=0, max_tokens=args.tokens, extra_body=ways[name])
            seconds = time.perf_counter() - start
            message = out.choices[0].message
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
            text = engine.tokenizer.decode(out.model_extra["r2r"]["token_ids"])
            rows.append({"k": k, "way": name, "question": request["question"], "expected": request["call"],
                         "calls": calls, "content": message.content, "tagged": "<tool_call>" in text,
                         "finish_reason": out.choices[0].finish_reason,
                         "right": right(request["call"], calls, message.content),
                         "tokens": out.usage.completion_tokens, "llm_tokens": out.usage.model_extra["llm_tokens"],
                         "seconds": seconds})
        print(f"{k}: {request['question'][:60]!r}: " + ", ".join(
            f"{r['way']} {'right' if r['right'] else 'WRONG'} {[c['name'] for c in r['calls']]}"
            for r in rows[-len(ways):]), flush=True)

summary = summarize(rows, list(ways))
summary["settings"] = {**vars(args), "verify": engine.verify, "tools": [t["function"]["name"] for t in TOOLS],
                       **measured_on(engine)}
print(json.dumps(summary, indent=1))
if args.out:
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
