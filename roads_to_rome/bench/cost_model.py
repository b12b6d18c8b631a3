"""The cost model of `r2r bench shapes`: a run's tokens per second predicted from measured step costs.

    time per output token = SLM steps x t_SLM(1) + LLM catch-ups x t_LLM(tokens read per catch-up)

with t(k) the measured cost of one forward over k new tokens (interpolated between measured k); with the LLM's calls
beside the SLM's steps (`overlapped_seconds`), about the larger of the two sides, plus the tokens roll-backs
discard."""

from __future__ import annotations

import numpy as np

from roads_to_rome.core.llm_calls import Deferral


def cost_at(ms: dict[int, float], k: float) -> float:
    """t(k): one forward over k new tokens, interpolated linearly between measured k (extrapolated from the
    last two beyond them)."""
    ks = sorted(ms)
    if k <= ks[0]:
        return ms[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if k <= b:
            return ms[a] + (ms[b] - ms[a]) * (k - a) / (b - a)
    a, b = ks[-2], ks[-1]
    return ms[b] + (ms[b] - ms[a]) * (k - b) / (b - a)


def predicted_seconds(calls: list[int], ms: dict[int, float]) -> float:
    """What a sequence of forwards (new tokens per call) costs at these step costs."""
    return sum(cost_at(ms, k) for k in calls) / 1000


def routing_calls(prompt: int, tokens: int, share: float, rng: np.random.Generator, rows: int = 1,
                  deferral: Deferral = Deferral(), accept: float = 0.0) -> tuple[list[int], list[int]]:
    """The forwards R2R makes when a share of tokens goes to the LLM at random, `rows` rows in lockstep: the SLM
    reads the prompt, then one column per step; the LLM, at each step where its grouping rule calls it (without
    deferral: where any row is routed), every column since it last read (the prompt first). A deferred routed
    token is the SLM's with probability `accept` (parked: never); where it is not, the row goes back to it and
    what it wrote since is lost. Steps go on until every row holds `tokens` (a row that is done stays in the
    step costs' row count)."""
    length = np.zeros(rows, dtype=np.int64)  # tokens each row holds
    waiting: list[list[int]] = [[] for _ in range(rows)]  # each row's deferred routed positions
    slm, llm, read, column = [], [], 0, prompt
    park = deferral.mode == "park"
    while (length < tokens).any():
        slm.append(prompt if not slm else 1)
        active = length < tokens
        routed = (rng.random(rows) < share) & active
        if deferral.on:
            waits = np.array([bool(w) for w in waiting]) | routed
            oldest = max((length[i] - w[0] for i, w in enumerate(waiting) if w), default=0)
            due = (waits.sum() >= deferral.rows(active.sum()) or oldest >= deferral.steps
                   or (waits & (length + 1 >= tokens)).any()) and waits.any()
        else:
            due = routed.any()
        if due:
            llm.append(column - read)
            read = column
            for i in np.flatnonzero(active):
                kept = next((p for p in waiting[i] if park or rng.random() >= accept), None)
                length[i] = length[i] + 1 if kept is None else kept + 1
                waiting[i] = []
        else:
            for i in np.flatnonzero(routed):
                waiting[i].append(int(length[i]))
            length += active
        column += 1
    return slm, llm


def predicted_routing_tok_s(slm_ms: dict, llm_ms: dict, share: float, prompts: list[int], tokens: int,
                            samples: int = 100, rows: int = 1, deferral: Deferral = Deferral(),
                            accept: float = 0.0) -> float:
    """The cost model's tokens/s for routing `share` of the tokens at random, over prompts of these lengths
    (averaged over random draws); with `rows`, over batches of that many rows whose padded prompts have these
    lengths, at step costs measured with that many rows; with `deferral`, its grouping rule and a deferred routed
    token kept with probability `accept`."""
    rng = np.random.default_rng(0)
    seconds = 0.0
    for prompt in prompts:
        for _ in range(samples):
            slm, llm = routing_calls(prompt, tokens, share, rng, rows, deferral, accept)
            seconds += (predicted_seconds(slm, slm_ms) + predicted_seconds(llm, llm_ms)) / samples
    return tokens * rows * len(prompts) / seconds


def predicted_alone_tok_s(ms: dict, prompts: list[int], tokens: int, rows: int = 1) -> float:
    return tokens * rows * len(prompts) / sum(predicted_seconds([p] + [1] * (tokens - 1), ms) for p in prompts)


def batch_widths(lengths: list[int], rows: int) -> list[int]:
    """The padded prompt width of each batch of `rows` prompts, in order."""
    return [max(lengths[i : i + rows]) for i in range(0, len(lengths), rows)]


def real_acceptance(result: dict) -> float:
    """The share of deferred routed tokens the real pair's LLM kept (the SLM's token was its own), from its batched
    run in this results file (or the one --real-from names; the largest batch's); 0 without one."""
    runs = [run for name, run in result["real"].get("systems", {}).items() if name.startswith("r2r+continue b=")]
    return max(runs, key=lambda run: run["batch"])["deferred_accept"] if runs else 0.0


def predicted_from_calls(result: dict, slm_ms: dict, llm_ms: dict) -> float:
    """Tokens/s of a measured run's exact forwards (per prompt, per model) at other step costs: how a call pattern
    measured on the real pair carries over to an LLM of another size."""
    seconds = sum(predicted_seconds(c, slm_ms) for c in result["slm_calls"])
    seconds += sum(predicted_seconds(c, llm_ms) for c in result["llm_calls"])
    return result["tokens"] / seconds


def tokens_per_round(result: dict) -> float:
    """Tokens a speculative round gives on the real pair: its tokens over the LLM's forwards (one per round)."""
    return result["tokens"] / max(sum(len(calls) for calls in result["llm_calls"]), 1)


def ms_keys(table: dict) -> dict[int, float]:
    return {int(k): v for k, v in table.items()}


def overlapped_seconds(prompt: int, tokens: int, share: float, rng: np.random.Generator, slm_ms: dict,
                       llm_ms: dict, rows: int = 1, accept: float = 0.0, contention: float = 0.0,
                       deferral: Deferral = Deferral()) -> float:
    """Seconds R2R takes with the LLM's calls beside the SLM's steps (--overlap), routing `share` of the tokens at
    random, `rows` rows: the SLM steps on while a call runs; a call is sent when none is in flight and the rule's
    grouping calls for one (`Deferral.overlapped()` of lockstep's: as soon as a row waits), reading every column
    since the LLM's last read; it lands at the first step after it is done, where each
    routed position it covers is the SLM's token with probability `accept` (else the row goes back there, losing
    what it wrote since). A row stands still once it has written the rule's `tokens_ahead` beyond what the call in
    flight reads while it has positions waiting, or once it is done but not checked. `contention`: how much the two
    slow each other while both run (0: their own devices, or the LLM on a server; 1: one device they share fully,
    each at half speed)."""
    deferral = deferral.overlapped()
    length, sent = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    waiting: list[list[int]] = [[] for _ in range(rows)]
    column, read, now = prompt, 0, cost_at(slm_ms, prompt) / 1000
    ahead = deferral.tokens_ahead(rows)
    call = None  # (LLM work left in seconds at full speed, each row's routed positions it covers)
    while (length < tokens).any() or call is not None or any(waiting):
        if call is not None and call[0] <= 1e-12:  # it has answered: the rows take its word
            for i, covered in enumerate(call[1]):
                rejected = next((p for p in covered if rng.random() >= accept), None)
                if rejected is not None:
                    length[i] = rejected + 1
                    waiting[i] = []
                else:
                    waiting[i] = [p for p in waiting[i] if p not in covered]
            call = None
        waits = [bool(w) for w in waiting]
        oldest = max((length[i] - w[0] for i, w in enumerate(waiting) if w), default=0)
        done_waiting = any(w and length[i] >= tokens for i, w in enumerate(waits))
        due = any(waits) and (sum(waits) >= deferral.rows(int((length < tokens).sum()) or rows)
                              or oldest >= deferral.steps or done_waiting)
        if call is None and due:
            call = [cost_at(llm_ms, column - read) / 1000, [list(w) for w in waiting]]
            read, sent = column, length.copy()
        if not (length < tokens).any():  # every row is written: what is left is the LLM's answer
            now += call[0] if call is not None else 0.0
            if call is not None:
                call[0] = 0.0
            continue
        step = cost_at(slm_ms, 1) / 1000 * (1 + contention if call is not None else 1)
        now += step
        if call is not None:
            call[0] -= step / (1 + contention)
        held = [length[i] >= tokens or (call is not None and bool(waiting[i]) and length[i] - sent[i] >= ahead)
                for i in range(rows)]
        for i in range(rows):
            if held[i]:
                continue
            if rng.random() < share:
                waiting[i].append(int(length[i]))
            length[i] += 1
        column += 1
    return now


def predicted_overlapped_tok_s(slm_ms: dict, llm_ms: dict, share: float, prompts: list[int], tokens: int,
                               samples: int = 100, rows: int = 1, accept: float = 0.0, contention: float = 0.0,
                               deferral: Deferral = Deferral()) -> float:
    """The cost model's tokens/s with overlap (`overlapped_seconds`), averaged over prompts and random draws."""
    rng = np.random.default_rng(0)
    seconds = sum(overlapped_seconds(prompt, tokens, share, rng, slm_ms, llm_ms, rows, accept, contention, deferral)
                  for prompt in prompts for _ in range(samples)) / samples
    return tokens * rows * len(prompts) / seconds
