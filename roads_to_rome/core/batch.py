"""The R2R decode loop: one step of a batch of sequences. Read this file top to bottom.

Both models read the same token streams (one row per prompt, left-padded to a common length: layout.py) and each
keeps its own KV cache. Per step (`Batch.step`):

  1. the SLM reads the newest column (the whole prompt on the first step) and proposes a token;
  2. the routing policy looks at the SLM's logits, last hidden state and proposal;
  3. if a row is routed, the LLM catches up on every column it has not read yet, in one
     forward over them (with --defer, a routed row may instead keep the SLM's token and wait,
     so that one LLM call serves several rows' routed tokens; with --overlap the call runs on
     a thread of its own while the next steps go on, and its answer is taken at the first step
     after it is ready: llm_calls.py);
  4. the LLM checks what waited for it (verification's unread tokens, deferred routed tokens:
     verification.py), a row whose token it rejects goes back there, and its token replaces the
     SLM's in the rows routed now;
  5. the chosen tokens become a new column; finished rows leave the batch (a row waiting for the
     LLM's word on where it ends, or too far ahead of the call in flight, stands still), each model
     keeping what it read of them for a later prompt that begins the same way (prefix caching).

The LLM reads lazily: nothing until the first routed token, then everything since its last read.
Because every row gains exactly one token per step, both caches stay rectangular: the SLM's
always covers all columns but the newest, the LLM's whatever it has caught up on so far. Each holds
only the rows its model reads: a request forced onto one model costs that model alone.

Top to bottom: `Call` (an LLM read in flight) and the records a step's phases hand each other (`Proposal`,
`Routing`, `LLMWord`, `Decisions`), `Batch` (the five phases), a row's part of a phase (`answers`, `verify_row`,
`emit_row`), then the helpers: when an output ends, time accounting, sampling rows. The `Scheduler` (scheduler.py)
decides which sequences are in the batch, with what the engine gives it (`Context`, context.py); `Engine`
(engine.py) is what clients call.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from roads_to_rome.core import verification
from roads_to_rome.core.layout import Layout
from roads_to_rome.core.llm_calls import Deferral, PendingRead, llm_due
from roads_to_rome.core.request import Cancelled, Failure, Sequence, Step, Timings
from roads_to_rome.core.sampling import logprob_entries, sample, sampling_probs
from roads_to_rome.errors import LLMUnavailable
from roads_to_rome.routing import rate

if TYPE_CHECKING:
    from roads_to_rome.core.context import Context


@dataclass
class Call:
    """A catch-up sent to the LLM: its logits once ready, and for which rows (as the batch was when it was sent:
    rows may leave or join before it answers). Row j's last logits predict its output index `reach[j]`."""

    pending: PendingRead
    sequences: list[Sequence | None]  # (None: a row that left, preempted, while it was in flight)
    reach: list[int]
    keep: int  # logits per row: the last `keep` columns read

    def done(self) -> bool:
        return self.pending.done()


# What each phase of a step (`Batch.step`) hands the next, row by row. Two index spaces meet in them: a *column* of
# the batch's token streams (this step writes column `width`) and an *output index*, a token's place in its row's
# output (this step's token's is the output's length so far: `output_index`). A row's columns move (roll-backs, a
# row that stands still), its output indices do not: verification counts in those.


@dataclass
class Proposal:
    """1. The writer's token for each row, and what it saw."""

    tokens: torch.Tensor  # [rows] (a placeholder in a row forced onto the LLM: the LLM's token takes its place)
    logits: torch.Tensor | None  # [rows, V]; None when the writer did not run (every row forces the LLM)
    hidden: torch.Tensor | None  # [rows, H], its last hidden state


@dataclass
class Routing:
    """2. Which rows the LLM takes."""

    routed: list[bool]  # the LLM takes this row's token
    scores: list[float]  # the policy's score behind each decision
    deferred: list[bool]  # routed, and its token may wait for a grouped call
    deferral: Deferral  # the rule the LLM's calls follow (with overlap, every routed row defers: `_route`)
    proposed: list[int] | None  # the proposal as numbers (a pair's: the LLM's checks read them)


@dataclass
class LLMWord:
    """3. What the LLM has said this step."""

    reads: list[verification.RowRead | None] | None  # its logits over each row's unchecked tokens (None: nothing)
    reaches_now: bool  # the reads reach this step's tokens: routed rows take the LLM's
    due: bool  # the LLM's rule calls it this step (`llm_due`): with overlap, the next call goes out after it
    held: list[bool]  # rows that stand still, waiting for the call in flight (`_stands_still`)


@dataclass
class Decisions:
    """4. The token each row writes, and the rows that move otherwise (back to a rejected token, standing, ending)."""

    chosen: torch.Tensor  # [rows]
    sources: list[str]  # who wrote each: "slm", "llm" (routed) or "fix" (verification's)
    scores: list[float]
    llm_logits: dict[int, torch.Tensor]  # row -> the LLM's logits its token came from
    rejected: dict[int, verification.Rejection]  # row -> its first rejected token: it goes back there
    held: list[bool]  # stands still (its last token written again)
    ended: set[int]  # rows whose end the LLM has now checked: they leave


class Batch:
    """Sequences decoding in lockstep: one row each in the caches of the models that read it (`Context.readers`: a
    sequence forced onto one model is in that model's only).

    Sequences can join between steps (continuous batching): a newcomer is left-padded to the
    batch's width (or the batch to the newcomer's) and prefilled up to where each model's cache
    already is, then its cache rows are appended. Finished and cancelled sequences leave.
    """

    def __init__(self, context: Context, prefixes: tuple = (None, None)):
        """`prefixes`: the writer's and the LLM's kept prompts (core/prefix_cache.py; None: a model keeps none)."""
        self.context, self.prefixes = context, prefixes
        self.sequences: list[Sequence] = []
        self.layout = Layout(context)  # the token streams and both caches
        self.call: Call | None = None  # (overlap) the LLM's catch-up in flight

    def add(self, sequences: list[Sequence], prefilled: tuple | None = None) -> None:
        """Sequences join the batch: left-padded to its width, read up to where each cache is. A sequence may
        bring its prompt already read (`prefilled`: the caches of the scheduler's chunked prefill, `PromptRead`'s
        `per_model`, for one sequence)."""
        now = time.perf_counter()
        for s in sequences:
            s.started = s.started or now  # (a preempted sequence that resumes started earlier)
        self.layout.join([s.context_ids for s in sequences], [self.context.readers(s) for s in sequences],
                         prefilled)
        self.sequences += sequences

    def remove(self, sequences: list[Sequence]) -> None:
        """These sequences leave between steps, unfinished (the scheduler preempts them): each model keeps what it
        read of them where it keeps prompts, so that their reads resume from there, and each forgets the tokens that
        await the LLM's word (`verification.forget_unchecked`), to write them again once it is back."""
        rows = [i for i, s in enumerate(self.sequences) if s in sequences]
        self._keep_reads(rows)
        if self.call is not None:  # its answer is for the rows as they were: none of it for these when they are back
            self.call.sequences = [None if s in sequences else s for s in self.call.sequences]
        for i in rows:
            verification.forget_unchecked(self.sequences[i])
        self._keep([i for i in range(len(self.sequences)) if i not in rows])

    @property
    def ids(self) -> torch.Tensor | None:
        return self.layout.ids

    @property
    def mask(self) -> torch.Tensor | None:
        return self.layout.mask

    def release(self) -> None:
        """Let go of every row now (`Layout.release`)."""
        self.layout.release()
        self.sequences, self.call = [], None

    def step(self) -> list[Step | Failure]:
        """One decode step for every sequence: what it added to each (`Step`), and the sequences that left without
        a last step (`Failure`: cancelled, or the LLM call their tokens waited for failed). Each phase takes what the
        ones before it returned; `failed` gathers the rows that failed in any of them (row -> error): they fail
        alone."""
        cancelled = [s for s in self.sequences if s.cancelled]
        self._keep([i for i, s in enumerate(self.sequences) if not s.cancelled])
        left = [Failure(s, Cancelled()) for s in cancelled]
        if not self.sequences:
            return left
        failed: dict[int, Exception] = {}
        t0 = time.perf_counter()
        proposal = self._propose(failed)
        t1 = time.perf_counter()
        routing = self._route(proposal, failed)
        t2 = time.perf_counter()
        word = self._catch_up(routing, failed)
        decisions = self._verify(proposal, routing, word, failed)
        t3 = time.perf_counter()
        events = self._emit(proposal, decisions, word, failed, (t0, t1, t2, t3))
        if self.context.overlap and word.due:
            self._send_next()
        return left + events

    def _propose(self, failed: dict[int, Exception]) -> Proposal:
        """1. The writer (the SLM of a pair) reads the columns it has not read yet of the rows it writes for (not
        those forced onto the LLM) and proposes a token per row. A row forced onto the LLM gets a placeholder (the
        LLM's token takes its place) and zero logits; when every row is one, the SLM does not run, so "LLM alone"
        through a pair costs the LLM alone."""
        context, sequences, layout = self.context, self.sequences, self.layout
        placeholders = self.ids[:, -1].clone()
        if not layout.writer_rows:
            return Proposal(placeholders, None, None)
        cache, rows = layout.writer_cache, layout.writer_rows
        context.writer.tag_rows(cache, [sequences[i].request.cache_salt for i in rows])  # (an LLM alone, served)
        logits, hidden = context.writer.forward(cache, layout.writer_part(self.ids[:, cache.length :]),
                                                layout.writer_part(self.mask))
        tokens, faults = sample_rows(logits, [sequences[i] for i in rows])
        failed.update((rows[j], e) for j, e in faults.items())
        if len(rows) < len(sequences):  # back to one row per sequence
            index = torch.tensor(rows, device=logits.device)
            logits = logits.new_zeros(len(sequences), logits.shape[1]).index_copy_(0, index, logits)
            hidden = hidden.new_zeros(len(sequences), hidden.shape[1]).index_copy_(0, index, hidden)
            tokens = placeholders.index_copy_(0, index.to(placeholders.device), tokens)
        for i in rows:
            s = sequences[i]
            if s.verify.strict and s.params.temperature > 0 and i not in failed:  # the ratio test needs what the
                index = len(s.generation.token_ids)  # SLM drew from
                s.checks.draft_probs[index] = sampling_probs(s.logits_at(logits[i], index)[None], s.params)[0]
        context.sync()
        return Proposal(tokens, logits, hidden)

    def _route(self, proposal: Proposal, failed: dict[int, Exception]) -> Routing:
        """2. The policy decides which rows the LLM takes (a request may force one model), and which of those may
        wait for a grouped call, not forced onto the LLM (a request that asks for the LLM alone gets it at once)."""
        context, sequences, n = self.context, self.sequences, len(self.sequences)
        routed, scores = [False] * n, [0.0] * n
        if proposal.logits is None:  # the SLM is idle: every row is the LLM's
            routed = [True] * n
        elif context.routes:  # the policy looks at the rows the SLM wrote for; a row forced onto the LLM is the LLM's
            rows = self.layout.writer_rows
            inputs = (proposal.logits, proposal.hidden, proposal.tokens)
            if len(rows) < n:
                index = torch.tensor(rows, device=proposal.logits.device)
                inputs = tuple(t.index_select(0, index.to(t.device)) for t in inputs)
            writing = [sequences[i] for i in rows]
            to_llm, row_scores = context.policy.route(*inputs, row_thresholds(context.policy, writing,
                                                                              self.ids.device))
            routed = [s.force == "llm" for s in sequences]
            for i, s, x, score in zip(rows, writing, to_llm.tolist(), row_scores.tolist()):
                routed[i], scores[i] = (s.force == "llm" if s.force else bool(x)), score
        for i in failed:  # a row that failed writes nothing: the LLM need not read it for this step
            routed[i] = False
        # With overlap the LLM's calls run beside the SLM's steps: a routed row never waits for one, its token is
        # checked when the call returns (`Deferral.overlapped`), so every routed row defers.
        deferral = context.deferral.overlapped() if context.overlap else context.deferral
        deferred = [deferral.on and r and s.force is None for s, r in zip(sequences, routed)]
        # (one model alone checks nothing: no GPU sync for the proposal's numbers)
        return Routing(routed, scores, deferred, deferral, proposal.tokens.tolist() if context.routes else None)

    def _catch_up(self, routing: Routing, failed: dict[int, Exception]) -> LLMWord:
        """3. The LLM's word on the rows: a call sent at an earlier step, once it has answered (overlap: taken at the
        first step after it is ready, or waited for when a row needs the LLM's token now), and a read of every
        column since the LLM last read, when it is needed now (`llm_due` without overlap; a request forcing the LLM
        with it)."""
        context, sequences, width = self.context, self.sequences, self.ids.shape[1]
        if not context.routes:
            return LLMWord(None, False, False, [False] * len(sequences))
        unread = [verification.unread_tokens(s, width, self.layout.llm_cache.length) for s in sequences]
        due = llm_due(sequences, routing.routed, routing.deferred, unread,
                      lambda i: self._would_end(routing.proposed[i], i), routing.deferral)
        now = any(r and not d for r, d in zip(routing.routed, routing.deferred)) or (due and not context.overlap)
        landed = None
        if self.call is not None and (now or self.call.done() or all(  # (no row could write: wait for it)
                self._stands_still(s, unread[i], routing.deferral) for i, s in enumerate(sequences))):
            call, self.call = self.call, None
            landed = answers(call, self.sequences, routing, failed)
        # A row the answer frees goes on at once; one whose end it has not checked stands still.
        held = [self._stands_still(s, unread[i], routing.deferral) for i, s in enumerate(sequences)]
        if now:
            fresh = answers(self._send(width, now=True), self.sequences, routing, failed)
            if landed is not None:
                fresh = [f if old is None or f is None else old.merged(f) for old, f in zip(landed, fresh)]
            landed = fresh
        return LLMWord(landed, now, due, held)

    def _stands_still(self, s: Sequence, unread: int, deferral: Deferral) -> bool:
        """Whether a row waits, writing nothing, for the call in flight: its output ended on a token the LLM has to
        check; or, while tokens of it wait for the LLM's word, it has written max_unverified tokens, or the deferral
        rule's `tokens_ahead`, beyond what the LLM was asked to read: what a roll-back may throw away, and what a
        stalled LLM's server lets it write, stays bounded."""
        if s.checks.ends is not None:
            return True
        if self.call is None or not s.pending:
            return False
        if s.verify.on and s.max_unverified is not None and unread > s.max_unverified:
            return True
        return unread > deferral.tokens_ahead(len(self.sequences))

    def _send(self, column: int, now: bool = False) -> Call:
        """Ask the LLM to read every column since it last did, up to `column` (not included): its last logits predict
        what sits at `column`. Returns at once with overlap (a worker reads), after the read without. Logits come
        back for the rows that need them: a row with tokens waiting for the LLM's word, from its first; each row's
        last, for this step's routed rows, when the read is needed `now`."""
        layout = self.layout
        sequences = [self.sequences[i] for i in layout.llm_rows]  # (a row the LLM never reads is not sent)
        read_from, width = layout.llm_cache.length, self.ids.shape[1]
        reach = [output_index(s, column, width) for s in sequences]  # the furthest token each row's read can check
        row_keep = [min(column - read_from, verification.logits_needed(s, r))
                    if now or s.pending or s.checks.ends else 0 for s, r in zip(sequences, reach)]
        pending = self.context.llm.catch_up(layout.llm_cache, layout.llm_part(self.ids[:, read_from:column]),
                                            layout.llm_part(self.mask[:, :column]), row_keep,
                                            [s.request.cache_salt for s in sequences])
        return Call(pending, sequences, reach, max(row_keep))

    def _send_next(self) -> None:
        """(overlap) After a step whose rule called the LLM, the next call, to run beside the SLM's next steps, where
        none is in flight. It reads every column but the newest (the LLM's cache stays short of the batch's width, as
        a joining row's reads expect), so it checks every token written so far."""
        if self.call is not None or not self.sequences:
            return
        column = self.ids.shape[1] - 1
        if column > self.layout.llm_cache.length and any(s.pending or s.checks.ends for s in self.sequences):
            self.call = self._send(column)

    def _verify(self, proposal: Proposal, routing: Routing, word: LLMWord, failed: dict[int, Exception]
                ) -> Decisions:
        """4. The LLM's word on each row it read: its unchecked tokens in order (the first rejected one sends the
        row back there), then, where the read reaches this step's token, the routed rows' tokens. A row whose
        output ended on an unchecked token ends once they are checked; until then it stands still. Without the
        LLM's word deferred rows keep the SLM's token, to be checked at a later call."""
        context = self.context
        decisions = Decisions(proposal.tokens.clone(), ["llm" if r else context.writer_source for r in routing.routed],
                              list(routing.scores), {}, {}, list(word.held), set())
        if word.reads is not None:
            context.counters.llm_calls += 1
        for i, s in enumerate(self.sequences):
            if i in failed:
                continue
            try:
                verify_row(context, i, s, proposal, routing, word, decisions)
            except Exception as e:  # noqa: BLE001 - this row's settings or format: it alone fails
                failed[i] = e
        return decisions

    def _emit(self, proposal: Proposal, decisions: Decisions, word: LLMWord, failed: dict[int, Exception],
              times: tuple[float, ...]) -> list[Step | Failure]:
        """5. Rows whose check rejected a token go back to it (their later tokens are discarded and the LLM's
        token goes in its place); rows that stand still stay where they are; then the new column is appended, each
        row's token recorded, and finished rows leave the batch, kept where a model keeps what it read (prefix
        caching). A row whose output ends on a token the LLM has yet to check stays, standing still, until it has."""
        dropped = self._roll_back(decisions, failed)
        self.layout.append_column(decisions.chosen)
        t0, t1, t2, t3 = times
        now = time.perf_counter()
        events, keep, finished = [], [], []
        self.context.counters.steps += 1
        tokens = decisions.chosen.tolist()
        for i, s in enumerate(self.sequences):
            count_time(s.generation.timings, self.context.writer_source, t1 - t0, t2 - t1, t3 - t2, now - t0,
                       word.reads is not None and word.reads[i] is not None)
            event = (Failure(s, failed[i]) if i in failed else
                     emit_row(self.context.tokenizer, i, s, tokens[i], proposal, decisions, dropped.get(i, 0), now))
            if event is not None:
                events.append(event)
            if not isinstance(event, Failure):  # (a row that failed leaves)
                (finished if event is not None and event.finished else keep).append(i)
        self._keep_reads(finished)
        self._keep(keep)
        return events

    def _would_end(self, proposed: int, i: int) -> bool:
        """Whether row i's output ends with this step's token, or ended on a token the LLM still has to check."""
        s = self.sequences[i]
        return s.checks.ends is not None or (
            ends(self.context.tokenizer, s, s.generation.token_ids, proposed) is not None)

    def _roll_back(self, decisions: Decisions, failed: dict[int, Exception]) -> dict[int, int]:
        """Put each rejecting row back to its rejected token, the LLM's token there, and keep each row that stands
        still where it is (its last token taken back and written again); returns how many earlier tokens each
        rejecting row dropped. Each row moves right by what it drops (`Layout.shift`: masking the dropped columns in
        place would leave holes in the middle of rows that every backend's positions would have to skip)."""
        sequences, newest = self.sequences, self.ids.shape[1] - 1
        shifts = [0] * len(sequences)
        for i, rejection in decisions.rejected.items():
            shifts[i] = len(sequences[i].generation.token_ids) - rejection.index
        for i, held in enumerate(decisions.held):
            if held and i not in decisions.ended and i not in failed:
                shifts[i] = 1
                decisions.chosen[i] = self.ids[i, newest]
        if any(shifts):
            self.layout.shift(shifts)
        for i, rejection in decisions.rejected.items():
            score = verification.take_back(sequences[i], rejection)
            if score is not None:
                decisions.scores[i] = score  # the policy's score at the rejected position
            decisions.chosen[i] = rejection.token
            decisions.sources[i] = "llm" if rejection.routed else "fix"
            decisions.llm_logits[i] = rejection.logits
        return {i: shifts[i] for i in decisions.rejected}

    def _keep_reads(self, rows: list[int]) -> None:
        """Each model that keeps prompts keeps what it read of these rows, for later prompts that begin the same way
        (prefix caching), each for requests with its row's cache_salt."""
        if rows and any(self.prefixes):
            self.layout.keep_rows(rows, self.prefixes, [self.sequences[i].request.cache_salt for i in rows])

    def _keep(self, rows: list[int]) -> None:
        if len(rows) == len(self.sequences):
            return
        self.sequences = [self.sequences[i] for i in rows]
        self.layout.keep(rows)
        if not rows:
            self.call = None


# --- a row's part of a phase -------------------------------------------------------------------------------


def answers(call: Call, sequences: list[Sequence], routing: Routing, failed: dict[int, Exception]
            ) -> list[verification.RowRead | None]:
    """A call's logits, one `RowRead` per row of the batch now, `sequences` (None for a row that joined after it was
    sent). If the LLM's server cannot be reached, the rows whose tokens wait for the LLM fail; the others go on
    without its word (they need none)."""
    try:
        logits = call.pending.result()
    except LLMUnavailable as e:
        for i, s in enumerate(sequences):
            if s.pending or s.checks.ends or routing.routed[i]:
                failed.setdefault(i, e)
        return [None] * len(sequences)
    rows = {id(s): j for j, s in enumerate(call.sequences)}
    reads = []
    for s in sequences:
        j = rows.get(id(s))
        reads.append(None if j is None else verification.RowRead(
            logits[j], call.reach[j] - call.keep + 1, call.reach[j]))
    return reads


def verify_row(context: Context, i: int, s: Sequence, proposal: Proposal, routing: Routing, word: LLMWord,
               decisions: Decisions) -> None:
    """Row i's part of `Batch._verify` (an error here is the row's own: it alone fails)."""
    read = None if word.reads is None else word.reads[i]
    routed_now = routing.routed[i] and word.reaches_now and not decisions.held[i]
    index = len(s.generation.token_ids)  # this step's token's output index
    if read is not None:
        context.counters.routed_rows += routed_now or bool(s.checks.routed)
        # This step's token is checked only where the read reaches it and the row writes one of its own (a token
        # routed now is the LLM's).
        last = min(read.reach, index - 1 if decisions.held[i] or routed_now else index)
        found = verification.first_rejection(s, read, last, routing.proposed[i],
                                             routing.deferral.mode == "park", context.llm.full_logits)
        if found:
            decisions.rejected[i], decisions.held[i] = found, False
            return
        s.checks.through(index if routed_now else last)
        if s.checks.ends is not None and not s.pending:
            decisions.ended.add(i)
            return
    if decisions.held[i]:
        return
    if routed_now:
        decisions.llm_logits[i] = read.at(read.reach)
        token, faults = sample_rows(decisions.llm_logits[i][None], [s])
        if faults:
            raise faults[0]
        decisions.chosen[i] = token[0]
    elif routing.deferred[i]:
        verification.defer(s, index, None if proposal.logits is None else proposal.logits[i])


def emit_row(tokenizer, i: int, s: Sequence, token: int, proposal: Proposal, decisions: Decisions, dropped: int,
             now: float) -> Step | Failure | None:
    """Row i's part of `Batch._emit`: its step, a failure of its own settings or output, or None where it stands
    still."""
    gen = s.generation
    if i in decisions.ended:
        gen.finish_reason, s.checks.ends = s.checks.ends, None
        gen.text, gen.stop_reason = final_text(tokenizer, s)
        return Step(s, gen.token_ids[-1], gen.sources[-1], gen.scores[-1], True, 0, verification.settle(s, True))
    gen.elapsed_s = now - s.started
    if decisions.held[i]:
        return None
    source, score = decisions.sources[i], decisions.scores[i]
    try:
        logits = decisions.llm_logits.get(i, proposal.logits[i] if proposal.logits is not None else None)
        record(s, token, source, score, logits if gen.logprobs is not None else None)
        reason = ends(tokenizer, s, gen.token_ids)
        if reason and s.pending:  # the LLM checks its tokens first: the row waits for that
            s.checks.ends, reason = reason, None
        if reason:
            gen.finish_reason = reason
            gen.text, gen.stop_reason = final_text(tokenizer, s)
    except Exception as e:  # noqa: BLE001 - one row's output: it alone fails
        return Failure(s, e)
    return Step(s, token, source, float(score), reason is not None, dropped, verification.settle(s, bool(reason)))


# --- the helpers --------------------------------------------------------------------------------------------------


def output_index(s: Sequence, column: int, width: int) -> int:
    """The output index of row `s`'s token at a column of a batch `width` columns wide (its newest token, at column
    width - 1, is its output's last)."""
    return column - width + len(s.generation.token_ids)


def row_thresholds(policy, sequences: list[Sequence], device) -> torch.Tensor | None:
    """Per-row thresholds (a request's own, or the one its target LLM rate gives: routing/rate.py), or None when
    every row uses the policy's own."""
    if all(s.request.threshold is None and s.request.target_rate is None for s in sequences):
        return None
    return torch.tensor([rate.row_threshold(policy, s.request.threshold, s.request.target_rate,
                                            len(s.generation.token_ids), s.generation.llm_tokens, s.generation.scores)
                         for s in sequences], device=device)


def record(s: Sequence, token: int, source: str, score: float, logits: torch.Tensor | None) -> None:
    """A token into the row's output, with who wrote it, the policy's score and (when asked) its log-probability
    under the logits of the model that wrote it."""
    gen = s.generation
    gen.token_ids.append(token)
    gen.sources.append(source)
    gen.scores.append(float(score))
    if gen.logprobs is not None:
        gen.logprobs.append(logprob_entries(logits[None], [token], s.params.logprobs)[0])


def ends(tokenizer, s: Sequence, tokens: list[int], then: int | None = None) -> str | None:
    """Why an output of these tokens (followed by `then`, if given) is complete ("stop" or "length"), or None.
    Before it holds `min_tokens` nothing but the length ends it, and a stop string must end after their text
    (vLLM's rule)."""
    params = s.params
    longest = max(map(len, params.stop), default=0)
    # Decode only the tail: enough tokens to hold the longest stop string.
    tail = tokens[-(longest + 2) :] if then is None else [*tokens[-(longest + 1) :], then]
    length = len(tokens) + (then is not None)
    if length > params.min_tokens:
        if tail[-1] in s.ending_ids:
            return "stop"
        if params.stop:
            in_prefix = max(0, params.min_tokens - (length - len(tail)))  # tail tokens within the first min_tokens
            decode = functools.partial(tokenizer.decode, skip_special_tokens=params.skip_special_tokens)
            if stop_at(decode(tail), params.stop, len(decode(tail[:in_prefix])) if in_prefix else 0):
                return "stop"
    if length >= params.max_new_tokens:
        return "length"
    return None


def stop_at(text: str, stops: tuple[str, ...], after: int = 0) -> tuple[int, str] | None:
    """Where the first stop string in `text` that ends beyond character `after` starts, and which it is."""
    found = [(text.find(stop, max(0, after - len(stop) + 1)), stop) for stop in stops]
    return min(((at, stop) for at, stop in found if at >= 0), key=lambda f: f[0], default=None)


def final_text(tokenizer, s: Sequence) -> tuple[str, str | int | None]:
    """The output's text as a client gets it: up to the stop string or the token (a stop token, an end of sequence)
    that ended it (through it, with `include_stop_str_in_output`); and what stopped it, as vLLM's `stop_reason`
    says: the stop string, or the stop token's id (None: an end of sequence, or no stop)."""
    params, gen = s.params, s.generation
    ids = gen.token_ids
    ended_on_token = gen.finish_reason == "stop" and ids and ids[-1] in s.ending_ids
    reason = ids[-1] if ended_on_token and ids[-1] in params.stop_token_ids else None
    if ended_on_token and not params.include_stop_str_in_output:
        ids = ids[:-1]
    decode = functools.partial(tokenizer.decode, skip_special_tokens=params.skip_special_tokens)
    text = decode(ids)
    after = len(decode(ids[: params.min_tokens])) if params.min_tokens else 0
    found = stop_at(text, params.stop, after) if params.stop else None
    if found is None:
        return text, reason
    at, stop = found
    return (text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]), stop


def count_time(t: Timings, writer_source: str, writer_s: float, router_s: float, llm_s: float, total_s: float,
               llm_ran: bool) -> None:
    """A step's seconds, added to one row's timings (a batched step counts for each of its rows)."""
    if writer_source == "slm":
        t.slm_s += writer_s
    else:
        t.llm_s += writer_s
    t.router_s += router_s
    t.llm_s += llm_s
    t.total_s += total_s
    t.steps += 1
    t.llm_calls += llm_ran


def sample_rows(logits: torch.Tensor, sequences: list[Sequence]) -> tuple[torch.Tensor, dict[int, Exception]]:
    """Each row's next token from a model's logits [B, V], with its request's penalties and sampling settings
    (greedy rows that change nothing in one argmax); and the rows whose own settings failed them (a row its
    settings leave no token: `NothingToWrite`), by index, whose token is a placeholder: they fail alone."""
    tokens, faults = logits.argmax(-1), {}
    for i, s in enumerate(sequences):
        if s.params.temperature > 0 or s.params.adjusted:
            try:
                row = s.logits_at(logits[i], len(s.generation.token_ids))[None]
                tokens[i] = sample(row, s.params, s.generator)[0]
            except Exception as e:  # noqa: BLE001 - whatever one row's settings raise, the others go on
                faults[i] = e
    return tokens, faults
