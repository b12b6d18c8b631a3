"""The routing-label pipeline (the paper's section 3.1, README "Routing labels"), one resumable step after another:

  responses      the LLM answers each prompt (greedy, chat template, bounded length); with --writer slm the SLM
                 does (on-policy labels: the prefixes the router meets when it runs)
  prefill        the SLM reads each response once: its argmax and entropy at every position; for the margin
                 judge the LLM reads it too: its argmax and how many nats it ranks the SLM's token below it
  continuations  at each position where the SLM's argmax differs, the LLM continues from the
                 SLM's token to the end of the sentence (the LLM's own branch is the response), or for
                 the answer judge to the end of its answer (stopping early once it re-joins the response);
                 the margin judge needs none
  judgements     a judge says whether the two branches are neutral or divergent (the margin judge: whether
                 the LLM's log-probability gap exceeds --margin nats, the tokens verification would reject)
  labels         every response token labelled identical / neutral / divergent (/ unparseable)

Each step writes Parquet parts under OUT/<step>/ and skips what its parts already hold: kill it at
any moment, run it again, and the result is that of an uninterrupted run (a part is written to a
temporary name and renamed, so it is either whole or absent). Hidden states are not stored: the
router's trainer recomputes them.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from roads_to_rome import files
from roads_to_rome.backends.base import greedy, mask_for
from roads_to_rome.core.layout import left_pad
from roads_to_rome.core.request import Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import R2RError
from roads_to_rome.models import systems
from roads_to_rome.models.loading import template_hash
from roads_to_rome.pipeline import judges
from roads_to_rome.pipeline.prompt_sets import load_prompts
from roads_to_rome.progress import QUIET
from roads_to_rome.routing.policies import entropy

STEPS = ("responses", "prefill", "continuations", "judgements", "labels")
WRITERS = ("llm", "slm")  # who writes the responses the other model reads
SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")


# ---- resumable Parquet parts ---------------------------------------------------------------------

class Parts:
    """A step's output: Parquet files under OUT/<step>/, each written whole or not at all."""

    def __init__(self, out: Path, step: str):
        self.dir = out / step
        self.dir.mkdir(parents=True, exist_ok=True)

    def rows(self) -> list[dict]:
        files = sorted(self.dir.glob("part-*.parquet"))
        return [row for f in files for row in pq.read_table(f).to_pylist()]

    def done(self, key: str = "id") -> set:
        return {row[key] for row in self.rows()}

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        tmp = self.dir / f".tmp-{uuid.uuid4().hex}"
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        n = len(list(self.dir.glob("part-*.parquet")))
        tmp.rename(self.dir / f"part-{n:06d}-{uuid.uuid4().hex[:8]}.parquet")


def log_throughput(out: Path, step: str, items: int, tokens: int, seconds: float) -> None:
    """Append a chunk's measured throughput to OUT/throughput.jsonl (see `throughput`)."""
    with open(out / "throughput.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "items": items, "tokens": tokens, "seconds": seconds}) + "\n")


def throughput(out: Path) -> dict:
    """Per step: items/s and tokens/s over every chunk ever run (resumed runs included)."""
    path = out / "throughput.jsonl"
    totals: dict[str, dict] = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        t = totals.setdefault(row["step"], {"items": 0, "tokens": 0, "seconds": 0.0})
        for k in ("items", "tokens", "seconds"):
            t[k] += row[k]
    for t in totals.values():
        t["items_per_s"] = t["items"] / t["seconds"] if t["seconds"] else 0.0
        t["tokens_per_s"] = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
    return totals


def to_sentence_end(text: str) -> str:
    """The text up to and including the end of its first sentence."""
    match = SENTENCE_END.search(text)
    return text[: match.end()] if match else text


# ---- the steps -----------------------------------------------------------------------------------

# How `r2r label` is given each setting a step records, for a refused resume to name what to change.
SETTINGS = {"writer": "--writer", "max_new_tokens": "--max-new-tokens", "chat_template": "--chat-template",
            "llm_reads": "the LLM reading each response (--judge margin, --writer slm)", "judge": "--judge",
            "rollout": "rollouts to the answer's end (--judge answer)", "rejoin_tokens": "--rejoin-tokens",
            "positions_per_response": "--positions-per-response"}
STEP_SETTINGS = {("continuations", "max_new_tokens"): "--continuation-tokens"}


def same_mode(out: Path, step: str, mode: dict) -> None:
    """A step's parts are all made one way (OUT/<step>.json says which): refuse to add parts made another way, naming
    the setting that differs. A setting the run did not record yet (made before it was) is recorded from now on."""
    file = out / f"{step}.json"
    made = json.loads(file.read_text()) if file.exists() else {}
    for setting in [*mode, *(s for s in made if s not in mode)]:  # the step's own order: the cause before its effects
        if setting in made and made[setting] != mode.get(setting):
            name = STEP_SETTINGS.get((step, setting), SETTINGS.get(setting, setting))
            raise R2RError(f"{out}'s {step} step was made with {name} = {shown(made[setting])}, not "
                           f"{shown(mode.get(setting))}: resume it with the same setting, or use another --out")
    out.mkdir(parents=True, exist_ok=True)
    files.write_text(file, json.dumps({**made, **mode}))


def shown(value) -> str:
    """A recorded setting as a person reads it: none, on or off, a number, a quoted string."""
    if value is None or isinstance(value, bool):
        return {None: "none", True: "on", False: "off"}[value]
    return json.dumps(value)


def writer_of(out: Path) -> str:
    """Who wrote OUT's responses (`step_responses`' mode; the LLM, the default, where that step has not run)."""
    file = out / "responses.json"
    return json.loads(file.read_text())["writer"] if file.exists() else "llm"


def step_responses(prompts: list[dict], engine, out: Path, max_new_tokens: int, batch_size: int,
                   progress=QUIET, writer: str = "llm", chat_template: str | None = None) -> None:
    """`engine` is the writer alone (`Engine.alone`): the LLM, or with `writer="slm"` the SLM. `chat_template`: the
    one given for the tokenizer's, which the prompts were written in (recorded: a resume with another is refused)."""
    same_mode(out, "responses", {"writer": writer, "max_new_tokens": max_new_tokens,
                                 "chat_template": template_hash(chat_template)})
    parts = Parts(out, "responses")
    done = parts.done()
    todo = [p for p in prompts if p["id"] not in done]
    task = progress.add_task(f"0 responses ({writer.upper()})", total=len(prompts),
                             completed=len(prompts) - len(todo))
    writing = engine.llm if writer == "llm" else engine.slm
    for i in range(0, len(todo), batch_size):
        chunk = todo[i : i + batch_size]
        prompt_ids = [engine.prompts.prompt(p["prompt"], p.get("suffix")) for p in chunk]
        began = time.perf_counter()
        # An LLM behind a server writes whole responses there (it knows no stop strings); a local model, and
        # responses with stop strings, through the engine.
        written = None if any(p.get("stop") for p in chunk) else writing.complete(
            writing.new_cache(), *left_pad(prompt_ids, engine.pad_id, writing.device), max_new_tokens)
        if written is not None:
            answers = [(ids, "length" if len(ids) == max_new_tokens else "stop") for ids in written]
        else:
            requests = [Request(ids, SamplingParams(max_new_tokens=max_new_tokens, stop=tuple(p.get("stop", ()))))
                        for p, ids in zip(chunk, prompt_ids)]
            answers = [(g.token_ids, g.finish_reason) for g in engine.run(requests)]
        log_throughput(out, "responses", len(chunk), sum(len(a) for a, _ in answers), time.perf_counter() - began)
        parts.write([{"id": p["id"], "domain": p["domain"], "prompt_ids": ids, "response_ids": answer,
                      "finish_reason": finish} for p, ids, (answer, finish) in zip(chunk, prompt_ids, answers)])
        progress.advance(task, len(chunk))


@torch.inference_mode()
def step_prefill(slm, out: Path, progress=QUIET, llm=None) -> None:
    """One SLM forward over prompt + response per item: argmax and entropy at every response position. With
    `llm` (the margin judge), one LLM forward too: its argmax (`llm_tokens`, the LLM's token at each position;
    without it, the response's token, which the LLM wrote) and `gap`, its log-probability of that token minus
    its log-probability of the SLM's."""
    same_mode(out, "prefill", {"llm_reads": llm is not None})
    responses = Parts(out, "responses").rows()
    parts = Parts(out, "prefill")
    done = parts.done()
    todo = [r for r in responses if r["id"] not in done]
    task = progress.add_task("1 prefill (SLM)", total=len(responses), completed=len(responses) - len(todo))
    for r in todo:
        ids = r["prompt_ids"] + r["response_ids"]
        began = time.perf_counter()
        # Position t predicts token t+1: response token j is predicted at len(prompt) - 1 + j.
        start = len(r["prompt_ids"]) - 1
        predicted, _ = slm.forward_sequence(ids[:-1], start)
        slm_tokens = predicted.argmax(-1)
        row = {"id": r["id"], "slm_tokens": slm_tokens.tolist(), "entropy": entropy(predicted).tolist()}
        llm_tokens = r["response_ids"]
        if llm is not None:
            logprobs = torch.log_softmax(llm.forward_sequence(ids[:-1], start)[0].float(), -1)
            best = logprobs.max(-1)
            llm_tokens = row["llm_tokens"] = best.indices.tolist()
            row["gap"] = (best.values - logprobs.gather(1, slm_tokens.to(logprobs.device)[:, None])[:, 0]).tolist()
        log_throughput(out, "prefill", 1, len(ids) * (1 if llm is None else 2), time.perf_counter() - began)
        parts.write([{**row, "different": [s != t for s, t in zip(row["slm_tokens"], llm_tokens)]}])
        progress.advance(task, 1)


# A rollout whose last N tokens run in a row in the LLM's response has re-joined it and may stop, neutral. Off (0)
# by default: the rest of a greedy path depends on the whole prefix, so a branch that re-joined for a few tokens
# can still reach another final answer (README, "Routing labels", measures how often).
REJOIN_TOKENS = 0
ROLLOUT_MARGIN = 64  # a rollout may run this many tokens longer than the rest of the response


def rejoin_point(branch: list[int], response: list[int], m: int) -> int | None:
    """The index in `response` where the branch's last `m` tokens end, if they occur there in a row: the
    branch has re-joined the LLM's own path (at any offset: it may have taken more or fewer tokens)."""
    if m <= 0 or len(branch) < m:
        return None
    tail = branch[-m:]
    return next((j for j in range(m - 1, len(response)) if response[j - m + 1 : j + 1] == tail), None)


@torch.inference_mode()
def llm_branches(llm, base, prompt_length: int, positions: list[int], tokens: list[int], limits: list[int],
                 eos_ids: set[int], stop) -> list[list[int]]:
    """The LLM's greedy branches, decoded together: branch i puts `tokens[i]` at response position `positions[i]`
    (descending) and writes up to `limits[i]` tokens after it (`backend.greedy`'s `stop`). `base` is a one-row
    cache holding the prompt and the response at least up to the first position; it is cut back to there and
    copied once per branch, and each copy rolled back to its own position (left padding lines the rows up):
    a response is read once, however many branches leave it."""
    top = positions[0]
    llm.truncate(base, prompt_length + top)
    rows = llm.copy_rows(base, [0] * len(positions))
    shifts = [top - pos for pos in positions]
    llm.shift_rows(rows, shifts)
    mask = torch.ones(len(positions), rows.length, dtype=torch.long, device=llm.device)
    for i, d in enumerate(shifts):
        mask[i, :d] = 0
    return greedy(llm, rows, [[t] for t in tokens], limits, eos_ids, stop, mask)


def step_continuations(llm_engine, out: Path, max_new_tokens: int, progress=QUIET, rollout: bool = False,
                       rejoin_tokens: int = REJOIN_TOKENS, batch_size: int = 1, answered=None,
                       positions_per_response: int = 0) -> None:
    """From each differing position, the LLM continues the SLM's token to the end of the sentence, or with
    `rollout` (the answer judge) to the end of its answer. `answered(text)`, with `rollout`: whether a response
    states a final answer; one that does not (cut off at its length, say) gets no rollouts, since every
    verdict there is `unparseable` whatever its branches say: the rows hold the SLM's token alone.

    Per response the LLM reads prompt + response once; each position then costs only its own
    continuation: positions are visited from last to first, `batch_size` branches decoded together, each
    from a copy of the cache cut back to its position (`llm_branches`).

    `positions_per_response` > 0 branches from that many of a response's differing positions only (a fixed sample
    per response id); the others get rows without branches (`sampled` false), which the judgements step leaves
    unjudged (`unparseable`) and training skips: rollouts cost hundreds of tokens each.
    """
    # `llm_engine`: `Engine.alone(llm, tokenizer)`. On-policy (the SLM wrote the responses): the LLM's own branch is
    # not the response but a second rollout, from the LLM's token at the same position (the prefill step's
    # `llm_tokens`, read with the LLM).
    on_policy = rollout and writer_of(out) == "slm"
    prefill = Parts(out, "prefill").rows()
    # Refused before the step's mode is recorded, so that the same --out takes the right setting afterwards.
    if on_policy and rejoin_tokens:
        raise R2RError("--rejoin-tokens stops a branch where it re-joins the LLM's response; with --writer slm the "
                       "response is the SLM's: use --rejoin-tokens 0")
    if on_policy and any("llm_tokens" not in p for p in prefill):
        raise R2RError(f"{out}'s prefill step ran without the LLM's reading, which on-policy answer labels need (the "
                       "LLM's token at each position): use another --out")
    mode = {"rollout": rollout, "rejoin_tokens": rejoin_tokens if rollout else None,
            "max_new_tokens": None if rollout else max_new_tokens}
    mode.update({"writer": "slm"} if on_policy else {})
    mode.update({"positions_per_response": positions_per_response} if positions_per_response else {})
    same_mode(out, "continuations", mode)
    responses = {r["id"]: r for r in Parts(out, "responses").rows()}
    # On-policy, the LLM's road may be longer than the SLM's: a rollout may run as long as the longest response.
    budget = max((len(r["response_ids"]) for r in responses.values()), default=0)
    parts = Parts(out, "continuations")
    done = parts.done()
    total = sum(sum(p["different"]) for p in prefill)
    todo = [p for p in prefill if p["id"] not in done]
    task = progress.add_task("2 continuations (LLM)", total=total, completed=total - sum(
        sum(p["different"]) for p in todo))
    for p in todo:
        r = responses[p["id"]]
        began = time.perf_counter()
        rows, positions, generated = continue_response(
            llm_engine, r, p, positions_per_response=positions_per_response, rollout=rollout, on_policy=on_policy,
            answered=answered, batch_size=batch_size, budget=budget, rejoin_tokens=rejoin_tokens,
            max_new_tokens=max_new_tokens)
        # One part per response, so a response's positions are all there or none are.
        parts.write(sorted(rows, key=lambda row: row["position"]) or [{"id": r["id"], "position": -1}])
        log_throughput(out, "continuations", len(positions), generated, time.perf_counter() - began)
        progress.advance(task, sum(p["different"]))


def continue_response(llm_engine, r: dict, p: dict, *, positions_per_response: int, rollout: bool, on_policy: bool,
                      answered, batch_size: int, budget: int, rejoin_tokens: int,
                      max_new_tokens: int) -> tuple[list[dict], list[int], int]:
    """One response's continuation rows (`step_continuations`), the positions branched from, and the tokens the
    LLM wrote for them."""
    llm, tokenizer = llm_engine.llm, llm_engine.tokenizer
    response = r["response_ids"]
    differing = [pos for pos, diff in enumerate(p["different"]) if diff]
    positions = differing if not 0 < positions_per_response < len(differing) else \
        sorted(random.Random(p["id"]).sample(differing, positions_per_response))
    generated = 0
    rows = [{"id": r["id"], "position": pos, "slm_token": p["slm_tokens"][pos], "llm_token": (p.get("llm_tokens") or
             response)[pos], "context": "", "slm_branch": "", "llm_branch": "", "sampled": False}
            for pos in sorted(set(differing) - set(positions))]
    unanswered = bool(positions) and rollout and not on_policy and answered is not None and not answered(
        tokenizer.decode(response, skip_special_tokens=True))  # its branches stay at the SLM's token
    branching = Branching(llm, tokenizer, llm_engine.eos_ids, None, r, p, bool(positions_per_response))
    if positions and not unanswered:
        branching.base = base = llm.new_cache()
        ids = r["prompt_ids"] + response[: positions[-1]]
        llm.read(base, torch.tensor([ids], device=llm.device), mask_for(base, len(ids), llm.device))
    last_first = positions[::-1]  # the base cache is only ever cut back
    for k in range(0, len(last_first), batch_size):
        chunk = last_first[k : k + batch_size]
        if on_policy:
            written = on_policy_rollouts(branching, chunk, budget)
        elif rollout:
            written = rollouts(branching, chunk, rejoin_tokens, unanswered)
        else:
            written = sentence_continuations(branching, chunk, max_new_tokens)
        rows += written.rows
        generated += written.tokens
    return rows, positions, generated


@dataclass
class Branching:
    """One response as its continuations branch from it: the LLM alone, the response and its prefill row, and the
    cache holding prompt + response (`base`, None when no branch is read)."""

    llm: object
    tokenizer: object
    eos_ids: set[int]
    base: object
    response_row: dict
    prefill_row: dict
    sampled: bool  # whether the step branches from a sample of the positions (rows say they were sampled)

    @property
    def response(self) -> list[int]:
        return self.response_row["response_ids"]

    def branches(self, positions: list[int], tokens: list[int], limits: list[int], stop) -> list[list[int]]:
        return llm_branches(self.llm, self.base, len(self.response_row["prompt_ids"]), positions, tokens, limits,
                            self.eos_ids, stop)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def row(self, pos: int) -> dict:
        """What every mode's row at `pos` holds before its branches."""
        return {"id": self.response_row["id"], "position": pos, "slm_token": self.prefill_row["slm_tokens"][pos],
                "llm_token": self.response[pos], "context": self.decode(self.response[:pos]),
                **({"sampled": True} if self.sampled else {})}


@dataclass
class Written:
    rows: list[dict]
    tokens: int  # the LLM's tokens that made them


def sentence_continuations(b: Branching, chunk: list[int], max_new_tokens: int) -> Written:
    """The paper's labels: the SLM's token continued by the LLM to the end of its sentence, beside the response's."""
    tokens = [b.prefill_row["slm_tokens"][pos] for pos in chunk]

    def sentence_ends(i: int, branch: list[int]) -> bool:
        return bool(SENTENCE_END.search(b.decode([tokens[i]] + branch)))

    branches = b.branches(chunk, tokens, [max_new_tokens] * len(chunk), sentence_ends)
    rows = [{**b.row(pos), "slm_branch": to_sentence_end(b.decode([token] + written)),
             "llm_branch": to_sentence_end(b.decode(b.response[pos:]))}
            for pos, token, written in zip(chunk, tokens, branches)]
    return Written(rows, sum(len(written) + 1 for written in branches))


def rollouts(b: Branching, chunk: list[int], rejoin_tokens: int, unanswered: bool) -> Written:
    """The answer judge's: the SLM's token continued to the end of the answer (at most the response's remaining
    length + a margin), stopped early where it re-joins the response (`rejoin_point`); none where the response
    states no answer (`unanswered`)."""
    tokens = [b.prefill_row["slm_tokens"][pos] for pos in chunk]
    rests = [b.response[pos + 1 :] for pos in chunk]
    joined: dict[int, int] = {}  # branch -> where in its rest it re-joined the response

    def rejoined(i: int, branch: list[int]) -> bool:
        j = rejoin_point([tokens[i]] + branch, rests[i], rejoin_tokens)
        if j is not None:
            joined[i] = j
        return j is not None

    limits = [len(rest) + ROLLOUT_MARGIN for rest in rests]
    branches = [[] for _ in chunk] if unanswered else b.branches(chunk, tokens, limits, rejoined)
    rows = []
    for i, (pos, token, written) in enumerate(zip(chunk, tokens, branches)):
        # A re-joined branch would go on as the response does: its remainder stands for the rest.
        branch = [token] + written + (rests[i][joined[i] + 1 :] if i in joined else [])
        rows.append({**b.row(pos), "slm_branch": b.decode(branch), "llm_branch": b.decode(b.response[pos:]),
                     "rejoined": i in joined})
    return Written(rows, 0 if unanswered else sum(len(written) + 1 for written in branches))


def on_policy_rollouts(b: Branching, chunk: list[int], budget: int) -> Written:
    """On-policy answer labels (the SLM wrote the response): from each position, a rollout from the SLM's token and
    one from the LLM's (the prefill step's `llm_tokens`), in one batch, position by position. The LLM's road may be
    longer than the SLM's: a rollout may run as long as the longest response (`budget`) had left there."""
    tokens = [b.prefill_row["slm_tokens"][pos] for pos in chunk]
    llm_tokens = [b.prefill_row["llm_tokens"][pos] for pos in chunk]
    limits = [max(len(b.response) - pos - 1, budget - pos - 1) + ROLLOUT_MARGIN for pos in chunk]
    both = b.branches([pos for pos in chunk for _ in (0, 1)], [t for pair in zip(tokens, llm_tokens) for t in pair],
                      [n for n in limits for _ in (0, 1)], None)
    branches, llm_own = both[0::2], both[1::2]
    rows = [{**b.row(pos), "llm_token": llm_token, "rejoined": False, "slm_branch": b.decode([token] + written),
             "llm_branch": b.decode([llm_token] + own)}
            for pos, token, llm_token, written, own in zip(chunk, tokens, llm_tokens, branches, llm_own)]
    return Written(rows, sum(len(written) + 1 + len(own) + 1 for written, own in zip(branches, llm_own)))


def step_margin_judgements(judge: judges.MarginJudge, out: Path, name: str = "judgements") -> None:
    """The margin judge's verdicts, from the prefill step's gaps instead of branches: cheap, so they are rewritten
    whole for the current margin."""
    prefill = Parts(out, "prefill").rows()
    if any("gap" not in p for p in prefill):
        raise R2RError(f"{out}'s prefill step ran without the LLM's reading: the margin judge needs a run made "
                       "with --judge margin from its prefill step on (use another --out)")
    began = time.perf_counter()
    verdicts = [{"id": p["id"], "position": pos, "verdict": verdict, "raw": raw, "judge": judge.name}
                for p in prefill for pos, (gap, diff) in enumerate(zip(p["gap"], p["different"])) if diff
                for verdict, raw in [judge.verdict(gap)]]
    same_mode(out, name, {"judge": judge.name})
    # The new verdicts beside the old ones, then swapped in: an interrupted step leaves the old ones whole.
    fresh, stale = out / f".{name}.new", out / f".{name}.old"
    for folder in (fresh, stale):
        shutil.rmtree(folder, ignore_errors=True)
    Parts(out, fresh.name).write(verdicts)
    if (out / name).exists():
        (out / name).rename(stale)
    fresh.rename(out / name)
    shutil.rmtree(stale, ignore_errors=True)
    log_throughput(out, f"{name} ({judge.name})", len(verdicts), 0, time.perf_counter() - began)


def step_judgements(judge, out: Path, batch_size: int = 16, progress=QUIET, name: str = "judgements",
                    references: dict[str, str] | None = None) -> None:
    """A text judge's verdicts on the continuations' branches. `references` (prompt id -> reference answer), for
    the answer judge: positions of a response whose own final answer misses its prompt's reference are not judged
    (`judges.off_reference`)."""
    continuations = [c for c in Parts(out, "continuations").rows() if c["position"] >= 0]
    same_mode(out, name, {"judge": judge.name})
    parts = Parts(out, name)
    done = {(j["id"], j["position"]) for j in parts.rows()}
    todo = [c for c in continuations if (c["id"], c["position"]) not in done]
    task = progress.add_task(f"3 {name} ({judge.name})", total=len(continuations),
                             completed=len(continuations) - len(todo))
    for i in range(0, len(todo), batch_size):
        chunk = todo[i : i + batch_size]
        began = time.perf_counter()
        verdicts = judges.judge_cases(judge, [(c["context"], c["llm_branch"], c["slm_branch"]) for c in chunk])
        if references and getattr(judge, "rollout", False):
            verdicts = [judges.off_reference(v, c["context"], c["llm_branch"], references.get(c["id"], ""))
                        for c, v in zip(chunk, verdicts)]
        verdicts = [v if c.get("sampled") is not False else ("unparseable", "not rolled out (--positions-per-response)")
                    for c, v in zip(chunk, verdicts)]
        log_throughput(out, f"{name} ({judge.name})", len(chunk), 0, time.perf_counter() - began)
        parts.write([{"id": c["id"], "position": c["position"], "verdict": v, "raw": raw, "judge": judge.name}
                     for c, (v, raw) in zip(chunk, verdicts)])
        progress.advance(task, len(chunk))


def step_labels(out: Path) -> Path:
    """The dataset: one row per response token with its label; written whole (it is cheap to redo)."""
    responses = Parts(out, "responses").rows()
    prefill = {p["id"]: p for p in Parts(out, "prefill").rows()}
    verdicts = {(j["id"], j["position"]): j for j in Parts(out, "judgements").rows()}
    rows = []
    for r in responses:
        p = prefill.get(r["id"])
        if p is None:
            raise R2RError(f"prefill is missing for {r['id']}: run the prefill step first")
        # The LLM's token: the response's where the LLM wrote it, its argmax where it read the SLM's (--writer slm).
        llm_tokens = p.get("llm_tokens") or r["response_ids"]
        for pos, (token, slm_token, ent, diff) in enumerate(zip(llm_tokens, p["slm_tokens"], p["entropy"],
                                                                p["different"])):
            judged = verdicts.get((r["id"], pos))
            if diff and judged is None:
                raise R2RError(f"no judgement for {r['id']} position {pos}: run the judgements step first")
            rows.append({"id": r["id"], "domain": r["domain"], "position": pos, "token": token,
                         "slm_token": slm_token, "entropy": ent,
                         "label": judged["verdict"] if diff else "identical",
                         "judge_raw": judged["raw"] if diff else None})
    return files.write_atomically(out / "labels.parquet", lambda tmp: pq.write_table(pa.Table.from_pylist(rows), tmp))


def run(prompts: Path, out: Path, steps: str, load_pair, judge_for, max_new_tokens: int = 256,
        continuation_tokens: int = 32, batch_size: int = 4, progress=QUIET, rollout: bool = False,
        rejoin_tokens: int = REJOIN_TOKENS, margin: bool = False, writer: str = "llm",
        positions_per_response: int = 0, chat_template: str | None = None) -> Path | None:
    """`r2r label`: the chosen steps (comma-separated, any subset of STEPS) in pipeline order.
    `load_pair()` gives (SLM, LLM, tokenizer), called only when a step needs a model; `judge_for(llm_alone)`
    gives the judge. `rollout`: the answer judge's; `margin`: the margin judge's (the LLM reads in the prefill
    step, no continuations). `chat_template`: the template `load_pair`'s tokenizer was given, if any (recorded with
    the responses). Returns the labelled dataset's path when the labels step ran."""
    chosen = [s.strip() for s in steps.split(",") if s.strip()]
    if not chosen or any(s not in STEPS for s in chosen):
        raise R2RError(f"--steps takes a comma-separated subset of {','.join(STEPS)}, got {steps!r}")
    if writer not in WRITERS:
        raise R2RError(f"--writer takes {' or '.join(WRITERS)}, got {writer!r}")
    if writer == "slm" and not (margin or rollout):
        raise R2RError("--writer slm needs --judge margin or --judge answer: the other judges compare the LLM's "
                       "branch with a response the LLM wrote")
    rollout_judged = rollout and "judgements" in chosen  # the answer judge reads the prompts' references
    prompt_set = load_prompts(prompts) if "responses" in chosen or rollout_judged else None
    out.mkdir(parents=True, exist_ok=True)

    def busy():
        raise R2RError(f"another process is labelling into {out} now (the directory is locked): wait for it to end, "
                       "or give another --out")

    # Two runs into one directory would compute the same rows and write each twice.
    with files.exclusive(out, busy):
        llm_alone = None
        if set(chosen) - {"labels"} - ({"judgements"} if margin else set()):  # those only read Parquet parts
            slm, llm, tokenizer = load_pair()
            llm_alone = systems.alone(llm, tokenizer, "llm")
        if "responses" in chosen:
            writer_alone = llm_alone if writer == "llm" else systems.alone(slm, tokenizer, "slm")
            step_responses(prompt_set, writer_alone, out, max_new_tokens, batch_size, progress, writer, chat_template)
        if "prefill" in chosen:
            step_prefill(slm, out, progress, llm if margin or writer == "slm" else None)
        if "continuations" in chosen and not margin:
            step_continuations(llm_alone, out, continuation_tokens, progress, rollout, rejoin_tokens, batch_size,
                               answered=lambda text: judges.final_answer(text) is not None,
                               positions_per_response=positions_per_response)
        if "judgements" in chosen:
            references = None
            if rollout_judged:
                # A reference belongs to the prompt a response answered: matched by its prompt tokens, never by id alone
                # (another prompt set may reuse the ids, and a regenerated one may differ in a few prompts).
                by_prompt = {tuple(llm_alone.prompts.prompt(p["prompt"], p.get("suffix"))): p["reference"]
                             for p in prompt_set}
                responses = Parts(out, "responses").rows()
                references = {r["id"]: by_prompt[tuple(r["prompt_ids"])] for r in responses
                              if tuple(r["prompt_ids"]) in by_prompt}
                if responses and not references:
                    raise R2RError(f"{prompts} is not the prompt set {out}'s responses answer (none of its prompts is "
                                   "there): give the prompt set the run was started with")
            judge = judge_for(llm_alone)
            if margin:
                step_margin_judgements(judge, out)
            else:
                step_judgements(judge, out, progress=progress, references=references)
        return step_labels(out) if "labels" in chosen else None


def prefill_rows(out: Path) -> list[dict]:
    """Before the judge has run: one row per response token, labelled `identical` or `different`
    from the prefill step alone."""
    domains = {r["id"]: r["domain"] for r in Parts(out, "responses").rows()}
    return [{"id": p["id"], "domain": domains.get(p["id"]), "position": pos, "slm_token": slm_token, "entropy": ent,
             "label": "different" if diff else "identical"}
            for p in Parts(out, "prefill").rows()
            for pos, (slm_token, ent, diff) in enumerate(zip(p["slm_tokens"], p["entropy"], p["different"]))]


# The R2R paper's training-data statistics (R1-1.5B vs R1-32B): different and divergent token rates.
