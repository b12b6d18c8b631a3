"""What a server's structured outputs cost to compile with the default pair's tokenizer (151,936 tokens), to size
`r2r serve --max-compile-seconds`: the tokenizer as llguidance reads it (built once per server, at the first request
that asks for a format, and not counted against that request's limit), then JSON schemas of growing size (many
objects with typed fields, as a large API's schema has; every one required, or the first 50 only: optional fields
cost llguidance more), each checked and compiled as a request's is (`Engine.compile_format`: validate, then the
matcher). Medians of `--repeat` compiles; prints the processor.

    python scripts/compile-times.py --kib 10,100,300,500 --repeat 3 --out runs/compile-times.json
"""

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer

from roads_to_rome.core.grammar import GrammarWalk, OutputFormat, grammar_tokenizer
from roads_to_rome.hardware import measured_on
from roads_to_rome.models import DEFAULT_SLM
from roads_to_rome.models.packaged import tokenizer_dir

parser = argparse.ArgumentParser()
parser.add_argument("--kib", default="10,100,300,500", help="schema sizes, KiB of JSON")
parser.add_argument("--repeat", type=int, default=3)
parser.add_argument("--vocab-size", type=int, default=151936, help="the models' logits (the SLM's config)")
parser.add_argument("--out", default=None)
args = parser.parse_args()


def schema_of(kib: int, required: int | None) -> dict:
    """About `kib` KiB of JSON schema: records of a name, a count, a kind and a list of tags; the first `required`
    of them required (None: all)."""
    record = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "count": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["alpha", "beta", "gamma"]}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "kind"], "additionalProperties": False}
    each = len(json.dumps({"record_00000": record}))
    names = [f"record_{i:05d}" for i in range(max(1, kib * 1024 // each))]
    return {"type": "object", "properties": dict.fromkeys(names, record), "required": names[:required]}


tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(DEFAULT_SLM))
started = time.perf_counter()
read = grammar_tokenizer(tokenizer, args.vocab_size, [tokenizer.eos_token_id])
record = {**measured_on(), "grammar_tokenizer_s": time.perf_counter() - started, "schemas": []}
print(f"{record['processor']}\nthe tokenizer as llguidance reads it: {record['grammar_tokenizer_s']:.2f} s (once)")
for kib, required in [(kib, required) for required in (None, 50) for kib in map(int, args.kib.split(","))]:
    spec = json.dumps(schema_of(kib, required))
    times = []
    for _ in range(args.repeat):
        output_format = OutputFormat.json_schema(spec)  # (a new one each time: the grammar is cached on it)
        started = time.perf_counter()
        output_format.validate()
        GrammarWalk(output_format, read)
        times.append(time.perf_counter() - started)
    record["schemas"].append({"kib": len(spec) / 1024, "required": required, "compile_s": statistics.median(times),
                              "runs": times})
    print(f"{len(spec) / 1024:6.0f} KiB schema, {'all' if required is None else required} fields required: "
          f"{statistics.median(times):6.2f} s to compile (median of {len(times)})")
if args.out:
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
