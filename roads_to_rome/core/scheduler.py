"""Which sequences decode, which wait, and when a newcomer's prompt is read: the one loop every client drives
(`Scheduler`), and a newcomer's prompt read in chunks before it joins (`PromptRead`)."""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from roads_to_rome.core.batch import Batch
from roads_to_rome.core.layout import NO_ROWS
from roads_to_rome.core.prefix_cache import PrefixCache, common_prefix, kept_prompt_rows
from roads_to_rome.core.request import Cancelled, Failure, Request, Sequence, Step
from roads_to_rome.core.scoring import score_prompt
from roads_to_rome.errors import R2RError

if TYPE_CHECKING:
    from roads_to_rome.core.context import Context


@dataclass(frozen=True)
class Scheduling:
    """How a `Scheduler` admits sequences and reads their prompts (the server's: serving/limits.py)."""

    # Prompt tokens each model reads per turn, a newcomer's prompt alone, between decode steps (None: newcomers join
    # the batch at once and its next decode step reads their prompts together, unless prefix caching reads each alone)
    prefill_chunk: int | None = None
    # Prompt tokens each model keeps for newcomers that begin the same way (0: none; a model behind a server keeps
    # none here, its server caches)
    prefix_tokens: int = 0
    # Waiting sequences are admitted by their request's priority (lower first), then in arrival order, and one that
    # finds no room preempts less urgent admitted ones (vLLM's priority scheduling: `_preempt_for`)
    by_priority: bool = False


def too_long(request: Request, context: Context) -> R2RError | None:
    """Why a request can never run here, or None: its prompt and new tokens past the tokens one sequence may hold (the
    models' context length, or a server's) or past what the KV cache holds for every row together. The advice
    depends on which part does not fit: fewer new tokens only help a prompt that fits."""
    need, prompt = request.kv_tokens, len(request.prompt_ids)
    limits = [(n, what) for n, what in ((context.max_context, "the models read at most (their context length)"),
                                        (context.kv_capacity, "the KV cache holds")) if n is not None and need > n]
    if not limits:
        return None
    limit, what = min(limits)
    fix = (f"shorten the prompt ({prompt} tokens) below {limit}" if prompt >= limit
           else f"ask for at most {limit - prompt} new tokens")
    return R2RError(f"this request needs {need} tokens (prompt and max new tokens), more than the {limit} {what}: "
                    f"{fix}")


class Scheduler:
    """Which sequences decode, which wait, and when a newcomer's prompt is read: the one loop every client drives.

    Each turn admits waiting sequences, first come first served (or by priority, then arrival: `by_priority`, which
    also preempts less urgent admitted sequences to make room for a more urgent one), while a slot is free and their
    KV tokens fit;
    reads one chunk of one admitted prompt (chunked prefill, round robin); and runs one decode step of the batch.
    With prefix caching, each model keeps the prompts it has read (core/prefix_cache.py), and a newcomer's read
    starts from the longest beginning of its prompt one of them shares; a newcomer that shares most of its prompt with
    one being read (the n choices of a prompt, arriving together) waits for that read and starts from what it kept.
    The server drives it from its engine thread, a turn at a time between arrivals; `Engine.run` and
    `Engine.stream` (generate, chat, eval, the label pipeline) to the end. A sequence leaves reporting it once:
    its last `Step` (finished) or a `Failure`."""

    def __init__(self, context: Context, max_batch: int | None = None, scheduling: Scheduling | None = None):
        """`max_batch`: sequences decoding or having their prompt read at once (None: no limit); `scheduling`: how
        they are admitted and read (`Scheduling`)."""
        scheduling = scheduling or Scheduling()
        self.context, self.max_batch, self.prefill_chunk = context, max_batch, scheduling.prefill_chunk
        self.by_priority = scheduling.by_priority
        self.prefixes = prefix_caches(context, scheduling.prefix_tokens, max_batch)
        self.batch = Batch(context, self.prefixes)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.reading: collections.deque[tuple[Sequence, PromptRead]] = collections.deque()  # admitted, prompt in chunks
        self.joining: list[Sequence] = []  # admitted, to join the batch at the next decode step
        self.kv_in_use = 0  # KV tokens held by admitted sequences (each its prompt and max new tokens)
        self.arrivals = itertools.count()
        # The last prompt scored, and its entries: a request's other choices take them instead of scoring it again
        self.scored: tuple[tuple, tuple] | None = None

    def add(self, sequence: Sequence) -> None:
        sequence.arrival = next(self.arrivals)
        self._queue(sequence)

    def _queue(self, sequence: Sequence) -> None:
        """Into the waiting queue: at its end, or by priority then arrival (behind those as urgent that came first)."""
        if not self.by_priority:
            self.waiting.append(sequence)
            return
        rank = urgency(sequence)
        place = next((i for i, s in enumerate(self.waiting) if urgency(s) > rank), len(self.waiting))
        self.waiting.insert(place, sequence)

    @property
    def admitted(self) -> int:
        return len(self.batch.sequences) + len(self.reading) + len(self.joining)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.admitted)

    def load(self) -> dict:
        return {"running": self.admitted, "prefilling": len(self.reading),
                "waiting": sum(not s.cancelled for s in self.waiting)}

    def turn(self) -> list[Step | Failure]:
        return self.admit() + self.advance()

    def admit(self) -> list[Failure]:
        """Waiting sequences take a slot while one is free and their KV tokens fit; the cancelled ones leave. A
        sequence that asks for its prompt's log-probabilities has them scored as it is admitted."""
        left, capacity = [], self.context.kv_capacity
        prefixes = [p for p in self.prefixes if p is not None and p.model.kv_capacity is not None]
        while self.waiting:
            s = self.waiting[0]
            need, refusal = s.request.kv_tokens, Cancelled() if s.cancelled else too_long(s.request, self.context)
            if refusal is not None:
                self.waiting.popleft()
                left.append(Failure(s, refusal))
                continue
            full = self.max_batch is not None and self.admitted >= self.max_batch
            if full or (capacity is not None and self.kv_in_use + need > capacity):
                if self.by_priority and self._preempt_for(s):
                    continue
                break  # the head waits for room
            if capacity is not None:
                make_room(prefixes, capacity - self.kv_in_use - need)
            self.waiting.popleft()
            if s.request.prompt_logprobs is not None and s.generation.prompt_logprobs is None \
                    and self.scored is not None and self.scored[0] == scoring_key(s):  # another choice of its request
                s.generation.prompt_logprobs, s.generation.prompt_sources = self.scored[1]
            if s.request.prompt_logprobs is not None and s.generation.prompt_logprobs is None:
                read = PromptRead(self.context, s, self.prefixes, reuse=False)  # (scored from its first token)
                try:  # (the scoring models read the whole prompt at once: a turn as long as an unchunked prefill)
                    s.generation.prompt_logprobs, s.generation.prompt_sources = score_prompt(
                        self.context, s, read.per_model)
                    self.scored = (scoring_key(s), (s.generation.prompt_logprobs, s.generation.prompt_sources))
                except Exception as e:  # only this sequence fails
                    read.release()
                    left.append(Failure(s, e))
                    continue
                self.reading.append((s, read))  # the prompt is read: what is left of it is the other model's
            elif self.prefill_chunk or any(self.prefixes):
                try:
                    read = PromptRead(self.context, s, self.prefixes, follows=self._read_to_follow(s))
                except Exception as e:  # only this sequence fails
                    left.append(Failure(s, e))
                    continue
                self.reading.append((s, read))
            else:
                self.joining.append(s)
            self.kv_in_use += need
        return left

    def advance(self) -> list[Step | Failure]:
        """One chunk of one admitted prompt, then one decode step of the batch."""
        return self._read_one_chunk() + self._decode_step()

    def drop_waiting(self, error: Exception) -> list[Failure]:
        """Every sequence waiting to start leaves with this error (a server that stops admitting); preempted ones
        stay, to finish as the others in flight do."""
        return [Failure(s, error) for s in self._take_waiting(preempted=False)]

    def cut(self, error: Exception) -> list[Failure]:
        """Every sequence in flight leaves with this error (a server's drain deadline): the admitted ones, and the
        preempted ones waiting to resume."""
        cut, preempted = self._admitted(), self._take_waiting(preempted=True)
        for s in cut + preempted:
            s.cancelled = True
        for _, read in self.reading:
            read.release()
        self.reading.clear()
        self.joining.clear()
        self.batch.release()
        return [self._leave(s, Failure(s, error)) for s in cut] + [Failure(s, error) for s in preempted]

    def _take_waiting(self, preempted: bool) -> list[Sequence]:
        """The waiting sequences that were preempted (or that never started), out of the queue."""
        taken = [s for s in self.waiting if bool(s.preemptions) == preempted]
        self.waiting = collections.deque(s for s in self.waiting if bool(s.preemptions) != preempted)
        return taken

    def _preempt_for(self, s: Sequence) -> bool:
        """(priority scheduling) Make room for `s` by preempting admitted sequences less urgent than it, the least
        urgent first (the latest to arrive among equals), as vLLM does: each leaves the batch with what it wrote and
        goes back to the queue, to read its prompt and output again (from what prefix caching kept of them) when
        there is room. False, preempting none, when those it could preempt would not make room."""
        capacity = self.context.kv_capacity
        slots = 0 if self.max_batch is None else self.admitted + 1 - self.max_batch  # slots short
        tokens = 0 if capacity is None else self.kv_in_use + s.request.kv_tokens - capacity  # KV tokens short
        candidates = [v for v in self._admitted() if urgency(v) > urgency(s) and not v.cancelled]
        victims = []
        for v in sorted(candidates, key=urgency, reverse=True):
            if slots <= 0 and tokens <= 0:
                break
            victims.append(v)
            slots, tokens = slots - 1, tokens - v.request.kv_tokens
        if slots > 0 or tokens > 0:
            return False
        for v in victims:
            self._preempt(v)
        return True

    def _admitted(self) -> list[Sequence]:
        return [s for s, _ in self.reading] + self.joining + self.batch.sequences

    def _preempt(self, s: Sequence) -> None:
        """`s` leaves the batch (or its prompt's read, keeping what was read) and waits again."""
        if s in self.batch.sequences:
            self.batch.remove([s])
        elif s in self.joining:
            self.joining.remove(s)
        else:
            read = next(read for other, read in self.reading if other is s)
            self.reading = collections.deque((o, r) for o, r in self.reading if o is not s)
            if read.started:
                read.keep()
            read.release()
        self.kv_in_use -= s.request.kv_tokens
        s.preemptions += 1
        self.context.counters.preemptions += 1
        self._queue(s)

    def forget_kept(self) -> None:
        """Let go of every kept prompt now (on llama.cpp: their sequences and cells go back to the context)."""
        for prefixes in self.prefixes:
            if prefixes is not None:
                prefixes.clear()

    def _read_to_follow(self, s: Sequence) -> PromptRead | None:
        """The read in progress that shares the longest beginning with `s`'s prompt, if that is most of it (the n
        choices of one prompt; prompts that share a long system message): `s` waits for it to be read and kept and
        then reads only the rest, instead of reading it all beside it. None: `s` reads at once."""
        if not any(self.prefixes):
            return None
        goal = len(s.context_ids) - 1
        prompt, best, most = np.asarray(s.context_ids[:goal]), None, 0
        for other, read in self.reading:
            if other.request.cache_salt == s.request.cache_salt:
                shared = common_prefix(np.asarray(read.prompt[: read.goal]), prompt)
                if shared > most:
                    best, most = read, shared
        return best if 2 * most >= max(goal, 1) else None

    def _read_one_chunk(self) -> list[Failure]:
        left = []
        while self.reading and self.reading[0][0].cancelled:
            s, _ = self.reading.popleft()
            left.append(self._leave(s, Failure(s, Cancelled())))
        reading = {id(read) for _, read in self.reading}
        for _ in range(len(self.reading)):  # a read that follows one still in progress waits for it
            if id(self.reading[0][1].follows) not in reading:
                break
            self.reading.rotate(-1)
        else:
            return left
        s, prefill = self.reading[0]
        try:
            if not prefill.started:  # (it waited for the read it follows)
                prefill.start()
            prefill.advance(self.prefill_chunk or prefill.goal)
            if not prefill.done:
                self.reading.rotate(-1)  # the next prompt gets the next chunk
                return left
            self.reading.popleft()
            prefill.keep()
            self.batch.add([s], prefill.per_model)  # leaves the batch as it was if it fails
        except Exception as e:  # only this sequence was being read: only it fails
            if self.reading and self.reading[0][0] is s:
                self.reading.popleft()
            prefill.release()
            left.append(self._leave(s, Failure(s, e)))
        return left

    def _decode_step(self) -> list[Step | Failure]:
        events, joining, self.joining = [], self.joining, []
        if joining:
            try:
                self.batch.add(joining)  # leaves the batch as it was if it fails
            except Exception as e:
                events = [self._leave(s, Failure(s, e)) for s in joining]
        before = list(self.batch.sequences)
        if not before:
            return events
        try:
            stepped = self.batch.step()
        except Exception as e:  # a step runs every row at once: fail the sequences in it, start a fresh batch
            failed, self.batch = self.batch, Batch(self.context, self.prefixes)
            failed.release()
            return events + [self._leave(s, Failure(s, e)) for s in before]
        return events + [self._leave(e.sequence, e) if isinstance(e, Failure) or e.finished else e for e in stepped]

    def _leave(self, sequence: Sequence, event: Step | Failure) -> Step | Failure:
        self.kv_in_use -= sequence.request.kv_tokens
        return event


class PromptRead:
    """A prompt read ahead, in chunks, before its sequence joins a batch.

    The scheduler reads a newcomer's prompt one chunk between two decode steps, so the sequences
    already decoding keep producing tokens while a long prompt is read. Each model reads the prompt
    alone, into a cache of its own, up to all but the prompt's last token (the sequence's first
    decode step reads that one and proposes the first new token); `Batch.add` fits that cache into
    the batch. A model does not read a prompt it will never be asked about (`Context.readers`): the LLM a request
    forced onto the SLM, the SLM one forced onto the LLM."""

    def __init__(self, context: Context, sequence: Sequence, prefixes: tuple = (None, None), reuse: bool = True,
                 follows: PromptRead | None = None):
        """`prefixes`: the writer's and the LLM's kept prompts (`Scheduler.prefixes`); `reuse`: whether the read may
        start from one of them (not when every position's output is wanted: a scored prompt). `follows`: a read in
        progress that shares most of this prompt, to wait for (`Scheduler.admit`): this one starts once it is done;
        otherwise it starts now."""
        writes, reads = context.readers(sequence)
        self.readers = (context.writer if writes else None, context.llm if reads else None)
        self.context, self.prefixes, self.reuse, self.follows = context, prefixes, reuse, follows
        self.sequence = sequence
        self.prompt = sequence.context_ids  # (a preempted sequence reads its output again too)
        self.goal = len(self.prompt) - 1
        self.salt = sequence.request.cache_salt
        self.ids = torch.tensor([self.prompt], device=context.writer.device)
        # (writer's cache, LLM's), None for a model that does not read it: as `Layout.join` takes them; made when
        # the read starts (`start`), from a kept prompt where one begins as this one does
        self.per_model: tuple | None = None
        self.models: list = []
        if follows is None:
            self.start()

    def start(self) -> None:
        """Make each reading model's cache: a copy of the kept prompt that shares the longest beginning with this
        one, where there is one (taken now, not when admitted: a read it followed has kept what it read by now)."""
        started = [(None, 0) if m is None or p is None or not self.reuse else p.take(self.prompt[: self.goal],
                                                                                    self.salt)
                   for m, p in zip(self.readers, self.prefixes)]
        self.per_model = tuple(None if m is None else cache if cache is not None else m.new_cache()
                               for m, (cache, _) in zip(self.readers, started))
        self.models = [(m, c, p) for m, c, p in zip(self.readers, self.per_model, self.prefixes) if m is not None]
        found = min(n for m, (_, n) in zip(self.readers, started) if m is not None)
        if not self.sequence.preemptions:  # (usage counts what the prompt's first read found kept)
            self.sequence.generation.cached_tokens = found
        self.follows = None  # (waited for: let it go)
        if self.reuse and any(self.prefixes):
            self.context.counters.prefix_queries += self.goal
            self.context.counters.prefix_hits += found

    @property
    def started(self) -> bool:
        return self.per_model is not None

    @property
    def done(self) -> bool:
        return self.started and all(c.length >= self.goal for _, c, _ in self.models)

    def advance(self, chunk: int) -> None:
        """Read up to `chunk` more prompt tokens with each model."""
        for model, cache, _ in self.models:
            end = min(cache.length + chunk, self.goal)
            if end > cache.length:
                model.read(cache, self.ids[:, cache.length : end], torch.ones_like(self.ids[:, :end]))

    def keep(self) -> None:
        """Each model with kept prompts keeps a copy of what it has read (the whole prompt, if it scored it)."""
        for _, cache, prefixes in self.models:
            if prefixes is not None:
                prefixes.keep(self.prompt[: cache.length], cache, salt=self.salt)

    def release(self) -> None:
        """Give back what the caches hold now (see `Batch.release`)."""
        for model, cache, _ in self.models:
            model.select_rows(cache, NO_ROWS)


def scoring_key(s: Sequence) -> tuple:
    """What a prompt's entries depend on (`score_prompt`): sequences that agree on it get the same entries."""
    r = s.request
    return r.prompt_ids, r.prompt_logprobs, s.force, r.threshold, r.target_rate


def urgency(s: Sequence) -> tuple[int, int]:
    """Which of two sequences goes first under priority scheduling: the lower priority, then the earlier arrival."""
    return s.request.priority, s.arrival


def prefix_caches(context: Context, tokens: int, max_batch: int | None) -> tuple[PrefixCache | None, ...]:
    """The writer's and the LLM's kept prompts (None: it keeps none). A backend with a fixed number of rows (llama.cpp's
    sequences) keeps as many prompts as it holds beyond the batch's rows."""
    rows = kept_prompt_rows(max_batch or context.max_rows or 0, context.max_rows)
    return tuple(None if m is None or m.remote or not tokens or rows < 1 else PrefixCache(m, tokens, rows)
                 for m in (context.writer, context.llm))


def make_room(prefixes: list[PrefixCache], room: int) -> None:
    """Kept prompts go, the least recently used first, until each model's hold at most `room` KV tokens (counted
    whole, though a kept prompt shares its cells with the sequence it was copied from while that one runs)."""
    for p in prefixes:
        while p.tokens > room:
            p.evict()
