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

Top to bottom: `Call` and `StepRecord` (what a step's phases hand each other), `Batch` (the five phases), then
the helpers: when an output ends, time accounting, log-probabilities, sampling rows. The `Scheduler`
(scheduler.py) decides which sequences are in the batch; `Engine` (engine.py) is what clients call.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from roads_to_rome.core import verification
from roads_to_rome.core.layout import Layout
from roads_to_rome.core.llm_calls import PendingRead, llm_due
from roads_to_rome.core.request import Cancelled, Failure, Sequence, Step, Timings, TokenLogprob
from roads_to_rome.core.sampling import sample, sampling_probs
from roads_to_rome.errors import LLMUnavailable
from roads_to_rome.routing import rate

if TYPE_CHECKING:
    from roads_to_rome.core.engine import Engine
    from roads_to_rome.core.scheduler import PromptRead


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


@dataclass
class StepRecord:
    """What the phases of one decode step hand each other (`Batch.step`), row by row."""

    column: int  # where this step's tokens go
    proposal: torch.Tensor | None = None  # the writer's token per row
    proposed: list[int] | None = None  # ... as numbers (a pair's: the LLM's checks read them)
    slm_logits: torch.Tensor | None = None  # None when the SLM did not run (every row forces the LLM)
    hidden: torch.Tensor | None = None
    routed: list[bool] = field(default_factory=list)  # the LLM takes this row's token
    scores: list[float] = field(default_factory=list)  # the policy's score behind each decision
    deferred: list[bool] = field(default_factory=list)  # routed, and its token may wait for a grouped call
    held: list[bool] = field(default_factory=list)  # stands still: waits for the call in flight (`_stands_still`)
    due: bool = False  # the LLM's rule calls it this step (`llm_due`)
    reads: list[verification.RowRead | None] | None = None  # the LLM's word on each row this step (None: none)
    full: bool = False  # the reads reach this step's tokens: routed rows take the LLM's
    chosen: torch.Tensor | None = None  # the token each row writes
    sources: list[str] = field(default_factory=list)
    rejected: dict[int, verification.Rejection] = field(default_factory=dict)  # row -> its first rejected token
    ended: set[int] = field(default_factory=set)  # rows whose end the LLM has now checked: they leave
    failed: dict[int, Exception] = field(default_factory=dict)  # rows whose LLM call failed
    llm_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> the LLM's logits its token came from

    def writer_of(self, i: int) -> torch.Tensor | None:
        """The logits row i's token came from: the LLM's where it wrote it, else the writer's."""
        if i in self.llm_logits:
            return self.llm_logits[i]
        return None if self.slm_logits is None else self.slm_logits[i]


class Batch:
    """Sequences decoding in lockstep: one row each in the caches of the models that read it (`Engine.readers`: a
    sequence forced onto one model is in that model's only).

    Sequences can join between steps (continuous batching): a newcomer is left-padded to the
    batch's width (or the batch to the newcomer's) and prefilled up to where each model's cache
    already is, then its cache rows are appended. Finished and cancelled sequences leave.
    """

    def __init__(self, engine: Engine, prefixes: tuple = (None, None)):
        """`prefixes`: the writer's and the LLM's kept prompts (core/prefix_cache.py; None: a model keeps none)."""
        self.engine, self.prefixes = engine, prefixes
        self.sequences: list[Sequence] = []
        self.layout = Layout(engine)  # the token streams and both caches
        self.call: Call | None = None  # (overlap) the LLM's catch-up in flight

    def add(self, sequences: list[Sequence], prefill: PromptRead | None = None) -> None:
        """Sequences join the batch: left-padded to its width, read up to where each cache is. A sequence may
        bring its prompt already read (`prefill`: the scheduler's chunked prefill, for one sequence)."""
        now = time.perf_counter()
        for s in sequences:
            s.started = s.started or now  # (a preempted sequence that resumes started earlier)
        self._join(sequences, prefill)

    def _join(self, sequences: list[Sequence], prefill: PromptRead | None) -> None:
        self.layout.join([s.context_ids for s in sequences], [self.engine.readers(s) for s in sequences],
                         prefill.per_model if prefill else None)
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
        a last step (`Failure`: cancelled, or the LLM call their tokens waited for failed)."""
        cancelled = [s for s in self.sequences if s.cancelled]
        self._keep([i for i, s in enumerate(self.sequences) if not s.cancelled])
        left = [Failure(s, Cancelled()) for s in cancelled]
        if not self.sequences:
            return left
        step = StepRecord(self.ids.shape[1])
        t0 = time.perf_counter()
        self._propose(step)
        t1 = time.perf_counter()
        self._route(step)
        t2 = time.perf_counter()
        self._catch_up(step)
        self._verify(step)
        t3 = time.perf_counter()
        events = self._emit(step, (t0, t1, t2, t3))
        self._send_call(step)
        return left + events

    def _propose(self, step: StepRecord) -> None:
        """1. The writer (the SLM of a pair) reads the columns it has not read yet of the rows it writes for (not
        those forced onto the LLM) and proposes a token per row: (proposal, its logits, its last hidden state). A
        row forced onto the LLM gets a placeholder (the LLM's token takes its place) and zero logits; when every row
        is one, the SLM does not run, so "LLM alone" through a pair costs the LLM alone."""
        engine, sequences, layout = self.engine, self.sequences, self.layout
        step.proposal = self.ids[:, -1].clone()
        if not layout.writer_rows:
            return
        cache, rows = layout.writer_cache, layout.writer_rows
        engine.writer.tag_rows(cache, [sequences[i].request.cache_salt for i in rows])  # (an LLM alone, served)
        logits, hidden = engine.writer.forward(cache, layout.writer_part(self.ids[:, cache.length :]),
                                               layout.writer_part(self.mask))
        writing = [sequences[i] for i in rows]
        proposal, faults = sample_rows(logits, writing)
        step.failed.update((rows[j], e) for j, e in faults.items())
        if len(rows) < len(sequences):  # back to one row per sequence
            index = torch.tensor(rows, device=logits.device)
            logits = logits.new_zeros(len(sequences), logits.shape[1]).index_copy_(0, index, logits)
            hidden = hidden.new_zeros(len(sequences), hidden.shape[1]).index_copy_(0, index, hidden)
            proposal = step.proposal.index_copy_(0, index.to(step.proposal.device), proposal)
        step.proposal, step.slm_logits, step.hidden = proposal, logits, hidden
        for i in rows:
            s = sequences[i]
            if s.verify.strict and s.params.temperature > 0 and i not in step.failed:  # the ratio test needs
                index = len(s.generation.token_ids)  # what the SLM drew from
                s.checks.draft_probs[index] = sampling_probs(s.logits_at(logits[i], index)[None], s.params)[0]
        engine.sync()

    def _route(self, step: StepRecord) -> None:
        """2. The policy decides which rows the LLM takes (a request may force one model), and which of those may
        wait for a grouped call (--defer; every routed row with --overlap), not forced onto the LLM (a request that
        asks for the LLM alone gets it at once)."""
        engine, n = self.engine, len(self.sequences)
        if step.slm_logits is None:  # the SLM is idle: every row is the LLM's
            step.routed, step.scores = [True] * n, [0.0] * n
        elif not engine.routes:  # one model alone writes every token
            step.routed, step.scores = [False] * n, [0.0] * n
        else:  # the policy looks at the rows the SLM wrote for; a row forced onto the LLM is the LLM's
            rows = self.layout.writer_rows
            inputs = (step.slm_logits, step.hidden, step.proposal)
            if len(rows) < n:
                index = torch.tensor(rows, device=step.slm_logits.device)
                inputs = tuple(t.index_select(0, index.to(t.device)) for t in inputs)
            writing = [self.sequences[i] for i in rows]
            to_llm, scores = engine.policy.route(*inputs, row_thresholds(engine.policy, writing, self.ids.device))
            step.routed, step.scores = [s.force == "llm" for s in self.sequences], [0.0] * n
            for i, s, x, score in zip(rows, writing, to_llm.tolist(), scores.tolist()):
                step.routed[i], step.scores[i] = (s.force == "llm" if s.force else bool(x)), score
        for i in step.failed:  # a row that failed writes nothing: the LLM need not read it for this step
            step.routed[i] = False
        step.held = [False] * n
        on = engine.deferral.on
        step.deferred = [on and r and s.force is None for s, r in zip(self.sequences, step.routed)]
        # The proposal as numbers, for the LLM's checks (one model alone checks nothing: no GPU sync for it here).
        step.proposed = step.proposal.tolist() if engine.routes else None

    def _catch_up(self, step: StepRecord) -> None:
        """3. The LLM's word on the rows: a call sent at an earlier step, once it has answered (overlap: taken at the
        first step after it is ready, or waited for when a row needs the LLM's token now), and a read of every
        column since the LLM last read, when it is needed now (`llm_due` without overlap; a request forcing the LLM
        with it). `step.reads[i]`: the LLM's logits over row i's unchecked tokens (None: nothing for it this step)."""
        engine, sequences = self.engine, self.sequences
        if not engine.routes:
            return
        column, read_from = step.column, self.layout.llm_cache.length
        unread = [verification.unread_tokens(s, column, read_from) for s in sequences]
        step.due = llm_due(sequences, step.routed, step.deferred, unread, lambda i: self._would_end(step, i),
                           engine.deferral)
        now = any(r and not d for r, d in zip(step.routed, step.deferred)) or (step.due and not engine.overlap)
        held = [self._stands_still(s, unread[i]) for i, s in enumerate(sequences)]
        landed = None
        if self.call is not None and (now or self.call.done() or all(held)):  # (no row could write: wait for it)
            call, self.call = self.call, None
            landed = self._answers(call, step)
        # A row the answer frees goes on at once; one whose end it has not checked stands still.
        step.held = [self._stands_still(s, unread[i]) for i, s in enumerate(sequences)]
        if now:
            fresh = self._answers(self._send(column, now=True), step)
            if landed is not None:
                fresh = [f if old is None or f is None else old.merged(f) for old, f in zip(landed, fresh)]
            landed, step.full = fresh, True
        step.reads = landed

    def _stands_still(self, s: Sequence, unread: int) -> bool:
        """Whether a row waits, writing nothing, for the call in flight: its output ended on a token the LLM has to
        check; or, while tokens of it wait for the LLM's word, it has written max_unverified tokens, or the deferral
        rule's `tokens_ahead`, beyond what the LLM was asked to read: what a roll-back may throw away, and what a
        stalled LLM's server lets it write, stays bounded."""
        if s.checks.ends is not None:
            return True
        if self.call is None or not s.checks.pending(s):
            return False
        if s.verify.on and s.max_unverified is not None and unread > s.max_unverified:
            return True
        return unread > self.engine.deferral.tokens_ahead(len(self.sequences))

    def _answers(self, call: Call, step: StepRecord) -> list[verification.RowRead | None]:
        """A call's logits, one `RowRead` per row of the batch now (None for a row that joined after it was sent).
        If the LLM's server cannot be reached, the rows whose tokens wait for the LLM fail (`step.failed`); the
        others go on without its word (they need none)."""
        try:
            logits = call.pending.result()
        except LLMUnavailable as e:
            for i, s in enumerate(self.sequences):
                if s.checks.pending(s) or s.checks.ends or step.routed[i]:
                    step.failed.setdefault(i, e)
            return [None] * len(self.sequences)
        rows = {id(s): j for j, s in enumerate(call.sequences)}
        reads = []
        for s in self.sequences:
            j = rows.get(id(s))
            reads.append(None if j is None else verification.RowRead(
                logits[j], call.reach[j] - call.keep + 1, call.reach[j]))
        return reads

    def _send(self, column: int, now: bool = False) -> Call:
        """Ask the LLM to read every column since it last did, up to `column` (not included): its last logits predict
        what sits at `column`. Returns at once with overlap (a worker reads), after the read without. Logits come
        back for the rows that need them: a row with tokens waiting for the LLM's word, from its first; each row's
        last, for this step's routed rows, when the read is needed `now`."""
        layout = self.layout
        sequences = [self.sequences[i] for i in layout.llm_rows]  # (a row the LLM never reads is not sent)
        read_from, width = layout.llm_cache.length, self.ids.shape[1]
        # Row i's output index at `column`: the furthest token the read can check.
        reach = [column - width + len(s.generation.token_ids) for s in sequences]
        row_keep = [min(column - read_from, verification.logits_needed(s, r))
                    if now or s.checks.pending(s) or s.checks.ends else 0 for s, r in zip(sequences, reach)]
        pending = self.engine.llm_side.catch_up(layout.llm_cache, layout.llm_part(self.ids[:, read_from:column]),
                                                layout.llm_part(self.mask[:, :column]), row_keep,
                                                [s.request.cache_salt for s in sequences])
        return Call(pending, sequences, reach, max(row_keep))

    def _send_call(self, step: StepRecord) -> None:
        """(overlap) After the step, the next call, to run beside the SLM's next steps: when one is due and none is in
        flight. It reads every column but the newest (the LLM's cache stays short of the batch's width, as a joining
        row's reads expect), so it checks every token written so far."""
        if not (self.engine.overlap and step.due and self.call is None and self.sequences):
            return
        column = self.ids.shape[1] - 1
        if column > self.layout.llm_cache.length and any(s.checks.pending(s) or s.checks.ends for s in self.sequences):
            self.call = self._send(column)

    def _verify(self, step: StepRecord) -> None:
        """4. The LLM's word on each row it read: its unchecked tokens in order (the first rejected one sends the
        row back there), then, where the read reaches this step's token, the routed rows' tokens. A row whose
        output ended on an unchecked token ends once they are checked; until then it stands still. Without the
        LLM's word deferred rows keep the SLM's token, to be checked at a later call."""
        engine, sequences = self.engine, self.sequences
        step.chosen = step.proposal.clone()
        step.sources = ["llm" if r else engine.writer_source for r in step.routed]
        reads = step.reads or [None] * len(sequences)
        park, full_logits = engine.deferral.mode == "park", engine.routes and engine.llm.full_logits
        if step.reads is not None:
            engine.counters.llm_calls += 1
        for i, s in enumerate(sequences):
            read, routed_now = reads[i], step.routed[i] and step.full and not step.held[i]
            if i in step.failed:
                continue
            count = len(s.generation.token_ids)
            if read is not None:
                engine.counters.routed_rows += routed_now or bool(s.checks.routed)
                # This step's token is checked only where the read reaches it and the row writes one.
                last = min(read.reach, count - 1 if step.held[i] or routed_now else count)
                try:
                    found = verification.first_rejection(s, read, last, step.proposed[i], park, full_logits)
                except Exception as e:  # this row's settings or format: it alone fails
                    step.failed[i] = e
                    continue
                if found:
                    step.rejected[i] = found
                    step.held[i] = False
                    continue
                s.checks.through(count if routed_now else last)  # a token routed now is the LLM's own
                if s.checks.ends is not None and not s.checks.pending(s):
                    step.ended.add(i)
                    continue
            if step.held[i]:
                continue
            if routed_now:
                step.llm_logits[i] = read.at(read.reach)
                token, faults = sample_rows(step.llm_logits[i][None], sequences[i : i + 1])
                if faults:
                    step.failed[i] = faults[0]
                    continue
                step.chosen[i] = token[0]
            elif step.deferred[i]:
                verification.defer(s, count, None if step.slm_logits is None else step.slm_logits[i])

    def _emit(self, step: StepRecord, times: tuple[float, ...]) -> list[Step | Failure]:
        """5. Rows whose check rejected a token go back to it (their later tokens are discarded and the LLM's
        token goes in its place); rows that stand still stay where they are; then the new column is appended, each
        row's token recorded, and finished rows leave the batch, kept where a model keeps what it read (prefix
        caching). A row whose output ends on a token the LLM has yet to check stays, standing still, until it has."""
        dropped = self._roll_back(step)
        self.layout.append_column(step.chosen)
        t0, t1, t2, t3 = times
        now = time.perf_counter()
        events, keep, finished = [], [], []
        self.engine.counters.steps += 1
        llm_ran = step.reads is not None
        for i, (s, token, source, score) in enumerate(zip(self.sequences, step.chosen.tolist(), step.sources,
                                                          step.scores)):
            gen = s.generation
            count_time(gen.timings, self.engine.writer_source, t1 - t0, t2 - t1, t3 - t2, now - t0,
                       llm_ran and step.reads[i] is not None)
            if i in step.failed:
                events.append(Failure(s, step.failed[i]))
                continue
            if i in step.ended:
                gen.finish_reason, s.checks.ends = s.checks.ends, None
                gen.text, gen.stop_reason = final_text(self.engine.tokenizer, s)
                events.append(Step(s, gen.token_ids[-1], gen.sources[-1], gen.scores[-1], True, 0,
                                   verification.settle(s, True)))
                finished.append(i)
                continue
            gen.elapsed_s = now - s.started
            if step.held[i]:
                keep.append(i)
                continue
            try:
                record(s, token, source, score, step.writer_of(i) if gen.logprobs is not None else None)
                reason = ends(self.engine, s, gen.token_ids)
                if reason and s.checks.pending(s):  # the LLM checks its tokens first: the row waits for that
                    s.checks.ends, reason = reason, None
                if reason:
                    gen.finish_reason = reason
                    gen.text, gen.stop_reason = final_text(self.engine.tokenizer, s)
            except Exception as e:  # noqa: BLE001 - one row's output: it alone fails
                events.append(Failure(s, e))
                continue
            if reason:
                finished.append(i)
            else:
                keep.append(i)
            events.append(Step(s, token, source, float(score), reason is not None, dropped.get(i, 0),
                               verification.settle(s, reason is not None)))
        self._keep_reads(finished)
        self._keep(keep)
        return events

    def _would_end(self, step: StepRecord, i: int) -> bool:
        """Whether row i's output ends with this step's token, or ended on a token the LLM still has to check."""
        s = self.sequences[i]
        return s.checks.ends is not None or ends(self.engine, s, s.generation.token_ids, step.proposed[i]) is not None

    def _roll_back(self, step: StepRecord) -> dict[int, int]:
        """Put each rejecting row back to its rejected token, the LLM's token there, and keep each row that stands
        still where it is (its last token taken back and written again); returns how many earlier tokens each
        rejecting row dropped. Each row moves right by what it drops (`Layout.shift`: masking the dropped columns in
        place would leave holes in the middle of rows that every backend's positions would have to skip)."""
        column, sequences = step.column, self.sequences
        shifts = [0] * len(sequences)
        for i, rejection in step.rejected.items():
            shifts[i] = len(sequences[i].generation.token_ids) - rejection.index
        for i, held in enumerate(step.held):
            if held and i not in step.ended and i not in step.failed:
                shifts[i] = 1
                step.chosen[i] = self.ids[i, column - 1]
        if any(shifts):
            self.layout.shift(shifts)
        for i, rejection in step.rejected.items():
            score = verification.take_back(sequences[i], rejection)
            if score is not None:
                step.scores[i] = score  # the policy's score at the rejected position
            step.chosen[i], step.sources[i] = rejection.token, "llm" if rejection.routed else "fix"
            step.llm_logits[i] = rejection.logits
        return {i: shifts[i] for i in step.rejected}

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
        gen.logprobs.append(token_logprob(logits, token, s.params.logprobs))


def ends(engine: Engine, s: Sequence, tokens: list[int], then: int | None = None) -> str | None:
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
            decode = functools.partial(engine.tokenizer.decode, skip_special_tokens=params.skip_special_tokens)
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


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """A token's log-probability in the distribution these logits give, the `top` most likely tokens', and its rank."""
    logprobs = torch.log_softmax(logits.float(), -1)
    values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0])
    own = logprobs[token]
    return TokenLogprob(float(own), list(zip(ids.tolist(), values.tolist())), int((logprobs > own).sum()) + 1)


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
