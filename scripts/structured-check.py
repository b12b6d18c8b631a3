"""Structured outputs on the default pair: GSM8K dev items asked for a JSON answer ({"reasoning", "answer"}), R2R
with the JSON schema enforced (with any whitespace between JSON's tokens, vLLM's default, and with at most four
spaces or newlines) against R2R asked for it in the prompt only, side by side (each item every way in turn, the
order rotating, greedy, the shipped router and the engine's defaults). Prints, for each, how many
answers are valid JSON of the schema (leniently: a fenced block counts), how many are right (an invalid answer is
wrong), the paired sign test on the items only one gets right, tokens/s and their ratio, and the time the schema's
masks took per token.

    python scripts/structured-check.py --prompts 20 --tokens 400 --out runs/structured-check.json
"""

import argparse
import json
import time

from roads_to_rome.core import grammar
from roads_to_rome.core.grammar import OutputFormat
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data.answers import math_equal
from roads_to_rome.data.benchmarks import gsm8k
from roads_to_rome.data.stats import sign_test
from roads_to_rome.hardware import measured_on
from roads_to_rome.models import EngineConfig, load_engine

SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "number"}},
          "required": ["reasoning", "answer"], "additionalProperties": False}
WHITESPACE = "[ \n]{0,4}"
ASK = ('\nReply with JSON only, as {"reasoning": "<your steps>", "answer": <the final number>}.')

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=20, help="GSM8K items 0..N-1")
parser.add_argument("--tokens", type=int, default=400)
parser.add_argument("--out", help="JSON file for every row and the summary")
args = parser.parse_args()

mask_seconds = [0.0, 0]  # time in the schema's masks, calls
allowed = grammar.GrammarWalk.allowed


def timed_allowed(self, output_ids):
    start = time.perf_counter()
    try:
        return allowed(self, output_ids)
    finally:
        mask_seconds[0] += time.perf_counter() - start
        mask_seconds[1] += 1


grammar.GrammarWalk.allowed = timed_allowed


def graded(text: str, reference: str) -> tuple[bool, bool]:
    """(valid JSON of the schema, right answer). Leniently for the answers only asked for JSON: the outermost braces'
    text is read when the whole is not JSON (a model may wrap it in a code fence)."""
    reply = None
    for candidate in (text, text[text.find("{"): text.rfind("}") + 1]):
        try:
            reply = json.loads(candidate)
            break
        except ValueError:
            continue
    answer = reply.get("answer") if isinstance(reply, dict) else None
    valid = (isinstance(reply, dict) and set(reply) == {"reasoning", "answer"} and isinstance(answer, int | float)
             and not isinstance(answer, bool))
    return valid, valid and math_equal(str(reply["answer"]), reference)


engine = load_engine(EngineConfig())
engine.generate([engine.prompts.chat("Hi")], SamplingParams(max_new_tokens=4))  # warm-up
_ = engine.grammar_tokenizer  # built once, before the timings
ways = {"asked in the prompt": None, "schema enforced": OutputFormat.json_schema(SCHEMA),
        "schema, bounded whitespace": OutputFormat.json_schema(SCHEMA, whitespace=WHITESPACE)}
rows = []
for k, item in enumerate(gsm8k()[: args.prompts]):
    prompt = engine.prompts.chat(item["question"] + ASK)
    names = list(ways)
    for name in names[k % len(names):] + names[: k % len(names)]:
        params = SamplingParams(max_new_tokens=args.tokens, output_format=ways[name])
        start = time.perf_counter()
        gen = engine.generate([prompt], params)[0]
        seconds = time.perf_counter() - start
        valid, right = graded(gen.text, item["answer"])
        rows.append({"id": item["id"], "way": name, "tokens": len(gen.token_ids), "seconds": seconds,
                     "llm_tokens": gen.llm_tokens, "finish_reason": gen.finish_reason, "valid": valid,
                     "correct": right, "text": gen.text})
    print(f"item {item['id']}: " + ", ".join(f"{r['way']}: valid {r['valid']}, right {r['correct']}, "
                                            f"{r['tokens']} tokens {r['seconds']:.1f} s" for r in rows[-len(ways):]),
          flush=True)

summary = {}
for name in ways:
    mine = [r for r in rows if r["way"] == name]
    tokens, seconds = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
    summary[name] = {"items": len(mine), "valid": sum(r["valid"] for r in mine),
                     "correct": sum(r["correct"] for r in mine), "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds, "llm_rate": sum(r["llm_tokens"] for r in mine) / tokens}
asked = {r["id"]: r for r in rows if r["way"] == "asked in the prompt"}
for name in list(ways)[1:]:  # each enforced way against asking, on the same items
    enforced = [r for r in rows if r["way"] == name]
    only_enforced = sum(r["correct"] and not asked[r["id"]]["correct"] for r in enforced)
    only_asked = sum(asked[r["id"]]["correct"] and not r["correct"] for r in enforced)
    summary[name].update({"only_right_here": only_enforced, "only_right_asked": only_asked,
                          "sign_test_p": sign_test(only_enforced, only_asked),
                          "valid_here_only": sum(r["valid"] and not asked[r["id"]]["valid"] for r in enforced),
                          "valid_asked_only": sum(asked[r["id"]]["valid"] and not r["valid"] for r in enforced),
                          "tokens_per_s_over_asked": summary[name]["tokens_per_s"]
                          / summary["asked in the prompt"]["tokens_per_s"]})
    summary[name]["valid_sign_test_p"] = sign_test(summary[name]["valid_here_only"], summary[name]["valid_asked_only"])
summary["mask_us_per_call"] = 1e6 * mask_seconds[0] / max(mask_seconds[1], 1)
summary["mask_calls"] = mask_seconds[1]
enforced_seconds = sum(r["seconds"] for r in rows if r["way"] != "asked in the prompt")
summary["mask_share_of_enforced_time"] = mask_seconds[0] / enforced_seconds
summary["settings"] = {**vars(args), "verify": engine.verify, "schema": SCHEMA, "ask": ASK, "whitespace": WHITESPACE,
                       **measured_on(engine)}
print(json.dumps(summary, indent=1))
if args.out:
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
