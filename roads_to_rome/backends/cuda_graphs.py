"""Recording a function's CUDA kernels once and replaying them with one launch.

A graph replays fixed memory: the function must read its inputs from buffers that stay put (the caller copies each
call's values into them) and it writes its outputs to the same buffers every replay."""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

Output = TypeVar("Output")


class CaptureGate:
    """Recording runs alone. With --overlap two threads drive one GPU, and what one does while the other records a
    graph can break the recording (a kernel compiled and loaded, memory allocated or freed, a wait for the whole
    device), and with it the recording thread's CUDA state. So a model's reads pass the gate together, and a
    capture (with its warm-up, where torch.compile compiles) waits until no other thread is reading and holds the
    others' reads back; a thread may capture from inside its own read."""

    def __init__(self):
        self._changed = threading.Condition()
        self._reading: Counter[int] = Counter()  # reads in progress, by thread
        self._capturing: int | None = None

    @contextmanager
    def reading(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._changed:
            self._changed.wait_for(lambda: self._capturing in (None, me))
            self._reading[me] += 1
        try:
            yield
        finally:
            with self._changed:
                self._reading[me] -= 1
                self._changed.notify_all()

    @contextmanager
    def capturing(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._changed:
            own = self._reading.pop(me, 0)  # this thread waits here, reading nothing meanwhile
            self._changed.wait_for(lambda: self._capturing is None and not any(self._reading.values()))
            self._capturing = me
        try:
            yield
        finally:
            with self._changed:
                self._capturing = None
                self._reading[me] += own
                self._changed.notify_all()


gate = CaptureGate()  # one per process: the threads share the device


def capture(run: Callable[[], Output], pool=None) -> tuple[torch.cuda.CUDAGraph, Output]:
    """`run` recorded as a graph (allocating from the graph memory `pool`, if given): the graph, and the output
    buffers each replay writes, holding this call's result. Raises RuntimeError where `run` cannot be recorded (a
    forward that waits for the host)."""
    with gate.capturing():
        side = torch.cuda.Stream()  # warm-up off the main stream, as torch.cuda.graphs asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the other model's thread may still sample or route on its own stream while this one records
        # (only its reads wait at the gate); only this thread's calls must be capture-safe
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = run()
        graph.replay()  # recording ran nothing
    return graph, output


def recorded_or_none(record: Callable[[], Output], who: str) -> Output | None:
    """What `record()` (a call that captures a graph) gives, or None, with a warning naming `who`, where the kernels
    cannot be recorded (an operation that waits for the host): the caller then runs without graphs."""
    try:
        return record()
    except RuntimeError as e:
        warnings.warn(f"{who}: CUDA graph capture failed ({str(e).splitlines()[0]}); running without graphs",
                      stacklevel=3)
        return None
