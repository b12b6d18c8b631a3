"""Where a model's text states its answer, and whether two math answers are equal (math-verify): what evaluation
grades with and what the label pipeline's answer judge compares."""

from __future__ import annotations

import re


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
