"""The R2R decode loop. Read this file top to bottom.

Both models read the same token streams (one row per prompt, left-padded to a common length)
and each keeps its own KV cache. Per step:

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
     LLM's word on where it ends, or too far ahead of the call in flight, stands still).

The LLM reads lazily: nothing until the first routed token, then everything since its last read.
Because every row gains exactly one token per step, both caches stay rectangular: the SLM's
always covers all columns but the newest, the LLM's whatever it has caught up on so far.
`Batch` holds that state and does the steps. The `Scheduler` decides which sequences are in the
batch (admission against slots and KV room, chunked prefill of newcomers) and is the one loop every
client drives: `Engine.run` and `Engine.stream` to the end, the server a turn at a time as requests
arrive. One model alone (`Engine.alone`) runs the same loop with nothing to route: it writes every
token itself.

Top to bottom: `Engine` (what clients call), `Call` and `StepRecord` (what a step's phases hand each
other), `Scheduler`, `PromptRead`, `Batch` (the five phases of a step), then the helpers. What a client
asks for and what the engine keeps for it are in request.py; sampling and verification's acceptance rules in
sampling.py.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

from roads_to_rome.backends.base import Backend
from roads_to_rome.core import verification
from roads_to_rome.core.llm_calls import Deferral, LLMCalls, PendingRead, llm_due
from roads_to_rome.core.request import Generation, Request, Sequence, Step, Timings, TokenLogprob
from roads_to_rome.core.sampling import SamplingParams, check_max_unverified, parse_verify, sample, sampling_probs
from roads_to_rome.errors import LLMUnavailable, R2RError
from roads_to_rome.routing import rate
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, RoutingPolicy

# What `r2r generate`, `chat` and `serve` verify routed tokens with unless told otherwise: a 1-nat tolerance, which
# recovers most of the accuracy the router alone misses for little more LLM share (docs: "Verification on
# catch-up"). A model alone (the slm or llm policy, a request that forces one) is not verified unless asked.
DEFAULT_VERIFY = "1"
NO_ROWS = torch.empty(0, dtype=torch.long)  # the `select_rows` index that keeps none: a cache lets go of every row


def default_verify(routes: bool, routed: str | float = DEFAULT_VERIFY) -> str | float:
    """Verification where none is asked for: `routed` (the default, or an engine's own) where tokens are routed,
    off for one model writing alone (the slm or llm policy, a request forced onto one model)."""
    return routed if routes else "off"


class Engine:
    """The models, the tokenizer and the routing policy; the `Scheduler` and its `Batch` do the decoding.

    A pair (`Engine(slm, llm, tokenizer, policy)`) routes; one model alone (`Engine.alone`)
    writes every token itself, for label responses, judges and the single-model baselines."""

    def __init__(self, slm: Backend | None, llm: Backend | None, tokenizer, policy: RoutingPolicy | None = None,
                 verify: str | float = "off", max_unverified: int | None = None, defer: Deferral | str = "off",
                 overlap: bool = False, llm_threads: int | None = None):
        """`verify`, `max_unverified`: the defaults of requests that do not set their own (see `Batch._catch_up`).
        `defer`: whether a routed row's LLM token may wait for an LLM call grouped with other rows' (a mode, or a
        `Deferral` with its grouping rule; core/llm_calls.py). `overlap`: whether the LLM's calls run beside the
        SLM's steps, on a thread of their own (with `llm_threads` torch threads there, on a CPU)."""
        if slm is None and llm is None:
            raise R2RError("an engine needs at least one model")
        self.slm, self.llm, self.tokenizer = slm, llm, tokenizer
        # The writer proposes every token: the SLM, or the LLM when it runs alone.
        self.writer, self.writer_source = (slm, "slm") if slm is not None else (llm, "llm")
        self.routes = slm is not None and llm is not None
        if slm is None and policy is not None:
            raise R2RError(f"the LLM alone writes every token: the {policy.name!r} policy needs an SLM too")
        self.policy = policy or (AlwaysSLM() if slm is not None else AlwaysLLM())
        models = [m for m in (slm, llm) if m is not None]
        if len({m.vocab_size for m in models}) > 1:
            raise R2RError(f"the SLM returns {slm.vocab_size} logits and the LLM {llm.vocab_size}: load both with "
                           f"the tokenizer's size (vocab_size={len(tokenizer)}) so that ids beyond it are never used")
        # The tokenizer's EOS plus what each model itself knows ends a generation.
        self.eos_ids = eos_token_ids(tokenizer).union(*(m.eos_ids for m in models))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.max_context = min(m.max_context for m in models)
        # The tokens every row's caches hold together, and how many rows: what the server admits against.
        self.kv_capacity = min((m.kv_capacity for m in models if m.kv_capacity is not None), default=None)
        self.max_rows = min((m.max_rows for m in models if m.max_rows is not None), default=None)
        self.verify, self.max_unverified = parse_verify(verify), check_max_unverified(max_unverified)
        if self.verify != "off":
            self._check_verifiable(self.verify)
        self.deferral = defer if isinstance(defer, Deferral) else Deferral(defer)
        self.overlap = bool(overlap) and self.routes
        if self.overlap:
            self.deferral = self.deferral.overlapped()
        if self.deferral.on and self.routes and not llm.verifies:
            raise R2RError(f"the LLM {llm.name} cannot return log-probabilities at every caught-up position, which a "
                           "deferred routed token is checked with: use --defer off and --overlap off with it")
        # The LLM as the batches drive it: its operations in order, in this thread or (overlap) in one of its own.
        self.llm_side = LLMCalls(llm, self.overlap, llm_threads) if self.routes else None
        self.counters = Counters()
        # Parameters in billions (SLM, router, LLM) behind each token: a generation's average activated parameters.
        self.params_b = ((slm.num_params if slm else 0) / 1e9, (self.policy.num_params if self.routes else 0) / 1e9,
                         (llm.num_params if llm else 0) / 1e9)
        # Waits for this thread's stream only: with overlap the LLM's kernels run on a stream of their own.
        self.sync = (torch.cuda.current_stream(self.writer.device).synchronize if self.writer.device.type == "cuda"
                     else (lambda: None))

    def sequence(self, request: Request, index: int = 0) -> Sequence:
        """The engine's running state for a request, or an error if this engine cannot run it (said before the
        request joins a batch, where it would fail the others). Fills in the engine's defaults for the sequence,
        never into the request."""
        if self.llm is None and request.force == "llm":
            raise R2RError("this request asks for the LLM, but no LLM is loaded")
        if self.llm is None and request.force is None and self.policy.routes_to_llm:
            raise R2RError(f"the {self.policy.name!r} policy routes to an LLM, but no LLM is loaded")
        if self.slm is None and request.force == "slm":
            raise R2RError("this request asks for the SLM, but no SLM is loaded")
        # The engine's setting is for routed rows: a row forced onto one model is that model alone unless it asks.
        verify = request.verify if request.verify is not None else default_verify(request.force is None, self.verify)
        if verify != "off":
            self._check_verifiable(verify, request.params)
        max_unverified = self.max_unverified if request.max_unverified is None else request.max_unverified
        seed = request.params.seed
        generator = None if seed is None else torch.Generator(self.writer.device).manual_seed(seed)
        return Sequence(request, verify=verify, max_unverified=max_unverified, index=index, generator=generator,
                        generation=Generation(list(request.prompt_ids), params_b=self.params_b,
                                              logprobs=None if request.params.logprobs is None else []))

    def _check_verifiable(self, verify: str | float, params: SamplingParams | None = None) -> None:
        if not self.routes:
            raise R2RError("verification needs both models: the LLM checks the SLM's tokens")
        if not self.llm.verifies:
            raise R2RError(f"the LLM {self.llm.name} cannot return log-probabilities at every caught-up position, "
                           "which verification needs: use --verify off with it")
        if verify == "strict" and params is not None and params.temperature > 0 and not self.llm.full_logits:
            raise R2RError(f"strict verification while sampling needs the LLM's whole distribution; {self.llm.name} "
                           "gives its top tokens only: sample with temperature 0, or verify with a tolerance")

    @classmethod
    def alone(cls, model: Backend, tokenizer, role: str = "llm") -> Engine:
        """One model writing every token; `role` ("slm" or "llm") is what its tokens count as."""
        return cls(model, None, tokenizer) if role == "slm" else cls(None, model, tokenizer)

    def encode_chat(self, message: str) -> list[int]:
        """A user message in the model's chat template, ready for the assistant's answer."""
        return self.encode_messages([{"role": "user", "content": message}])

    def encode_messages(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise R2RError("the model's tokenizer has no chat template: give the prompt as plain text (--raw, "
                           "or /v1/completions on the server)")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def encode_raw(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self.run([Request(p, params) for p in prompts])

    def run(self, requests: list[Request]) -> list[Generation]:
        """Decode requests to the end in one batch (as many at once as the backends hold rows and KV room for; the
        others join as rows finish); their generations, in order."""
        sequences = [self.sequence(r, i) for i, r in enumerate(requests)]
        for _ in self._decode(sequences):
            pass
        return [s.generation for s in sequences]

    def stream(self, prompts: list[list[int]], params: SamplingParams, results: list | None = None):
        """Decode all prompts as one batch, yielding the list of `Step`s each decode step adds
        (`step.sequence.index` is the prompt's position in `prompts`).

        `results`, when given, is filled with one `Generation` per prompt (complete once the
        generator is exhausted)."""
        sequences = [self.sequence(Request(p, params), i) for i, p in enumerate(prompts)]
        if results is not None:
            results[:] = [s.generation for s in sequences]
        yield from self._decode(sequences)

    def _decode(self, sequences: list[Sequence]):
        """The offline client of the scheduler: every sequence queued at once, turns to the end; an error is raised."""
        scheduler = Scheduler(self, max_batch=self.max_rows)  # more sequences than the backend holds wait
        for s in sequences:
            scheduler.add(s)
        while not scheduler.idle:
            events = scheduler.turn()
            failed = next((e for e in events if isinstance(e, Failure)), None)
            if failed is not None:
                raise failed.error
            yield events


@dataclass
class Counters:
    """An engine's totals over its life (benchmarks take differences; the server reports them)."""

    steps: int = 0  # decode steps (of a whole batch)
    llm_calls: int = 0  # LLM catch-ups
    routed_rows: int = 0  # rows whose routed token an LLM call served, summed over the calls

    @property
    def routed_rows_per_call(self) -> float:
        return self.routed_rows / self.llm_calls if self.llm_calls else 0.0

    def __sub__(self, before: Counters) -> Counters:
        """What happened since `before` (a copy taken earlier)."""
        return Counters(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class Failure(NamedTuple):
    """A sequence that could not go on: an error while it was in flight, cut off, or cancelled."""

    sequence: Sequence
    error: Exception


class Cancelled(R2RError):
    def __init__(self):
        super().__init__("the request was cancelled")


@dataclass
class Call:
    """A catch-up sent to the LLM: its logits once ready, and for which rows (as the batch was when it was sent:
    rows may leave or join before it answers). Row j's last logits predict its output index `reach[j]`."""

    pending: PendingRead
    sequences: list[Sequence]
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


class Scheduler:
    """Which sequences decode, which wait, and when a newcomer's prompt is read: the one loop every client drives.

    Each turn admits waiting sequences, first come first served, while a slot is free and their KV tokens fit;
    reads one chunk of one admitted prompt (chunked prefill, round robin); and runs one decode step of the batch.
    The server drives it from its engine thread, a turn at a time between arrivals; `Engine.run` and
    `Engine.stream` (generate, chat, eval, the label pipeline) to the end. A sequence leaves reporting it once:
    its last `Step` (finished) or a `Failure`."""

    def __init__(self, engine: Engine, max_batch: int | None = None, prefill_chunk: int | None = None):
        """`max_batch`: sequences decoding or having their prompt read at once (None: no limit).
        `prefill_chunk`: prompt tokens each model reads per turn, a newcomer's prompt alone, between decode steps
        (None: newcomers join the batch at once and its next decode step reads their prompts together)."""
        self.engine, self.max_batch, self.prefill_chunk = engine, max_batch, prefill_chunk
        self.batch = Batch(engine)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.reading: collections.deque[tuple[Sequence, PromptRead]] = collections.deque()  # admitted, prompt in chunks
        self.joining: list[Sequence] = []  # admitted, to join the batch at the next decode step
        self.kv_in_use = 0  # KV tokens held by admitted sequences (each its prompt and max new tokens)

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

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
        """Waiting sequences take a slot while one is free and their KV tokens fit; the cancelled ones leave."""
        left, capacity = [], self.engine.kv_capacity
        while self.waiting:
            s = self.waiting[0]
            need = s.request.kv_tokens
            if s.cancelled or (capacity is not None and need > capacity):
                self.waiting.popleft()
                left.append(Failure(s, Cancelled() if s.cancelled else R2RError(
                    f"this request needs {need} KV-cache tokens (prompt and max new tokens), more than the "
                    f"{capacity} the cache holds: ask for fewer new tokens")))
                continue
            if self.max_batch is not None and self.admitted >= self.max_batch:
                break
            if capacity is not None and self.kv_in_use + need > capacity:
                break  # the head waits for room
            self.waiting.popleft()
            self.kv_in_use += need
            if self.prefill_chunk:
                self.reading.append((s, PromptRead(self.engine, s.prompt_ids)))
            else:
                self.joining.append(s)
        return left

    def advance(self) -> list[Step | Failure]:
        """One chunk of one admitted prompt, then one decode step of the batch."""
        return self._read_one_chunk() + self._decode_step()

    def drop_waiting(self, error: Exception) -> list[Failure]:
        """Every waiting sequence leaves with this error (a server that stops admitting)."""
        left = [Failure(s, error) for s in self.waiting]
        self.waiting.clear()
        return left

    def cut(self, error: Exception) -> list[Failure]:
        """Every admitted sequence leaves with this error (a server's drain deadline)."""
        cut = [s for s, _ in self.reading] + self.joining + self.batch.sequences
        for s in cut:
            s.cancelled = True
        self.reading.clear()
        self.joining.clear()
        self.batch.step()  # drops the cancelled rows (every row is cancelled: nothing else runs)
        return [self._leave(s, Failure(s, error)) for s in cut]

    def _read_one_chunk(self) -> list[Failure]:
        left = []
        while self.reading and self.reading[0][0].cancelled:
            s, _ = self.reading.popleft()
            left.append(self._leave(s, Failure(s, Cancelled())))
        if not self.reading:
            return left
        s, prefill = self.reading[0]
        try:
            prefill.advance(self.prefill_chunk)
            if not prefill.done:
                self.reading.rotate(-1)  # the next prompt gets the next chunk
                return left
            self.reading.popleft()
            self.batch.add([s], prefill)  # leaves the batch as it was if it fails
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
            failed, self.batch = self.batch, Batch(self.engine)
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
    the batch."""

    def __init__(self, engine: Engine, prompt_ids: tuple[int, ...]):
        self.models = [engine.writer] + ([engine.llm_side] if engine.routes else [])  # in `Batch._caches` order
        self.caches = [m.new_cache() for m in self.models]
        self.ids = torch.tensor([prompt_ids], device=engine.writer.device)
        self.goal = len(prompt_ids) - 1

    @property
    def done(self) -> bool:
        return all(c.length >= self.goal for c in self.caches)

    def advance(self, chunk: int) -> None:
        """Read up to `chunk` more prompt tokens with each model."""
        for model, cache in zip(self.models, self.caches):
            end = min(cache.length + chunk, self.goal)
            if end > cache.length:
                model.read(cache, self.ids[:, cache.length : end], torch.ones_like(self.ids[:, :end]))

    def release(self) -> None:
        """Give back what the caches hold now (see `Batch.release`)."""
        for model, cache in zip(self.models, self.caches):
            model.select_rows(cache, NO_ROWS)


class Batch:
    """Sequences decoding in lockstep: one row each in both models' caches.

    Sequences can join between steps (continuous batching): a newcomer is left-padded to the
    batch's width (or the batch to the newcomer's) and prefilled up to where each model's cache
    already is, then its cache rows are appended. Finished and cancelled sequences leave.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.sequences: list[Sequence] = []
        # The token streams (left-padded) and their padding mask, [rows, columns], in buffers with room for the
        # columns to come, so a step writes its column in place (`ids`, `mask`: the columns so far).
        self._ids = self._mask = None
        self._width = 0
        self.writer_cache, self.llm_cache = self._new_caches()
        self.call: Call | None = None  # (overlap) the LLM's catch-up in flight

    def _new_caches(self):
        """The writer's cache, and the LLM's when a pair routes to it (None when a model runs alone)."""
        engine = self.engine
        return engine.writer.new_cache(), engine.llm_side.new_cache() if engine.routes else None

    def add(self, sequences: list[Sequence], prefill: PromptRead | None = None) -> None:
        """Sequences join the batch: left-padded to its width, read up to where each cache is. A sequence may
        bring its prompt already read (`prefill`: the scheduler's chunked prefill, for one sequence)."""
        now = time.perf_counter()
        for s in sequences:
            s.started = now
        self._join(sequences, prefill)

    def _join(self, sequences: list[Sequence], prefill: PromptRead | None) -> None:
        engine = self.engine
        ids, mask = left_pad([s.prompt_ids for s in sequences], engine.pad_id, engine.writer.device)
        if not self.sequences:
            # An empty batch: the newcomers are the batch; the next step reads what their caches have not.
            self._set(ids, mask)
            self.writer_cache, self.llm_cache = (prefill.caches + [None])[:2] if prefill else self._new_caches()
            self.sequences = list(sequences)
            return
        width = self.ids.shape[1]
        if ids.shape[1] > width:
            self._pad_left(ids.shape[1] - width)
        elif ids.shape[1] < width:
            ids, mask = pad_columns_left(ids, mask, width - ids.shape[1], engine.pad_id)
        pad = self.ids.shape[1] - len(sequences[0].prompt_ids) if prefill else 0  # the prefilled row's padding
        # Bring the newcomers' caches up to where each of the batch's is, then append their rows (only once
        # every forward has run: a failure leaves the batch as it was). A prefilled cache has read the prompt
        # alone: cut it to what the batch's cache covers and pad it to the batch's columns (positions count
        # real tokens only, so padding it afterwards changes nothing).
        joining = []
        try:
            for k, (backend, cache) in enumerate(self._caches()):
                if not cache.length:
                    continue
                fresh = prefill.caches[k] if prefill else backend.new_cache()
                joining.append((backend, cache, fresh))
                keep = max(0, min(fresh.length, cache.length - pad))
                backend.truncate(fresh, keep)  # (to 0: reused as new, holding no more rows than the request needs)
                if keep:
                    backend.pad_left(fresh, pad)
                if fresh.length < cache.length:
                    backend.read(fresh, ids[:, fresh.length : cache.length], mask[:, : cache.length])
        except BaseException:
            for backend, _, fresh in joining:  # now: the error's traceback keeps them (see `release`)
                backend.select_rows(fresh, NO_ROWS)
            raise
        for backend, cache, fresh in joining:
            backend.append_rows(cache, fresh)
        self._set(torch.cat([self.ids, ids]), torch.cat([self.mask, mask]))
        self.sequences += sequences

    @property
    def ids(self) -> torch.Tensor | None:
        return None if self._ids is None else self._ids[:, : self._width]

    @property
    def mask(self) -> torch.Tensor | None:
        return None if self._mask is None else self._mask[:, : self._width]

    def _set(self, ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        self._ids, self._mask = ids, mask
        self._width = 0 if ids is None else ids.shape[1]

    def _append_column(self, tokens: torch.Tensor) -> None:
        """Write a column of tokens after the last one, growing the buffers (doubling them) when full."""
        rows, room = self._ids.shape
        if self._width == room:
            grow = max(room, 64)
            self._ids = torch.cat([self._ids, self._ids.new_full((rows, grow), self.engine.pad_id)], dim=1)
            self._mask = torch.cat([self._mask, self._mask.new_zeros((rows, grow))], dim=1)
        self._ids[:, self._width] = tokens
        self._mask[:, self._width] = 1
        self._width += 1

    def _caches(self):
        """(backend, cache) for each model this batch runs."""
        yield self.engine.writer, self.writer_cache
        if self.llm_cache is not None:
            yield self.engine.llm_side, self.llm_cache

    def release(self) -> None:
        """Let go of every row now. A dropped batch gives back what its caches hold (llama.cpp: one of a fixed
        number of sequences per row) when it is collected, and a failed step's traceback, which refers to it,
        puts that off until the garbage collector runs: the next requests would find no sequence free."""
        for backend, cache in self._caches():
            backend.select_rows(cache, NO_ROWS)
        self.sequences, self.call = [], None
        self._set(None, None)

    def _pad_left(self, n: int) -> None:
        self._set(*pad_columns_left(self.ids, self.mask, n, self.engine.pad_id))
        for backend, cache in self._caches():
            backend.pad_left(cache, n)

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
        """1. The writer (the SLM of a pair) reads the columns it has not read yet and proposes a token per row:
        (proposal, its logits, its last hidden state). When every row forces the LLM, the SLM has nothing to
        propose and does not run (it reads these columns later if a request ever needs it), so "LLM alone"
        through a pair costs the LLM alone."""
        engine, sequences = self.engine, self.sequences
        if engine.routes and all(s.force == "llm" for s in sequences):
            step.proposal = self.ids[:, -1].clone()  # a placeholder: every row takes the LLM's token
            return
        logits, hidden = engine.writer.forward(self.writer_cache, self.ids[:, self.writer_cache.length :], self.mask)
        step.proposal, step.slm_logits, step.hidden = sample_rows(logits, sequences), logits, hidden
        for i, s in enumerate(sequences):
            if s.verify == "strict" and s.params.temperature > 0:  # the ratio test needs what the SLM drew from
                s.checks.draft_probs[len(s.generation.token_ids)] = sampling_probs(logits[i : i + 1], s.params)[0]
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
        else:
            to_llm, scores = engine.policy.route(step.slm_logits, step.hidden, step.proposal, self._thresholds())
            step.routed = [s.force == "llm" if s.force else bool(x) for s, x in zip(self.sequences, to_llm.tolist())]
            step.scores = scores.tolist()
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
        column, read_from = step.column, self.llm_cache.length
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
        if s.verify != "off" and s.max_unverified is not None and unread > s.max_unverified:
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
        engine, sequences = self.engine, self.sequences
        read_from, width = self.llm_cache.length, self.ids.shape[1]
        # Row i's output index at `column`: the furthest token the read can check.
        reach = [column - width + len(s.generation.token_ids) for s in sequences]
        row_keep = [min(column - read_from, verification.logits_needed(s, r))
                    if now or s.checks.pending(s) or s.checks.ends else 0 for s, r in zip(sequences, reach)]
        pending = engine.llm_side.catch_up(self.llm_cache, self.ids[:, read_from:column], self.mask[:, :column],
                                           row_keep)
        return Call(pending, list(sequences), reach, max(row_keep))

    def _send_call(self, step: StepRecord) -> None:
        """(overlap) After the step, the next call, to run beside the SLM's next steps: when one is due and none is in
        flight. It reads every column but the newest (the LLM's cache stays short of the batch's width, as a joining
        row's reads expect), so it checks every token written so far."""
        if not (self.engine.overlap and step.due and self.call is None and self.sequences):
            return
        column = self.ids.shape[1] - 1
        if column > self.llm_cache.length and any(s.checks.pending(s) or s.checks.ends for s in self.sequences):
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
                found = verification.first_rejection(s, read, last, step.proposed[i], park, full_logits)
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
                step.chosen[i] = sample_rows(step.llm_logits[i][None], sequences[i : i + 1])[0]
            elif step.deferred[i]:
                verification.defer(s, count, None if step.slm_logits is None else step.slm_logits[i])

    def _emit(self, step: StepRecord, times: tuple[float, ...]) -> list[Step | Failure]:
        """5. Rows whose check rejected a token go back to it (their later tokens are discarded and the LLM's
        token goes in its place); rows that stand still stay where they are; then the new column is appended, each
        row's token recorded, and finished rows leave the batch. A row whose output ends on a token the LLM has
        yet to check stays, standing still, until it has."""
        dropped = self._roll_back(step)
        self._append_column(step.chosen)
        t0, t1, t2, t3 = times
        now = time.perf_counter()
        events, keep = [], []
        self.engine.counters.steps += 1
        llm_ran = step.reads is not None
        for i, (s, token, source, score) in enumerate(zip(self.sequences, step.chosen.tolist(), step.sources,
                                                          step.scores)):
            gen = s.generation
            self._count_time(gen.timings, t1 - t0, t2 - t1, t3 - t2, now - t0, llm_ran and step.reads[i] is not None)
            if i in step.failed:
                events.append(Failure(s, step.failed[i]))
                continue
            if i in step.ended:
                gen.finish_reason, s.checks.ends = s.checks.ends, None
                gen.text = self._final_text(s)
                events.append(Step(s, gen.token_ids[-1], gen.sources[-1], gen.scores[-1], True, 0,
                                   verification.settle(s, True)))
                continue
            gen.elapsed_s = now - s.started
            if step.held[i]:
                keep.append(i)
                continue
            gen.token_ids.append(token)
            gen.sources.append(source)
            gen.scores.append(float(score))
            if gen.logprobs is not None:
                gen.logprobs.append(token_logprob(step.llm_logits.get(i, step.slm_logits[i] if step.slm_logits
                                                                      is not None else None), token, s.params.logprobs))
            reason = self._ends(s, gen.token_ids)
            if reason and s.checks.pending(s):  # the LLM checks its tokens first: the row waits for that
                s.checks.ends, reason = reason, None
            if reason:
                gen.finish_reason = reason
                gen.text = self._final_text(s)
            else:
                keep.append(i)
            events.append(Step(s, token, source, float(score), reason is not None, dropped.get(i, 0),
                               verification.settle(s, reason is not None)))
        self._keep(keep)
        return events

    def _would_end(self, step: StepRecord, i: int) -> bool:
        """Whether row i's output ends with this step's token, or ended on a token the LLM still has to check."""
        s = self.sequences[i]
        return s.checks.ends is not None or self._ends(s, s.generation.token_ids, step.proposed[i]) is not None

    def _roll_back(self, step: StepRecord) -> dict[int, int]:
        """Put each rejecting row back to its rejected token, the LLM's token there, and keep each row that stands
        still where it is (its last token taken back and written again); returns how many earlier tokens each
        rejecting row dropped.

        Rows move back by different amounts. Each is moved right by the tokens it drops, with as many padding
        columns on its left, so every row still ends at this step's column: the batch stays rectangular and
        left-padded, which is all the backends and the rest of this loop assume (masking the dropped columns in
        place would leave holes in the middle of rows that every backend's positions would have to skip). Both
        caches move the same way (`Backend.shift_rows`): the SLM's has read every column before this step's, the
        LLM's up to some column, and what a row's shift pushes out of it is read again at its next catch-up."""
        column, sequences = step.column, self.sequences
        shifts = [0] * len(sequences)
        for i, rejection in step.rejected.items():
            shifts[i] = len(sequences[i].generation.token_ids) - rejection.index
        for i, held in enumerate(step.held):
            if held and i not in step.ended and i not in step.failed:
                shifts[i] = 1
                step.chosen[i] = self.ids[i, column - 1]
        if any(shifts):
            for backend, cache in self._caches():
                backend.shift_rows(cache, shifts)
            ids, mask = torch.full_like(self.ids, self.engine.pad_id), torch.zeros_like(self.mask)
            for i, d in enumerate(shifts):
                ids[i, d:], mask[i, d:] = self.ids[i, : column - d], self.mask[i, : column - d]
            self._set(ids, mask)
        for i, rejection in step.rejected.items():
            score = verification.take_back(sequences[i], rejection)
            if score is not None:
                step.scores[i] = score  # the policy's score at the rejected position
            step.chosen[i], step.sources[i] = rejection.token, "llm" if rejection.routed else "fix"
            step.llm_logits[i] = rejection.logits
        return {i: shifts[i] for i in step.rejected}

    def _count_time(self, t: Timings, writer_s: float, router_s: float, llm_s: float, total_s: float,
                    llm_ran: bool) -> None:
        if self.engine.writer_source == "slm":
            t.slm_s += writer_s
        else:
            t.llm_s += writer_s
        t.router_s += router_s
        t.llm_s += llm_s
        t.total_s += total_s
        t.steps += 1
        t.llm_calls += llm_ran

    def _thresholds(self) -> torch.Tensor | None:
        """Per-row thresholds (a request's own, or the one its target LLM rate gives: routing/rate.py), or None
        when every row uses the policy's own."""
        requests = [s.request for s in self.sequences]
        if all(r.threshold is None and r.target_rate is None for r in requests):
            return None
        policy = self.engine.policy
        return torch.tensor([rate.row_threshold(policy, s.request.threshold, s.request.target_rate,
                                                len(s.generation.token_ids), s.generation.llm_tokens,
                                                s.generation.scores) for s in self.sequences], device=self.ids.device)

    def _keep(self, rows: list[int]) -> None:
        if len(rows) == len(self.sequences):
            return
        self.sequences = [self.sequences[i] for i in rows]
        if not rows:  # drop the caches now: on llama.cpp their cells would shift where the next request's go
            self.release()
            self.writer_cache, self.llm_cache = self._new_caches()
            return
        index = torch.tensor(rows, device=self.ids.device)
        self._set(self.ids[index], self.mask[index])
        for backend, cache in self._caches():
            backend.select_rows(cache, index)

    def _finished(self, s: Sequence) -> bool:
        reason = self._ends(s, s.generation.token_ids)
        if reason:
            s.generation.finish_reason = reason
        return reason is not None

    def _ends(self, s: Sequence, tokens: list[int], then: int | None = None) -> str | None:
        """Why an output of these tokens (followed by `then`, if given) is complete ("stop" or "length"), or None."""
        params = s.params
        last, length = (tokens[-1], len(tokens)) if then is None else (then, len(tokens) + 1)
        if last in self.engine.eos_ids and not params.ignore_eos:
            return "stop"
        if params.stop:
            # Decode only the tail: enough tokens to hold the longest stop string.
            longest = max(len(stop) for stop in params.stop)
            tail = tokens[-(longest + 2) :] if then is None else tokens[-(longest + 1) :] + [then]
            text = self.engine.tokenizer.decode(tail, skip_special_tokens=True)
            if any(stop in text for stop in params.stop):
                return "stop"
        if length >= params.max_new_tokens:
            return "length"
        return None

    def _final_text(self, s: Sequence) -> str:
        text = self.engine.tokenizer.decode(s.generation.token_ids, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in s.params.stop if stop in text]
        return text[: min(cuts)] if cuts else text


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """A token's log-probability in the distribution these logits give, and the `top` most likely tokens'."""
    logprobs = torch.log_softmax(logits.float(), -1)
    values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0])
    return TokenLogprob(float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))


def sample_rows(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """One token per row, each with its request's sampling settings (greedy rows in one argmax)."""
    tokens = logits.argmax(-1)
    for i, s in enumerate(sequences):
        if s.params.temperature > 0:
            tokens[i] = sample(logits[i : i + 1], s.params, s.generator)[0]
    return tokens


def pad_columns_left(ids: torch.Tensor, mask: torch.Tensor, n: int, pad_id: int):
    return (torch.cat([ids.new_full((ids.shape[0], n), pad_id), ids], dim=1),
            torch.cat([mask.new_zeros((mask.shape[0], n)), mask], dim=1))


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def eos_token_ids(tokenizer) -> set[int]:
    """The tokenizer's EOS id, if it has one."""
    return set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
