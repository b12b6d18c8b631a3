"""Recording a function's CUDA kernels once and replaying them with one launch.

A graph replays fixed memory: the function must read its inputs from buffers that stay put (the caller copies each
call's values into them) and it writes its outputs to the same buffers every replay."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

Output = TypeVar("Output")


def capture(run: Callable[[], Output], pool=None) -> tuple[torch.cuda.CUDAGraph, Output]:
    """`run` recorded as a graph (allocating from the graph memory `pool`, if given): the graph, and the output
    buffers each replay writes, holding this call's result. Raises RuntimeError where `run` cannot be recorded (a
    forward that waits for the host)."""
    side = torch.cuda.Stream()  # warm-up off the main stream, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: with --overlap the other model's thread launches and waits on its own stream while this one
    # records; only this thread's calls must be capture-safe
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
