"""What a client asks for (`Request`, immutable, checked when made) and what the engine keeps while it decodes it
(`Sequence`), apart as in vLLM: nothing the engine does writes into a client's request. A sequence's result grows
in its `Generation`; each decode step reports what it added as a `Step`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from roads_to_rome.core.sampling import (
    LogitRules,
    SamplingParams,
    TokenLogprob,
    Verify,
    adjust_logits,
    check_max_unverified,
    parse_verify,
)
from roads_to_rome.errors import R2RError

if TYPE_CHECKING:
    from roads_to_rome.core.grammar import GrammarWalk


@dataclass(frozen=True)
class Request:
    """One prompt and how to decode it. The one place a client's settings are parsed: a `Request` that exists is
    valid in itself (whether an engine can run it is `Engine.sequence`'s to say)."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    force: str | None = None  # "slm" or "llm": this request bypasses the policy
    threshold: float | None = None  # this request's own routing threshold (None: the policy's)
    target_rate: float | None = None  # aim for this LLM rate instead of a fixed threshold (`batch.row_thresholds`)
    verify: Verify | str | float | None = None  # off, strict or a tolerance in nats (None: the engine's), parsed
    max_unverified: int | None = None  # verify once this many tokens are unread by the LLM (None: the engine's)
    # The reply starts inside a reasoning model's thinking, which this token closes: a structured output applies
    # after it (None: from the first token).
    thinking_until: int | None = None
    # The prompt's own log-probabilities, with this many most likely tokens at each position (core/scoring.py; None:
    # not asked for).
    prompt_logprobs: int | None = None
    # Kept prompts are shared only with requests that give the same salt (core/prefix_cache.py; None: among those
    # that give none).
    cache_salt: str | None = None
    # Where it waits among others, lower first (vLLM's order): a scheduler that orders by priority reads it.
    priority: int = 0

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if not self.prompt_ids:
            raise R2RError("every prompt needs at least one token")
        self.params.validate()
        if self.force not in (None, "slm", "llm"):
            raise R2RError(f"a request may force 'slm' or 'llm', not {self.force!r}")
        if self.target_rate is not None and not 0 <= self.target_rate <= 1:
            raise R2RError(f"a target LLM rate is in [0, 1], got {self.target_rate}")
        if self.verify is not None:
            object.__setattr__(self, "verify", parse_verify(self.verify))
        check_max_unverified(self.max_unverified)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise R2RError("cache_salt fences a request's kept prompts off from others': give a non-empty string, "
                           "or leave it out")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise R2RError(f"prompt_logprobs is how many likely tokens to show: 0 or more, not {self.prompt_logprobs}")

    @property
    def kv_tokens(self) -> int:
        """The KV-cache tokens this request can ever need: its prompt and every token it may add."""
        return len(self.prompt_ids) + self.params.max_new_tokens


@dataclass
class Timings:
    """Seconds one request spent in each part of the loop (a batched step counts for each of its rows)."""

    slm_s: float = 0.0
    router_s: float = 0.0
    llm_s: float = 0.0
    total_s: float = 0.0
    steps: int = 0
    llm_calls: int = 0  # LLM catch-ups this request's row took part in


# The per-request counters, named once: `r2r generate --json`, the server's `usage` and "r2r" fields and its
# /metrics all read them from here (`Generation.counters`), so a counter added here shows in each.
COUNTERS = {
    "llm_tokens": "tokens the LLM produced: routed ones and verification's fixes",
    "fix_tokens": "tokens verification put in place of a rejected one",
    "rollbacks": "times verification rejected a token and the row went back to it",
    "discarded_tokens": "tokens written and then thrown away by those rollbacks",
    "llm_calls": "LLM catch-ups the request's row took part in",
    "deferred_tokens": "routed tokens that waited for a later, grouped LLM call",
    "deferred_kept": "deferred routed tokens where the LLM's token was the SLM's",
    "deferred_replaced": "deferred routed tokens the LLM replaced",
    "deferred_discarded_tokens": "tokens written and then thrown away by those replacements",
}


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    # Prompt tokens taken from a kept read of an earlier prompt that began the same way instead of read again
    # (core/prefix_cache.py): the fewest over the models that read the prompt.
    cached_tokens: int = 0
    sources: list[str] = field(default_factory=list)  # per token: "slm", "llm" (routed) or "fix" (verification)
    scores: list[float] = field(default_factory=list)  # the policy's score behind each decision
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it (vLLM's; None: EOS)
    elapsed_s: float = 0.0  # from the start of the call to this row's last token
    params_b: tuple[float, float, float] = (0.0, 0.0, 0.0)  # SLM, router, LLM parameters (billions)
    timings: Timings = field(default_factory=Timings)
    rollbacks: int = 0  # times verification rejected a token and the row went back to it
    discarded: int = 0  # tokens written and then thrown away by those rollbacks
    deferred: int = 0  # routed tokens that waited for a later LLM call (--defer continue or park)
    deferred_kept: int = 0  # of them, where the LLM's token was the SLM's
    deferred_replaced: int = 0  # ... where it was not (or the row was parked)
    deferred_discarded: int = 0  # tokens written and then thrown away by those replacements
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asks for them
    # Per prompt token, when the request asks for them (the first None); and per position after the first, the
    # model that gave it (core/scoring.py).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_sources: list[str] | None = None

    def counters(self) -> dict[str, int]:
        """Every counter of `COUNTERS`, by its name."""
        values = {"llm_tokens": self.llm_tokens, "fix_tokens": self.sources.count("fix"),
                  "rollbacks": self.rollbacks, "discarded_tokens": self.discarded, "llm_calls": self.timings.llm_calls,
                  "deferred_tokens": self.deferred, "deferred_kept": self.deferred_kept,
                  "deferred_replaced": self.deferred_replaced, "deferred_discarded_tokens": self.deferred_discarded}
        return values

    @property
    def llm_tokens(self) -> int:
        """Every token the LLM produced: routed ones and verification's fixes."""
        return self.sources.count("llm") + self.sources.count("fix")

    @property
    def llm_rate(self) -> float:
        return self.llm_tokens / max(len(self.token_ids), 1)

    @property
    def avg_params_b(self) -> float:
        """Average activated parameters per token, as the paper counts: SLM + router + rate x LLM."""
        slm, router, llm = self.params_b
        return slm + router + self.llm_rate * llm

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "sources": self.sources,
            "scores": [round(s, 6) for s in self.scores],
            "finish_reason": self.finish_reason,
            "tokens": len(self.token_ids),
            "prompt_tokens": len(self.prompt_ids),
            **self.counters(),
            "llm_rate": self.llm_rate,
            "avg_params_b": self.avg_params_b,
            "tokens_per_s": self.tokens_per_s,
            "elapsed_s": self.elapsed_s,
            "time_slm_s": self.timings.slm_s,
            "time_router_s": self.timings.router_s,
            "time_llm_s": self.timings.llm_s,
            **({"logprobs": [{"logprob": entry.logprob, "top": [{"token_id": t, "logprob": lp} for t, lp in entry.top]}
                             for entry in self.logprobs]} if self.logprobs is not None else {}),
        }


@dataclass
class Totals:
    """Sums over generations, for the benches' tables: tokens, the LLM's, verification's and deferral's counts,
    and the loop's steps, calls and seconds (`Timings`: a batched step counts for each of its rows)."""

    tokens: int = 0
    llm_tokens: int = 0
    rollbacks: int = 0
    discarded: int = 0
    deferred: int = 0
    deferred_kept: int = 0
    deferred_replaced: int = 0
    deferred_discarded: int = 0
    timings: Timings = field(default_factory=Timings)

    def add(self, gen: Generation) -> None:
        self.tokens += len(gen.token_ids)
        self.llm_tokens += gen.llm_tokens
        for name in ("rollbacks", "discarded", "deferred", "deferred_kept", "deferred_replaced", "deferred_discarded"):
            setattr(self, name, getattr(self, name) + getattr(gen, name))
        for name in ("slm_s", "router_s", "llm_s", "total_s", "steps", "llm_calls"):
            setattr(self.timings, name, getattr(self.timings, name) + getattr(gen.timings, name))


@dataclass
class Checks:
    """One row's outstanding checks (indices are positions in the row's output; the rules: core/verification.py)."""

    final: int = 0  # tokens that can no longer change (shown)
    checked: int = 0  # the LLM has had its word on every token before this one (a row that does not verify: on
    # every routed position before it)
    routed: list[int] = field(default_factory=list)  # deferred routed positions, oldest first
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # the SLM's distribution a sampled token
    # was drawn from (strict verification and deferred routing under sampling: the ratio test needs it)
    ends: str | None = None  # why the output ended on a token the LLM has still to check ("stop" or "length"):
    # the row stands still until it has (overlap: the call that checks it runs beside the other rows' steps)

    def through(self, index: int) -> None:
        """The LLM has had its word on every token up to `index`."""
        self.checked = max(self.checked, index + 1)
        self.routed = [k for k in self.routed if k > index]
        for k in [k for k in self.draft_probs if k <= index]:
            del self.draft_probs[k]


@dataclass(eq=False)
class Sequence:
    """A request being decoded: the engine's running state for it (`Engine.sequence` makes one)."""

    request: Request
    verify: Verify  # the request's setting, or the engine's default for it
    max_unverified: int | None
    generation: Generation
    index: int = 0  # the prompt's position in its `Engine.run` / `Engine.stream` call
    generator: torch.Generator | None = None  # the request's seeded draws
    cancelled: bool = False  # set from anywhere; the sequence leaves at the next step
    started: float = 0.0  # when it joined a batch
    checks: Checks = field(default_factory=Checks)  # what the LLM still has to check (core/verification.py)
    ending_ids: frozenset[int] = frozenset()  # tokens that end its output: end-of-sequence ones and its stop tokens
    grammar: GrammarWalk | None = None  # its walk through the structured output it asks for (core/grammar.py)
    arrival: int = 0  # its place in the order sequences reached the scheduler
    preemptions: int = 0  # times the scheduler took it out of the batch for a more urgent one (it reads on later)
    # the model the engine's policy sends every token to (`RoutingPolicy.alone`): the sequence is that model's, as
    # if its request forced it (not the SLM's proposals each replaced by the LLM's token: "LLM alone" costs the LLM)
    policy_alone: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def context_ids(self) -> tuple[int, ...]:
        """What the models read before its next token: the prompt, and the output so far (a preempted sequence reads
        both again when it resumes)."""
        return self.prompt_ids + tuple(self.generation.token_ids)

    @property
    def force(self) -> str | None:
        """The one model this sequence is written by, if one: its request's choice, else its engine policy's."""
        return self.request.force or self.policy_alone

    @property
    def pending(self) -> bool:
        """Whether any of its written tokens still await the LLM's word."""
        return bool(self.checks.routed) or (self.verify.on and self.checks.checked < len(self.generation.token_ids))

    @property
    def uses_llm(self) -> bool:
        """Whether the LLM may ever read this sequence: not when it is forced onto the SLM and unverified, so that
        it costs the SLM alone, its prompt included."""
        return not (self.force == "slm" and not self.verify.on)

    @functools.cached_property
    def rules(self) -> LogitRules:
        """The request's settings as `adjust_logits` reads them: made once, not at every token."""
        return LogitRules.of(self.params, self.prompt_ids, self.ending_ids, self.grammar)

    def logits_at(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        """The logits the token at output `index` is chosen from: a model's [V] there, as the request's settings
        leave them given the prompt and the output's tokens before it (`adjust_logits`: the same whichever model
        writes it, and whenever)."""
        if not self.params.adjusted:
            return logits
        return adjust_logits(logits, self.rules, self.generation.token_ids[:index])


@dataclass
class Step:
    """What one decode step added to one sequence."""

    sequence: Sequence
    token_id: int  # the token now at the end of the sequence's output
    source: str  # "slm", "llm" (routed) or "fix" (put in by verification)
    score: float  # the policy's score behind the decision
    finished: bool
    discarded: int = 0  # tokens before this one that verification took back
    final: list[tuple[int, str, float]] = field(default_factory=list)  # (token, source, score) of the tokens
    # that became final with this step, in order: what a stream may show (without verification: this token)


class Failure(NamedTuple):
    """A sequence that could not go on: an error while it was in flight, cut off, or cancelled."""

    sequence: Sequence
    error: Exception


class Cancelled(R2RError):
    def __init__(self):
        super().__init__("the request was cancelled")
