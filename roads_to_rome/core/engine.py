"""What clients call: `Engine` holds the models, the tokenizer and the routing policy, checks each request against
them (`Engine.sequence`) and runs requests to the end (`run`, `stream`) through the `Scheduler` (scheduler.py),
which drives a `Batch` (batch.py: the decode loop, read it top to bottom). One model alone (`Engine.alone`) runs
the same loop with nothing to route: it writes every token itself. What a client asks for and what the engine
keeps for it are in request.py; sampling and verification's rules in sampling.py and verification.py.
"""

from __future__ import annotations

import functools

import torch

from roads_to_rome.backends.base import Backend
from roads_to_rome.core.context import Context, Counters
from roads_to_rome.core.grammar import GrammarWalk, OutputFormat, grammar_tokenizer
from roads_to_rome.core.llm_calls import Deferral, LLMCalls
from roads_to_rome.core.prompts import Prompts
from roads_to_rome.core.request import Failure, Generation, Request, Sequence
from roads_to_rome.core.sampling import VERIFY_OFF, SamplingParams, Verify, check_max_unverified, parse_verify
from roads_to_rome.core.scheduler import Scheduler, Scheduling
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, RoutingPolicy

# What `r2r generate`, `chat` and `serve` verify routed tokens with unless told otherwise: a 1-nat tolerance, which
# recovers most of the accuracy the router alone misses for little more LLM share (docs: "Verification on
# catch-up"). A model alone (the slm or llm policy, a request that forces one) is not verified unless asked.
DEFAULT_VERIFY = "1"


def default_verify(routes: bool, routed: Verify | str = DEFAULT_VERIFY) -> Verify:
    """Verification where none is asked for: `routed` (the default, or an engine's own) where tokens are routed,
    off for one model writing alone (the slm or llm policy, a request forced onto one model)."""
    return parse_verify(routed) if routes else VERIFY_OFF


class Engine:
    """The models, the tokenizer and the routing policy; the `Scheduler` and its `Batch` do the decoding.

    A pair (`Engine(slm, llm, tokenizer, policy)`) routes; one model alone (`Engine.alone`)
    writes every token itself, for label responses, judges and the single-model baselines."""

    def __init__(self, slm: Backend | None, llm: Backend | None, tokenizer, policy: RoutingPolicy | None = None,
                 verify: Verify | str | float = "off", max_unverified: int | None = None, defer: Deferral | str = "off",
                 overlap: bool = False, llm_threads: int | None = None):
        """`verify`, `max_unverified`: the defaults of requests that do not set their own (see `Batch._catch_up`).
        `defer`: whether a routed row's LLM token may wait for an LLM call grouped with other rows' (a mode, or a
        `Deferral` with its grouping rule; core/llm_calls.py). `overlap`: whether the LLM's calls run beside the
        SLM's steps, on a thread of their own (with `llm_threads` torch threads there, on a CPU)."""
        if slm is None and llm is None:
            raise R2RError("an engine needs at least one model")
        self.slm, self.llm, self.tokenizer = slm, llm, tokenizer
        self.prompts = Prompts(tokenizer)  # a chat, a message, fill in the middle: as this tokenizer's tokens
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
        # The tokens one sequence may hold: the smallest model's context (a server that does not say has no bound here).
        self.max_context = min((m.max_context for m in models if m.max_context), default=1 << 31)
        # The tokens every row's caches hold together, and how many rows: what the server admits against.
        self.kv_capacity = min((m.kv_capacity for m in models if m.kv_capacity is not None), default=None)
        self.max_rows = min((m.max_rows for m in models if m.max_rows is not None), default=None)
        self.verify, self.max_unverified = parse_verify(verify), check_max_unverified(max_unverified)
        if self.verify.on:
            self._check_verifiable(self.verify)
        self.deferral = defer if isinstance(defer, Deferral) else Deferral(defer)
        self.overlap = bool(overlap) and self.routes
        # The LLM as the batches drive it: its operations in order, in this thread or (overlap) in one of its own.
        self.llm_side = LLMCalls(llm, self.overlap, llm_threads) if self.routes else None
        self.counters = Counters()
        # Parameters in billions (SLM, router, LLM) behind each token: a generation's average activated parameters.
        self.params_b = ((slm.num_params if slm else 0) / 1e9, (self.policy.num_params if self.routes else 0) / 1e9,
                         (llm.num_params if llm else 0) / 1e9)
        # Waits for this thread's stream only: with overlap the LLM's kernels run on a stream of their own.
        self.sync = (torch.cuda.current_stream(self.writer.device).synchronize if self.writer.device.type == "cuda"
                     else (lambda: None))

    def sequence(self, request: Request, index: int = 0, compiled: GrammarWalk | None = None) -> Sequence:
        """The engine's running state for a request, or an error if this engine cannot run it (said before the
        request joins a batch, where it would fail the others). Fills in the engine's defaults for the sequence,
        never into the request. `compiled`: its structured output, compiled already (`compile_format`: once per
        request, however many choices walk it); else it is compiled here."""
        if self.llm is None and request.force == "llm":
            raise R2RError("this request asks for the LLM, but no LLM is loaded")
        if self.llm is None and request.force is None and self.policy.routes_to_llm:
            raise R2RError(f"the {self.policy.name!r} policy routes to an LLM, but no LLM is loaded")
        if self.slm is None and request.force == "slm":
            raise R2RError("this request asks for the SLM, but no SLM is loaded")
        if request.force is not None and (request.threshold is not None or request.target_rate is not None):
            raise R2RError(f"this request sends every token to the {request.force.upper()}, and a threshold or LLM "
                           "rate routes between the two: leave it out, or let the policy route")
        if request.force is None and request.threshold is not None:
            self.policy.check_threshold(request.threshold)
        if request.force is None and request.target_rate is not None and self.policy.threshold is None:
            raise R2RError(f"this request aims at an LLM rate, but the {self.policy.name!r} policy sends every token "
                           "to one model: leave the rate out, or route with router, entropy or random")
        params = request.params
        if params.reshapes and request.force != "slm" and self.llm is not None and not self.llm.full_logits:
            raise R2RError(f"penalties, a logit bias, allowed tokens and structured outputs change the LLM's whole "
                           f"distribution; {self.llm.name} gives its top tokens only: leave presence, frequency and "
                           "repetition penalties at 0, 0 and 1, and logit_bias, allowed_token_ids and the output's "
                           "format out")
        # A policy that sends every token to one model makes its rows that model's (`Sequence.policy_alone`)
        alone = self.policy.alone if self.routes and request.force is None else None
        force = request.force or alone
        if request.prompt_logprobs is not None:
            self._check_scorable(force)
        vocab = self.writer.vocab_size
        if not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < vocab:
            bad = next(t for t in request.prompt_ids if not 0 <= t < vocab)
            raise R2RError(f"the prompt holds token {bad}, beyond the vocabulary: ids are 0 to {vocab - 1}")
        params.check_vocabulary(vocab)
        # The engine's setting is for routed rows and the slm policy's drafts (speculative decoding): a request forced
        # onto one model, or the llm policy's row, is that model alone unless it asks.
        checked = request.force is None and alone != "llm"
        verify = request.verify if request.verify is not None else default_verify(checked, self.verify)
        if verify.on and force == "llm":
            raise R2RError("this request's every token is the LLM's: there is nothing for it to check, so leave "
                           "verification out (the SLM's tokens verified strictly is speculative decoding)")
        if verify.on:
            self._check_verifiable(verify, request.params)
        elif request.max_unverified is not None:
            raise R2RError("max_unverified bounds the tokens written ahead of the LLM's check, and this request is "
                           "not verified: verify it (strict or a tolerance) or leave max_unverified out")
        max_unverified = self.max_unverified if request.max_unverified is None else request.max_unverified
        seed = request.params.seed
        generator = None if seed is None else torch.Generator(self.writer.device).manual_seed(seed)
        ending = (set() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids)
        check_writable(params, ending, vocab)
        grammar = None
        if params.output_format is not None:
            grammar = (compiled or self.compile_format(params.output_format)).copy(request.thinking_until)
        return Sequence(request, verify=verify, max_unverified=max_unverified, index=index, generator=generator,
                        ending_ids=frozenset(ending), grammar=grammar, policy_alone=alone,
                        generation=Generation(list(request.prompt_ids), params_b=self._params_b(force, verify),
                                              logprobs=None if request.params.logprobs is None else []))

    @property
    def context(self) -> Context:
        """What this engine's batches run with (core/context.py), as the engine is set now."""
        return Context(self.writer, self.writer_source, self.llm_side, self.policy, self.deferral, self.overlap,
                       self.tokenizer, self.pad_id, self.counters, self.max_context, self.kv_capacity, self.max_rows,
                       self.sync)

    def scheduler(self, max_batch: int | None = None, prefill_chunk: int | None = None, prefix_tokens: int = 0,
                  by_priority: bool = False) -> Scheduler:
        """A scheduler for this engine's requests (`Scheduling`: what the settings mean)."""
        return Scheduler(self.context, max_batch, Scheduling(prefill_chunk, prefix_tokens, by_priority))

    def compile_format(self, output_format: OutputFormat) -> GrammarWalk:
        """A structured output checked and compiled for this engine's tokenizer: a walk at its start, which each
        sequence that follows the format copies (`sequence`). Seconds for a large schema: a server runs it off its
        event loop."""
        output_format.validate()
        return GrammarWalk(output_format, self.grammar_tokenizer)

    @functools.cached_property
    def grammar_tokenizer(self):
        """The tokenizer as structured outputs read it (built at the first request that asks for one)."""
        return grammar_tokenizer(self.tokenizer, self.writer.vocab_size, self.eos_ids)

    def _params_b(self, force: str | None, verify: Verify) -> tuple[float, float, float]:
        """The parameters a row's tokens activate (`Generation.avg_params_b`): a row written by one model alone, and
        unverified, counts that model's alone; a routed row the pair's and the router's."""
        slm, router, llm = self.params_b
        if force == "llm":
            return 0.0, 0.0, llm
        return (slm, 0.0, 0.0) if force == "slm" and not verify.on else (slm, router, llm)

    def _check_scorable(self, force: str | None) -> None:
        """Whether the models that score a prompt for a row written by `force` (None: routed) can (core/scoring.py)."""
        if not self.routes or force == "slm":
            readers = [self.writer]
        elif force == "llm":
            readers = [self.llm]
        else:
            readers = [self.slm, self.llm]
        unable = [m.name for m in readers if not m.scores_prompts]
        if unable:
            raise R2RError(f"the prompt's log-probabilities need each model's distribution over it; {unable[0]} gives "
                           "its top tokens only, and no prompt log-probabilities (llama.cpp's server; vLLM's gives "
                           "them): leave echo with logprobs (prompt_logprobs) out, or force the SLM")

    def _check_verifiable(self, verify: Verify, params: SamplingParams | None = None) -> None:
        if not self.routes:
            raise R2RError("verification needs both models: the LLM checks the SLM's tokens")
        if verify.strict and params is not None and params.temperature > 0 and not self.llm.full_logits:
            raise R2RError(f"strict verification while sampling needs the LLM's whole distribution; {self.llm.name} "
                           "gives its top tokens only: sample with temperature 0, or verify with a tolerance")

    @classmethod
    def alone(cls, model: Backend, tokenizer, role: str = "llm") -> Engine:
        """One model writing every token; `role` ("slm" or "llm") is what its tokens count as."""
        return cls(model, None, tokenizer) if role == "slm" else cls(None, model, tokenizer)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self.run([Request(p, params) for p in prompts])

    def run(self, requests: list[Request]) -> list[Generation]:
        """Decode requests to the end in one batch (as many at once as the backends hold rows and KV room for; the
        others join as rows finish); their generations, in order."""
        sequences = [self.sequence(r, i) for i, r in enumerate(requests)]
        for _ in self._decode(sequences):
            pass
        return [s.generation for s in sequences]

    def stream(self, prompts: list[list[int]], params: SamplingParams, results: list | None = None,
               scheduler: Scheduler | None = None):
        """Decode all prompts as one batch, yielding the list of `Step`s each decode step adds
        (`step.sequence.index` is the prompt's position in `prompts`).

        `results`, when given, is filled with one `Generation` per prompt (complete once the
        generator is exhausted). `scheduler`: one a client keeps between calls (a chat's, whose prompts each begin
        with the one before: its kept prompts make the next read short); by default a new one."""
        sequences = [self.sequence(Request(p, params), i) for i, p in enumerate(prompts)]
        if results is not None:
            results[:] = [s.generation for s in sequences]
        yield from self._decode(sequences, scheduler)

    def _decode(self, sequences: list[Sequence], scheduler: Scheduler | None = None):
        """The offline client of the scheduler: every sequence queued at once, turns to the end; an error is raised."""
        # (more sequences than the backend holds wait)
        own = scheduler is None
        scheduler = self.scheduler(self.max_rows) if own else scheduler
        for s in sequences:
            scheduler.add(s)
        try:
            while not scheduler.idle:
                events = scheduler.turn()
                failed = next((e for e in events if isinstance(e, Failure)), None)
                if failed is not None:
                    raise failed.error
                yield events
        finally:
            if own and self.llm_side is not None:  # its rows given back before the caller goes on (overlap: queued)
                self.llm_side.wait_idle()


def check_writable(params: SamplingParams, ending: set[int], vocab_size: int) -> None:
    """Settings that leave no token to write at the output's start, refused before the request joins a batch: the
    allowed tokens (or the whole vocabulary) all banned as one-token bad words, or all ending tokens while min_tokens
    holds those back. (What a structured output leaves is known only as it is walked: a row it leaves nothing ends
    alone, `sampling.NothingToWrite`.)"""
    banned = {word[0] for word in params.bad_words if len(word) == 1}
    held = ending if params.min_tokens > 0 else set()
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        if allowed <= banned:
            raise R2RError(f"bad_words bans every token allowed_token_ids allows ({len(allowed)}): nothing could be "
                           "written; allow more tokens or ban fewer words")
        if allowed - banned <= held:
            raise R2RError(f"allowed_token_ids leaves only tokens that end the output, and min_tokens="
                           f"{params.min_tokens} holds those back until it is that long: allow a token that does "
                           "not end it, or leave min_tokens out")
    elif len(banned | held) >= vocab_size:
        raise R2RError("bad_words bans every token of the vocabulary: nothing could be written; ban fewer words")


def eos_token_ids(tokenizer) -> set[int]:
    """The tokenizer's EOS id, if it has one."""
    return set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
