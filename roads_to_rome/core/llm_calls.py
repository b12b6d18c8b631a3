"""The LLM's side of a batch: when it is called (the deferral rule) and where its calls run (--overlap).

*When.* A routed row either has the LLM's token at once (lockstep), or keeps the SLM's token and waits for a call
grouped with other rows' (`Deferral`, --defer continue or park); `llm_due` says at which step the LLM runs.

*Where.* Without overlap the LLM's catch-up runs in the step, and every row waits for it. With overlap
(`LLMCalls` with a worker) every operation on the LLM's caches runs on a thread of its own, in the order the batch
asks for them: the step hands it a catch-up and goes on with the SLM for every row; the rows whose tokens the call
decides wait for its answer in the speculative state deferral already has (written, not yet shown), and the batch
takes the answer at the first step after it is ready (`Batch._catch_up`). Rows can leave, join and roll back while a
call runs: their operations on the LLM's caches queue behind it, and the lengths the batch sees are the ones the
caches will have once the queue is done (`QueuedCache`). On CUDA the worker's kernels go to a stream of their own.
"""

from __future__ import annotations

import math
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from roads_to_rome.errors import LLMUnavailable, R2RError

DEFER_MODES = ("off", "continue", "park")
# What the commands and the server defer with when routing: continue where the LLM runs on CUDA, whose call costs
# nearly the same for many rows as for one; off on a CPU, whose call costs grow with the tokens it reads, so that
# grouping saves little and the tokens a replaced one throws away cost more (docs/benchmarks.md, "Under load").
DEFAULT_DEFER = "auto"
OVERLAP_MODES = ("off", "on", "auto")
DEFAULT_OVERLAP = "auto"


def resolve_defer(mode: str, llm) -> str:
    """A deferral mode, `auto` made concrete for this LLM backend (None: no LLM): grouped where its reads of several
    rows cost little more than one (`Backend.grouped_reads`), else lockstep."""
    if mode != "auto":
        return mode
    return "continue" if llm is not None and llm.grouped_reads else "off"


def resolve_overlap(mode: str, slm, llm) -> bool:
    """Whether the LLM's calls run beside the SLM's steps, `auto` made concrete for this pair: where the two do not
    share a processor (the LLM on a server, or on another device than the SLM). Where they share one GPU's bandwidth
    or a CPU's cores, a call beside the SLM's step is predicted to slow it about as much as it saves (docs/serving.md,
    "The two models at once")."""
    mode = parse_overlap(mode)
    if mode != "auto" or llm is None or slm is None:
        return mode == "on" and llm is not None and slm is not None
    if llm.remote:
        return True
    return llm.device != slm.device


def parse_overlap(mode: str | bool | None) -> str:
    """--overlap as given (None: the default); True and False read as on and off."""
    if mode is None:
        return DEFAULT_OVERLAP
    if isinstance(mode, bool):
        return "on" if mode else "off"
    if mode not in OVERLAP_MODES:
        raise R2RError(f"overlap takes {', '.join(OVERLAP_MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class Deferral:
    """When a routed row's LLM token may wait for a grouped LLM call (`mode` off: it never waits).

    The LLM runs at the first step where `group` of the batch's rows wait (rounded up: a batch of one therefore
    runs it whenever its row is routed, as without deferral), where a waiting position is `steps` steps old, or
    where a row must be checked (it would finish, or verification's max_unverified is reached). The defaults are
    the schedule simulator's best on measured GPU step costs, batch 4 to 32 (docs/benchmarks.md)."""

    mode: str = "off"
    group: float = 0.6
    steps: int = 16
    ahead: int = 2  # (overlap) tokens the batch's rows may write, each, beyond what the call in flight reads: the
    # budget shared by the rows, at least one each (`tokens_ahead`); what a roll-back throws away stays small where
    # the LLM's calls are the bottleneck

    def __post_init__(self):
        if self.mode not in DEFER_MODES:
            raise R2RError(f"defer takes {', '.join(DEFER_MODES)}, got {self.mode!r}")
        if not 0 < self.group <= 1:
            raise R2RError(f"the deferral group is a share of the batch's rows in (0, 1], got {self.group}")
        if self.steps < 1:
            raise R2RError(f"a routed token waits at most 1 step or more, got {self.steps}")
        if self.ahead < 1:
            raise R2RError(f"rows write at least 1 token ahead of the LLM's call, got {self.ahead}")

    @classmethod
    def of(cls, mode: str, group: float | None = None, steps: int | None = None, ahead: int | None = None
           ) -> Deferral:
        """A rule with this mode, and the default settings where none is given."""
        return cls(mode, cls.group if group is None else group, cls.steps if steps is None else steps,
                   cls.ahead if ahead is None else ahead)

    def tokens_ahead(self, batch: int) -> int:
        """(overlap) How many tokens each row of a batch may write beyond what the call in flight reads, while some
        of its tokens wait for the LLM's word: a longer lead keeps one row's SLM busy, but in a batch the LLM's
        calls are the bottleneck, and every token a call reads past a rejected one is lost work."""
        return max(1, self.ahead // max(batch, 1))

    def rows(self, batch: int) -> int:
        """How many of a batch's rows must wait before the LLM runs."""
        return max(1, math.ceil(self.group * batch - 1e-9))

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def overlapped(self) -> Deferral:
        """The rule with the LLM's calls beside the SLM's steps: a routed row always goes on (its token is checked
        when the call returns), and lockstep's rule becomes a call as soon as one row waits."""
        return self if self.on else Deferral("continue", group=1e-9, steps=self.steps, ahead=self.ahead)


def llm_due(sequences: list, routed: list[bool], deferred: list[bool], unread: list[int],
            ends: Callable[[int], bool], deferral: Deferral) -> bool:
    """Whether the LLM runs this step. `routed`: rows the policy (or a request) gives the LLM now; `deferred`: those
    of them whose token may wait; `unread[i]`: row i's generated tokens the LLM has not read, this step's
    included; `ends(i)`: whether row i's output would end with this step's token (or ended on a token that waits)."""
    if any(r and not d for r, d in zip(routed, deferred)):
        return True
    waiting = [bool(s.checks.routed) or d for s, d in zip(sequences, deferred)]
    for i, s in enumerate(sequences):
        if s.verify.on and s.max_unverified is not None and unread[i] >= s.max_unverified:
            return True
        if (s.verify.on or waiting[i]) and ends(i):  # a row is returned only once all of it is checked
            return True
    if not any(waiting):
        return False
    if sum(waiting) >= deferral.rows(len(sequences)):
        return True
    oldest = max((len(s.generation.token_ids) - s.checks.routed[0] for s in sequences if s.checks.routed), default=0)
    return oldest >= deferral.steps


# --- where the calls run ---------------------------------------------------------------------------------------


class Worker:
    """One thread that runs what it is given in order (a daemon: a call stalled on a server never holds up exit).
    With `threads`, torch's intra-op threads of this thread (a CPU LLM on torch); on CUDA, a stream of its own, whose
    kernels run beside the SLM's; a result is handed over once its stream has finished it."""

    def __init__(self, device: torch.device, threads: int | None = None):
        self.device, self.threads = device, threads
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="r2r-llm", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        # The SLM's stream may still be writing the inputs: the worker's stream waits for what it has queued so far.
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.jobs.put((future, fn, args, event))
        return future

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        while True:
            job = self.jobs.get()
            if job is None:  # its engine is gone
                return
            future, fn, args, event = job
            result = None
            try:
                if stream is None:
                    result = fn(*args)
                else:
                    with torch.cuda.stream(stream):
                        stream.wait_event(event)
                        result = fn(*args)
                    stream.synchronize()
            except BaseException as e:  # handed to whoever waits for it
                future.set_exception(e)
            else:
                future.set_result(result)
            del job, future, fn, args, event, result  # nothing of a finished job stays alive while the next waits

    def close(self) -> None:
        self.jobs.put(None)


class Inline:
    """Runs what it is given at once, in the caller's thread (no overlap): the same futures, already done."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
        return future


class QueuedCache:
    """A cache of the LLM's whose operations queue on the worker: `length` is what it will have read once every
    queued operation has run; `error`, the first queued operation that failed (the cache no longer matches its
    batch: the next call fails with it)."""

    def __init__(self, inner):
        self.inner, self.length, self.error = inner, inner.length, None


class LLMCalls:
    """The LLM as a batch drives it: every operation on its caches goes through one `Worker` (overlap) or runs at
    once (`Inline`), in order. The operations whose results nobody waits for return at once; a catch-up returns a
    future (`catch_up`). What the LLM is (`name`, `full_logits`...) is read from its backend."""

    def __init__(self, backend, overlap: bool, threads: int | None = None):
        self.backend, self.overlap = backend, overlap
        self.runner = Worker(backend.device, threads) if overlap else Inline()
        if overlap:
            weakref.finalize(self, self.runner.close)

    # What the LLM is, as code that takes this for a model reads it; what it does goes through the methods below.
    name = property(lambda self: self.backend.name)
    device = property(lambda self: self.backend.device)
    remote = property(lambda self: self.backend.remote)
    full_logits = property(lambda self: self.backend.full_logits)
    scores_prompts = property(lambda self: self.backend.scores_prompts)
    kv_capacity = property(lambda self: self.backend.kv_capacity)
    max_rows = property(lambda self: self.backend.max_rows)
    vocab_size = property(lambda self: self.backend.vocab_size)

    def new_cache(self) -> QueuedCache:
        return QueuedCache(self.backend.new_cache())

    def _queue(self, cache: QueuedCache, fn: Callable, *args, always: bool = False) -> Future:
        """Run fn(the backend's cache, *args) behind what is queued. A cache whose earlier operation failed runs
        nothing more but giving back its rows (`always`)."""

        def run():
            if cache.error is not None and not always:
                raise cache.error
            try:
                return fn(cache.inner, *args)
            except LLMUnavailable:  # a remote cache stays what it was: only the rows that wait for this call fail
                raise
            except BaseException as e:
                if cache.error is None:
                    cache.error = e
                raise

        return self.runner.submit(run)

    def _inputs(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Tensors handed to the worker: copies (the batch's buffers change under it) on the LLM's device."""
        device = self.backend.device
        return [t.to(device, copy=True) if self.overlap or t.device != device else t for t in tensors]

    def forward_sequence(self, ids: list[int], start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The backend's, behind what is queued: the worker is the only thread that runs the LLM."""
        return self.runner.submit(self.backend.forward_sequence, ids, start).result()

    def score_sequence(self, ids: list[int], cache: QueuedCache, each_chunk) -> None:
        """The backend's, behind what is queued (`each_chunk` runs in the LLM's thread)."""
        cache.length += len(ids)
        self._queue(cache, lambda inner: self.backend.score_sequence(ids, inner, each_chunk)).result()

    def read(self, cache: QueuedCache, new_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        cache.length += new_ids.shape[1]
        self._settle(self._queue(cache, self.backend.read, *self._inputs(new_ids, attention_mask)))

    def catch_up(self, cache: QueuedCache, new_ids: torch.Tensor, attention_mask: torch.Tensor,
                 row_keep: list[int], salts: list[str | None] | None = None):
        """The LLM's logits at the last `max(row_keep)` of the new columns [rows, keep, V] (on the batch's device),
        later: a `PendingRead`. Row i needs its last `row_keep[i]` (`Backend.forward_all`); `salts`: each row's
        cache_salt (`Backend.tag_rows`)."""
        cache.length += new_ids.shape[1]
        device, keep = new_ids.device, max(row_keep)
        ids, mask = self._inputs(new_ids, attention_mask)
        salts = list(salts or [None] * len(row_keep))
        whole = keep > 1 or min(row_keep) < keep

        def read(inner, ids, mask):
            self.backend.tag_rows(inner, salts)
            if whole:
                return self.backend.forward_all(inner, ids, mask, keep, list(row_keep))
            return self.backend.forward(inner, ids, mask)[0][:, None]

        future = self._queue(cache, read, ids, mask)
        return PendingRead(future, device)

    def select_rows(self, cache: QueuedCache, rows: torch.Tensor) -> None:
        self._settle(self._queue(cache, self.backend.select_rows, rows.to(self.backend.device),
                                 always=not len(rows)))

    def append_rows(self, cache: QueuedCache, other: QueuedCache) -> None:
        def append(inner):
            if other.error is not None:
                raise other.error
            self.backend.append_rows(inner, other.inner)  # (as it is then: a queued copy may have made it)

        self._settle(self._queue(cache, append))

    def copy_rows(self, cache: QueuedCache, rows: list[int]) -> QueuedCache:
        """The backend's copy, made on the worker behind what is queued: the new cache's operations queue after it."""
        copied = self.new_cache()
        copied.length = cache.length

        def copy(_):
            if cache.error is not None:
                raise cache.error
            copied.inner = self.backend.copy_rows(cache.inner, list(rows))

        self._settle(self._queue(copied, copy))
        return copied

    def pad_left(self, cache: QueuedCache, n: int) -> None:
        if cache.length:  # an empty cache stays empty (`Backend.pad_left`)
            cache.length += n
        self._settle(self._queue(cache, self.backend.pad_left, n))

    def truncate(self, cache: QueuedCache, length: int) -> None:
        cache.length = min(cache.length, length)
        self._settle(self._queue(cache, self.backend.truncate, length))

    def trim_left(self, cache: QueuedCache, n: int) -> None:
        if cache.length:
            cache.length -= n
        self._settle(self._queue(cache, self.backend.trim_left, n))

    def shift_rows(self, cache: QueuedCache, shifts: list[int]) -> None:
        self._settle(self._queue(cache, self.backend.shift_rows, list(shifts)))

    def wait_idle(self) -> None:
        """Return once every operation queued so far has run: rows given back included, so that the next user of the
        backend (another engine: llama.cpp's sequences are the backend's, not the engine's) finds them free."""
        self.runner.submit(lambda: None).result()

    def _settle(self, future: Future) -> None:
        """An operation nobody waits for: inline, its error is raised here (as the backend's own would be); queued,
        it is kept on its cache for the next call."""
        if not self.overlap:
            future.result()


class PendingRead:
    """A catch-up the LLM is doing: its logits, on the batch's device, once `done`."""

    def __init__(self, future: Future, device: torch.device):
        self.future, self.device = future, device

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> torch.Tensor:
        logits = self.future.result()
        if logits.device.type == "cuda":  # made on the worker's stream, read on this one: not reused before it is
            logits.record_stream(torch.cuda.current_stream(logits.device))
        return logits.to(self.device)
