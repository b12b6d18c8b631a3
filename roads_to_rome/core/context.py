"""What the decode loop's parts (`Scheduler`, `Batch`, `Layout`, `PromptRead`, `score_prompt`) read of the engine
that drives them: the models as they run them, the routing policy and deferral rule, the pad id and the counters they
add to. `Engine` (engine.py) makes one (`Engine.context`); these parts never see the engine itself, so core's modules
import each other in one direction only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from roads_to_rome.backends.base import Backend
from roads_to_rome.core.llm_calls import Deferral, LLMCalls
from roads_to_rome.core.request import Sequence
from roads_to_rome.routing.policies import RoutingPolicy


@dataclass(frozen=True)
class Context:
    """The models and rules one engine's batches run with."""

    writer: Backend  # proposes every token: the SLM of a pair, or the one model alone
    writer_source: str  # what the writer's tokens count as: "slm" or "llm"
    llm: LLMCalls | None  # a pair's LLM, as the batches drive it (in this thread or, overlap, its own); else None
    policy: RoutingPolicy
    deferral: Deferral  # when a routed row's token may wait for a grouped LLM call (as asked: see `overlap`)
    overlap: bool  # the LLM's calls run beside the writer's steps (every routed row then goes on: `Batch._route`)
    tokenizer: object  # (decodes an output's tail for its stop strings)
    pad_id: int
    counters: Counters
    max_context: int  # the tokens one sequence may hold, prompt and output: the models' context length
    kv_capacity: int | None  # the KV tokens every row's caches hold together (None: no limit)
    max_rows: int | None  # the rows the models hold at once (None: no limit)
    sync: Callable[[], None]  # waits for the writer's queued kernels (CUDA), to time a step's phases

    @property
    def routes(self) -> bool:
        return self.llm is not None

    def readers(self, sequence: Sequence) -> tuple[bool, bool]:
        """Whether the writer, and the LLM of a pair, ever read this sequence: a pair's request forced onto the LLM
        costs the LLM alone, one forced onto the SLM and unverified the SLM alone, their prompts included."""
        if not self.routes:
            return True, False
        return sequence.force != "llm", sequence.uses_llm


@dataclass
class Counters:
    """An engine's totals over its life (benchmarks take differences; the server reports them)."""

    steps: int = 0  # decode steps (of a whole batch)
    llm_calls: int = 0  # LLM catch-ups
    routed_rows: int = 0  # rows whose routed token an LLM call served, summed over the calls
    prefix_queries: int = 0  # prompt tokens looked up among the kept prompts (core/prefix_cache.py)
    prefix_hits: int = 0  # ... of them found there, not read again
    preemptions: int = 0  # sequences taken out of the batch for more urgent ones, to read on later (scheduler.py)

    @property
    def routed_rows_per_call(self) -> float:
        return self.routed_rows / self.llm_calls if self.llm_calls else 0.0

    def __sub__(self, before: Counters) -> Counters:
        """What happened since `before` (a copy taken earlier)."""
        return Counters(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))
