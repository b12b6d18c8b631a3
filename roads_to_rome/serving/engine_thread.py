"""The engine's thread: it drives the engine's `Scheduler` a turn at a time while there is work, and hands each
request's handler its events through an asyncio queue (`Job`).

The thread is supervised: if a turn raises, every request in flight ends with an OpenAI-style error, new requests
get 503, `/health` says `failed`, and `on_failure` is called (`r2r serve` then exits non-zero, so that its supervisor
starts a fresh process: a batch whose state is unknown is not worth resuming). On shutdown in-flight requests get the
drain time to finish; if the engine cannot cut them (it waits on an LLM server that stopped answering), they are
answered from here and the process leaves without it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.grammar import FormatTooComplex
from roads_to_rome.core.request import Cancelled, Failure, Sequence, Step
from roads_to_rome.core.sampling import NothingToWrite
from roads_to_rome.core.scheduler import Scheduler, Scheduling
from roads_to_rome.errors import LLMUnavailable, R2RError, RemoteError
from roads_to_rome.serving import request_ids
from roads_to_rome.serving.errors import LLM_AWAY, APIError
from roads_to_rome.serving.limits import SERVER_SCHEDULING, Limits
from roads_to_rome.serving.metrics import Metrics

log = logging.getLogger(__name__)
ABANDON_AFTER_S = 1.0  # past the drain deadline, how long the engine gets to cut its requests itself


@dataclass
class ErrorReply:
    """What a client sees of a request that could not go on: an engine failure while it was in flight, or the
    server shutting down."""

    message: str
    status: int = 500
    code: str | None = None


class Job:
    """A sequence and the asyncio queue its handler reads its `Step`s (or an `ErrorReply`) from; made while its HTTP
    request is handled, whose id it keeps for the log (serving/request_ids.py)."""

    def __init__(self, sequence: Sequence, loop: asyncio.AbstractEventLoop):
        self.sequence, self.loop, self.events = sequence, loop, asyncio.Queue()
        self.request_id = request_ids.get()
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None

    def send(self, event: Step | ErrorReply) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop has closed: nobody wants the tokens any more
            self.sequence.cancelled = True


class ShuttingDown(R2RError):
    def __init__(self, why: str = "the server is shutting down; retry on another server"):
        super().__init__(why)


ENGINE_FAILED = "the engine failed (the server's log has the details); the server is restarting: retry"


class EngineThread:
    """Drives the engine's `Scheduler` in a thread of its own and hands each job its events. The queue's limit (429)
    and draining on shutdown (503) are the server's; admission, chunked prefill and decoding are the scheduler's."""

    def __init__(self, engine: Engine, limits: Limits, scheduling: Scheduling = SERVER_SCHEDULING,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine, self.limits, self.on_failure = engine, limits, on_failure
        self.scheduler = Scheduler(engine.context, limits.max_batch, scheduling)
        self.metrics = Metrics(engine, self.load)
        self.jobs: dict[int, Job] = {}  # id(sequence) -> its job, until the sequence leaves the scheduler
        self.wakeup = threading.Condition()
        self.stopping = False
        self.failed: BaseException | None = None
        self.deadline: float | None = None  # set when draining: in-flight requests are cut at this time
        self.thread = threading.Thread(target=self._run, name="r2r-engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        """Stop after the turn under way. Every request has its answer by now, so a turn stuck on an LLM server that
        does not answer is not waited for long (the thread is a daemon: it does not hold the process)."""
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        self.thread.join(timeout=2)

    def drain(self, seconds: float, llm_stalled: Callable[[], bool] = lambda: False) -> None:
        """Stop admitting (503), fail what waits in the queue, give in-flight requests `seconds` to finish. A watcher
        answers them itself if the engine has not cut them a second after that, or at once while `llm_stalled`."""
        with self.wakeup:
            first = self.deadline is None
            until = time.monotonic() + seconds
            self.deadline = until if first else min(self.deadline, until)
            self._deliver(self.scheduler.drop_waiting(ShuttingDown()))
            self.wakeup.notify()
        if first:
            threading.Thread(target=self._watch_drain, args=(llm_stalled,), name="r2r-drain", daemon=True).start()

    def submit(self, jobs: list[Job]) -> None:
        """A request's jobs (one per choice), admitted together or refused together."""
        with self.wakeup:
            if self.failed is not None:
                raise APIError(503, ENGINE_FAILED, kind="server_error", code="engine_failed")
            if self.deadline is not None or self.stopping:
                self.metrics.refused()
                raise APIError(503, str(ShuttingDown()), kind="server_error", code="shutting_down")
            scheduler = self.scheduler
            # Waiting for a free slot (the engine thread admits between steps) is not queueing.
            free_slots = max(0, self.limits.max_batch - scheduler.admitted)
            if scheduler.load()["waiting"] + len(jobs) > self.limits.max_queue + free_slots:
                self.metrics.refused()
                raise APIError(429, "the server is busy: too many requests waiting; retry later",
                               code="queue_full", kind="rate_limit_error")
            for job in jobs:
                self.jobs[id(job.sequence)] = job
                scheduler.add(job.sequence)
                self.metrics.admitted(job.sequence)
            self.wakeup.notify()

    def load(self) -> dict:
        return self.scheduler.load()

    def _run(self):
        try:
            while self._turn():
                pass
            self.scheduler.forget_kept()  # (the backends may serve another server next: a test's, a bench's)
        except BaseException as e:  # noqa: BLE001 - whatever ended the loop, no request may wait for ever
            self._fail(e)

    def _turn(self) -> bool:
        """One turn of the scheduler once there is work; False when the server stops. (A function of its own, so
        that nothing of a finished request outlives its turn in a local variable.)"""
        with self.wakeup:
            while not self.stopping and self.scheduler.idle:
                self.wakeup.wait()
            if self.stopping:
                return False
            left = self.scheduler.admit()  # under the lock: `submit` adds to the same queue
        if self.deadline is not None and time.monotonic() >= self.deadline:
            left += self.scheduler.cut(ShuttingDown("the server is shutting down: this request was cut off at the "
                                                    "drain deadline"))
        events = left + self.scheduler.advance()
        with self.wakeup:
            self._deliver(events)
        return True

    def _fail(self, error: BaseException) -> None:
        with self.wakeup:
            ids = sorted({job.request_id for job in self.jobs.values()})
        log.critical("the engine thread failed: every request in flight ends with an error (requests %s)",
                     ", ".join(ids) or "none", exc_info=error)
        self._abandon(lambda job: ErrorReply(f"the engine failed while this request was in flight "
                                             f"({request_ids.details(job.request_id)}); the server is restarting: "
                                             "retry", 500, "engine_failed"), failed=error)
        if self.on_failure is not None:
            self.on_failure(error)

    def _abandon(self, reply: Callable[[Job], ErrorReply], failed: BaseException | None = None) -> None:
        """Answer every job from here, without the engine, with its `reply`, and forget them."""
        with self.wakeup:
            if failed is not None:
                self.failed = failed
            jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            job.sequence.cancelled = True
            self.metrics.failed(job.sequence, aborted=False)
            job.send(reply(job))

    def _watch_drain(self, llm_stalled: Callable[[], bool]) -> None:
        while True:
            with self.wakeup:
                if not self.jobs:
                    return
                late = time.monotonic() >= self.deadline + ABANDON_AFTER_S
            if late or llm_stalled():
                cut = ErrorReply(str(ShuttingDown("the server is shutting down: this request was cut off (its LLM "
                                                  "server does not answer)")), 503)
                self._abandon(lambda job: cut)
                return
            time.sleep(0.25)

    def _deliver(self, events: list[Step | Failure]) -> None:
        for event in events:
            leaves = isinstance(event, Failure) or event.finished
            job = self.jobs.pop(id(event.sequence), None) if leaves else self.jobs.get(id(event.sequence))
            if job is None:  # answered already (abandoned on shutdown)
                continue
            if isinstance(event, Failure):
                self.metrics.failed(event.sequence, aborted=isinstance(event.error, Cancelled))
                if not isinstance(event.error, Cancelled):
                    job.send(error_reply(event.error, job.request_id))
                continue
            job.first_token_at = self.metrics.step(event, job.arrived, job.first_token_at)
            job.send(event)


def error_reply(e: Exception, request_id: str) -> ErrorReply:
    """What a client may see of an engine error: our own messages; other exceptions stay in the log, under the
    request's id."""
    if isinstance(e, ShuttingDown):
        return ErrorReply(str(e), 503)
    if isinstance(e, LLMUnavailable):
        log.error("remote LLM unavailable, request %s: %s", request_id, e)
        return ErrorReply(LLM_AWAY, 503, "llm_unavailable")
    if isinstance(e, RemoteError):  # its message names an address clients need not know
        log.error("remote model failure, request %s: %s", request_id, e)
        return ErrorReply(f"the LLM's server failed this request ({request_ids.details(request_id)})", 502)
    if isinstance(e, NothingToWrite):  # the request's own settings: the client can fix them
        return ErrorReply(str(e), 400, "nothing_to_write")
    if isinstance(e, FormatTooComplex):  # ... and its format
        return ErrorReply(str(e), 400, "format_too_complex")
    if isinstance(e, R2RError):
        return ErrorReply(str(e))
    log.exception("engine failure, request %s", request_id, exc_info=e)
    return ErrorReply(f"internal error in the engine ({request_ids.details(request_id)})")
