"""The R2R decode loop. Read this file top to bottom.

Both models read the same token streams (one row per prompt, left-padded to a common length)
and each keeps its own KV cache. Per step:

  1. the SLM reads the newest column (the whole prompt on the first step) and proposes a token;
  2. the routing policy looks at the SLM's logits, last hidden state and proposal;
  3. if any row is routed, the LLM catches up on every column it has not read yet, in one
     forward over them, and its token replaces the SLM's in the routed rows;
  4. the chosen tokens become a new column; finished rows leave the batch.

The LLM reads lazily: nothing until the first routed token, then everything since its last read.
Because every row gains exactly one token per step, both caches stay rectangular: the SLM's
always covers all columns but the newest, the LLM's whatever it has caught up on so far.
`Batch` holds that state and does the steps; `Engine.stream` runs one batch to the end, and the
server adds requests to a running batch between steps. One model alone (`Engine.alone`) runs the
same loop with nothing to route: it writes every token itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from roads_to_rome.backends.base import Backend
from roads_to_rome.core.sampling import (
    SamplingParams,
    check_max_unverified,
    parse_verify,
    sample,
    sampling_probs,
    speculative_residual,
    within_tolerance,
)
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, RoutingPolicy

# What `r2r generate`, `chat` and `serve` verify routed tokens with unless told otherwise: a 1-nat tolerance, which
# recovers most of the accuracy the router alone misses for little more LLM share (docs: "Verification on
# catch-up"). A model alone (the slm or llm policy, a request that forces one) is not verified unless asked.
DEFAULT_VERIFY = "1"
RATE_CATCH_UP_TOKENS = 16  # a request aiming at an LLM rate makes up a shortfall over this many tokens (_threshold)


@dataclass
class Timings:
    """Seconds one request spent in each part of the loop (a batched step counts for each of its rows)."""

    slm_s: float = 0.0
    router_s: float = 0.0
    llm_s: float = 0.0
    total_s: float = 0.0
    steps: int = 0
    llm_calls: int = 0  # LLM catch-ups this request's row took part in


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # per token: "slm", "llm" (routed) or "fix" (verification)
    scores: list[float] = field(default_factory=list)  # the policy's score behind each decision
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length"
    elapsed_s: float = 0.0  # from the start of the call to this row's last token
    params_b: tuple[float, float, float] = (0.0, 0.0, 0.0)  # SLM, router, LLM parameters (billions)
    timings: Timings = field(default_factory=Timings)
    rollbacks: int = 0  # times verification rejected a token and the row went back to it
    discarded: int = 0  # tokens written and then thrown away by those rollbacks

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
            "llm_tokens": self.llm_tokens,
            "fix_tokens": self.sources.count("fix"),
            "rollbacks": self.rollbacks,
            "discarded_tokens": self.discarded,
            "llm_rate": self.llm_rate,
            "avg_params_b": self.avg_params_b,
            "tokens_per_s": self.tokens_per_s,
            "elapsed_s": self.elapsed_s,
            "time_slm_s": self.timings.slm_s,
            "time_router_s": self.timings.router_s,
            "time_llm_s": self.timings.llm_s,
        }


@dataclass
class Request:
    """One prompt being decoded: its settings and its growing result."""

    prompt_ids: list[int]
    params: SamplingParams
    force: str | None = None  # "slm" or "llm": this request bypasses the policy
    threshold: float | None = None  # this request's own routing threshold (None: the policy's)
    target_rate: float | None = None  # aim for this LLM rate instead of a fixed threshold (see _threshold)
    verify: str | float | None = None  # "off", "strict" or a tolerance in nats (None: the engine's)
    max_unverified: int | None = None  # verify once this many tokens are unread by the LLM (None: the engine's)
    index: int = 0  # the prompt's position in its `Engine.stream` / `Engine.generate` call
    generation: Generation | None = None  # set when the request joins a batch
    generator: torch.Generator | None = None
    cancelled: bool = False  # set from anywhere; the request leaves at the next step
    started: float = 0.0
    final: int = 0  # tokens of the output that can no longer change (verification may take back the rest)
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # token index -> the SLM's distribution
    # it was drawn from (kept for strict verification under sampling only)
    prefill: Prefill | None = None  # its prompt, read ahead before it joins a batch (see `Prefill`)


@dataclass
class Step:
    """What one decode step added to one request."""

    request: Request
    token_id: int  # the token now at the end of the request's output
    source: str  # "slm", "llm" (routed) or "fix" (put in by verification)
    score: float  # the policy's score behind the decision
    finished: bool
    discarded: int = 0  # tokens before this one that verification took back
    final: list[tuple[int, str, float]] = field(default_factory=list)  # (token, source, score) of the tokens
    # that became final with this step, in order: what a stream may show (without verification: this token)


class Engine:
    """The models, the tokenizer and the routing policy; `Batch` does the decoding.

    A pair (`Engine(slm, llm, tokenizer, policy)`) routes; one model alone (`Engine.alone`)
    writes every token itself, for label responses, judges and the single-model baselines."""

    def __init__(self, slm: Backend | None, llm: Backend | None, tokenizer, policy: RoutingPolicy | None = None,
                 verify: str | float = "off", max_unverified: int | None = None):
        """`verify`, `max_unverified`: the defaults of requests that do not set their own (see `Batch._accept`)."""
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
            self._check_verifiable()
        self.sync = torch.cuda.synchronize if self.writer.device.type == "cuda" else (lambda: None)

    def check(self, r: Request) -> None:
        """Refuse a request this engine cannot run (before it joins a batch, where it would fail the others),
        and fill in the engine's verification defaults."""
        r.params.validate()
        if not r.prompt_ids:
            raise R2RError("every prompt needs at least one token")
        if self.llm is None and r.force == "llm":
            raise R2RError("this request asks for the LLM, but no LLM is loaded")
        if self.llm is None and r.force is None and self.policy.routes_to_llm:
            raise R2RError(f"the {self.policy.name!r} policy routes to an LLM, but no LLM is loaded")
        if self.slm is None and r.force == "slm":
            raise R2RError("this request asks for the SLM, but no SLM is loaded")
        # The engine's setting is for routed rows: a row forced onto one model is that model alone unless it asks.
        if r.verify is None:
            r.verify = "off" if r.force else self.verify
        r.verify = parse_verify(r.verify)
        r.max_unverified = check_max_unverified(self.max_unverified if r.max_unverified is None else r.max_unverified)
        if r.verify != "off":
            self._check_verifiable(r)

    def _check_verifiable(self, r: Request | None = None) -> None:
        if not self.routes:
            raise R2RError("verification needs both models: the LLM checks the SLM's tokens")
        if not self.llm.verifies:
            raise R2RError(f"the LLM {self.llm.name} cannot return log-probabilities at every caught-up position, "
                           "which verification needs: use --verify off with it")
        if r is not None and r.verify == "strict" and r.params.temperature > 0 and not self.llm.full_logits:
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
        return self.run([Request(list(p), params, index=i) for i, p in enumerate(prompts)])

    def run(self, requests: list[Request]) -> list[Generation]:
        """Decode requests as one batch to the end: the offline client of `Batch` (the server's is its Scheduler)."""
        for _ in self.steps(requests):
            pass
        return [r.generation for r in requests]

    def steps(self, requests: list[Request]):
        """Decode requests as one batch, returning an iterator over the list of `Step`s each decode step adds. The
        requests join at once (a request the engine cannot run is refused here, before any step)."""
        batch = Batch(self)
        batch.add(requests)
        return iter(batch.step, [])  # a step of an empty batch adds nothing

    def stream(self, prompts: list[list[int]], params: SamplingParams, results: list | None = None):
        """Decode all prompts as one batch, yielding the list of `Step`s each decode step adds
        (`step.request.index` is the prompt's position in `prompts`).

        `results`, when given, is filled with one `Generation` per prompt (complete once the
        generator is exhausted)."""
        requests = [Request(list(p), params, index=i) for i, p in enumerate(prompts)]
        steps = self.steps(requests)
        if results is not None:
            results[:] = [r.generation for r in requests]
        yield from steps


class Prefill:
    """A request's prompt read ahead, in chunks, before it joins a batch.

    The server reads a newcomer's prompt one chunk between two decode steps, so the streams already
    running keep producing tokens while a long prompt is read. Each model reads the prompt alone,
    into a cache of its own, up to all but the prompt's last token (the request's first decode step
    reads that one and proposes the first new token). Set as `request.prefill`, it is the cache
    `Batch.add` fits into the batch."""

    def __init__(self, engine: Engine, request: Request):
        self.models = [engine.writer] + ([engine.llm] if engine.routes else [])  # in `Batch._caches` order
        self.caches = [m.new_cache() for m in self.models]
        self.ids = torch.tensor([request.prompt_ids], device=engine.writer.device)
        self.goal = len(request.prompt_ids) - 1

    @property
    def done(self) -> bool:
        return all(c.length >= self.goal for c in self.caches)

    def advance(self, chunk: int) -> None:
        """Read up to `chunk` more prompt tokens with each model."""
        for model, cache in zip(self.models, self.caches):
            end = min(cache.length + chunk, self.goal)
            if end > cache.length:
                model.read(cache, self.ids[:, cache.length : end], torch.ones_like(self.ids[:, :end]))


class Batch:
    """Requests decoding in lockstep: one row each in both models' caches.

    Requests can join between steps (continuous batching): a newcomer is left-padded to the
    batch's width (or the batch to the newcomer's) and prefilled up to where each model's cache
    already is, then its cache rows are appended. Finished and cancelled requests leave.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.requests: list[Request] = []
        # The token streams (left-padded) and their padding mask, [rows, columns], in buffers with room for the
        # columns to come, so a step writes its column in place (`ids`, `mask`: the columns so far).
        self._ids = self._mask = None
        self._width = 0
        self.writer_cache, self.llm_cache = self._new_caches()

    def _new_caches(self):
        """The writer's cache, and the LLM's when a pair routes to it (None when a model runs alone)."""
        engine = self.engine
        return engine.writer.new_cache(), engine.llm.new_cache() if engine.routes else None

    def add(self, requests: list[Request]) -> None:
        """Requests join the batch: left-padded to its width, read up to where each cache is. A request
        with a `Prefill` brings its prompt already read (server-side chunked prefill)."""
        engine = self.engine
        for r in requests:
            engine.check(r)
        params_b = ((engine.slm.num_params if engine.slm else 0) / 1e9,
                    (engine.policy.num_params if engine.routes else 0) / 1e9,
                    (engine.llm.num_params if engine.llm else 0) / 1e9)
        now = time.perf_counter()
        for r in requests:
            r.generation = Generation(prompt_ids=r.prompt_ids, params_b=params_b)
            r.started = now
            if r.params.seed is not None:
                r.generator = torch.Generator(engine.writer.device).manual_seed(r.params.seed)
        plain = [r for r in requests if r.prefill is None]
        groups = ([(plain, None)] if plain else []) + [([r], r.prefill) for r in requests if r.prefill is not None]
        for group, prefill in groups:
            self._join(group, prefill)
            for r in group:
                r.prefill = None

    def _join(self, requests: list[Request], prefill: Prefill | None) -> None:
        engine = self.engine
        ids, mask = left_pad([r.prompt_ids for r in requests], engine.pad_id, engine.writer.device)
        if not self.requests:
            # An empty batch: the newcomers are the batch; the next step reads what their caches have not.
            self._set(ids, mask)
            self.writer_cache, self.llm_cache = (prefill.caches + [None])[:2] if prefill else self._new_caches()
            self.requests = list(requests)
            return
        width = self.ids.shape[1]
        if ids.shape[1] > width:
            self._pad_left(ids.shape[1] - width)
        elif ids.shape[1] < width:
            ids, mask = pad_columns_left(ids, mask, width - ids.shape[1], engine.pad_id)
        pad = self.ids.shape[1] - len(requests[0].prompt_ids) if prefill else 0  # the prefilled row's padding
        # Bring the newcomers' caches up to where each of the batch's is, then append their rows (only once
        # every forward has run: a failure leaves the batch as it was). A prefilled cache has read the prompt
        # alone: cut it to what the batch's cache covers and pad it to the batch's columns (positions count
        # real tokens only, so padding it afterwards changes nothing).
        joining = []
        for k, (backend, cache) in enumerate(self._caches()):
            if not cache.length:
                continue
            fresh = prefill.caches[k] if prefill else backend.new_cache()
            keep = max(0, min(fresh.length, cache.length - pad))
            backend.truncate(fresh, keep)  # (to 0: reused as new, holding no more rows than the request needs)
            if keep:
                backend.pad_left(fresh, pad)
            if fresh.length < cache.length:
                backend.read(fresh, ids[:, fresh.length : cache.length], mask[:, : cache.length])
            joining.append((backend, cache, fresh))
        for backend, cache, fresh in joining:
            backend.append_rows(cache, fresh)
        self._set(torch.cat([self.ids, ids]), torch.cat([self.mask, mask]))
        self.requests += requests

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
            yield self.engine.llm, self.llm_cache

    def _pad_left(self, n: int) -> None:
        self._set(*pad_columns_left(self.ids, self.mask, n, self.engine.pad_id))
        for backend, cache in self._caches():
            backend.pad_left(cache, n)

    def step(self) -> list[Step]:
        """One decode step for every request: what it added to each."""
        self._keep([i for i, r in enumerate(self.requests) if not r.cancelled])
        if not self.requests:
            return []
        column = self.ids.shape[1]  # where this step's tokens go
        t0 = time.perf_counter()
        proposal, logits, hidden = self._propose()
        t1 = time.perf_counter()
        routed, scores = self._route(logits, hidden, proposal)
        t2 = time.perf_counter()
        chosen, sources, rejected, llm_ran = self._catch_up(column, proposal, routed)
        t3 = time.perf_counter()
        return self._emit(column, chosen, sources, scores, rejected, llm_ran, (t0, t1, t2, t3))

    def _propose(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """1. The writer (the SLM of a pair) reads the columns it has not read yet and proposes a token per row:
        (proposal, its logits, its last hidden state). When every row forces the LLM, the SLM has nothing to
        propose and does not run (it reads these columns later if a request ever needs it), so "LLM alone"
        through a pair costs the LLM alone."""
        engine, requests = self.engine, self.requests
        if engine.routes and all(r.force == "llm" for r in requests):
            return self.ids[:, -1].clone(), None, None  # a placeholder: every row takes the LLM's token
        logits, hidden = engine.writer.forward(self.writer_cache, self.ids[:, self.writer_cache.length :], self.mask)
        proposal = sample_rows(logits, requests)
        for i, r in enumerate(requests):
            if r.verify == "strict" and r.params.temperature > 0:  # the ratio test needs what the SLM drew from
                r.draft_probs[len(r.generation.token_ids)] = sampling_probs(logits[i : i + 1], r.params)[0]
        engine.sync()
        return proposal, logits, hidden

    def _route(self, logits, hidden, proposal) -> tuple[list[bool], list[float]]:
        """2. The policy decides which rows the LLM takes (a request may force one model): (routed, scores)."""
        engine, n = self.engine, len(self.requests)
        if logits is None:  # the SLM is idle: every row is the LLM's
            return [True] * n, [0.0] * n
        if not engine.routes:  # one model alone writes every token
            return [False] * n, [0.0] * n
        to_llm, scores = engine.policy.route(logits, hidden, proposal, self._thresholds())
        routed = [r.force == "llm" if r.force else bool(x) for r, x in zip(self.requests, to_llm.tolist())]
        return routed, scores.tolist()

    def _catch_up(self, column: int, proposal: torch.Tensor, routed: list[bool]):
        """3. The LLM catches up on every column since it last ran when a row is routed, or when a verifying row
        has max_unverified tokens unread or would finish. It checks the verifying rows' unread tokens and
        writes the routed rows' tokens. Returns (chosen tokens, their sources, rejected rows: row -> (column of
        its first rejected token, the LLM's token there), whether the LLM ran)."""
        engine, requests = self.engine, self.requests
        chosen, sources = proposal.clone(), ["llm" if x else engine.writer_source for x in routed]
        verifying = [r.verify != "off" for r in requests]
        proposed = proposal.tolist() if any(verifying) else [None] * len(requests)
        if not (any(routed) or any(v and self._must_verify(r, column, t)
                                   for r, v, t in zip(requests, verifying, proposed))):
            return chosen, sources, {}, False
        read_from = self.llm_cache.length
        if any(verifying):
            # Logits at the caught-up columns that predict unread generated tokens (the prompt's need no check);
            # the last one also serves routing.
            checked = max(min(column - read_from, len(r.generation.token_ids) + 1)
                          for r, v in zip(requests, verifying) if v)
            all_logits = engine.llm.forward_all(self.llm_cache, self.ids[:, read_from:], self.mask, checked)
            llm_logits = all_logits[:, -1]
        else:
            llm_logits, _ = engine.llm.forward(self.llm_cache, self.ids[:, read_from:], self.mask)
        rejected = {}
        for i, r in enumerate(requests):
            if verifying[i]:
                found = self._first_rejection(r, all_logits[i], column - checked, column, proposed[i], routed[i],
                                              read_from)
                if found:
                    rejected[i] = found
                    continue
            if routed[i]:
                chosen[i] = sample_rows(llm_logits[i : i + 1], requests[i : i + 1])[0]
        engine.sync()
        return chosen, sources, rejected, True

    def _emit(self, column: int, chosen: torch.Tensor, sources: list[str], scores: list[float],
              rejected: dict[int, tuple[int, int]], llm_ran: bool, times: tuple[float, ...]) -> list[Step]:
        """4. Rows whose verification rejected a token go back to it (their later tokens are discarded and the
        LLM's token goes in its place); then the new column is appended, each row's token recorded, and
        finished rows leave the batch."""
        dropped = self._roll_back(rejected, column, chosen, sources, scores) if rejected else {}
        self._append_column(chosen)
        t0, t1, t2, t3 = times
        now = time.perf_counter()
        steps, keep = [], []
        for i, (r, token, source, score) in enumerate(zip(self.requests, chosen.tolist(), sources, scores)):
            gen = r.generation
            self._count_time(gen.timings, t1 - t0, t2 - t1, t3 - t2, now - t0, llm_ran)
            gen.token_ids.append(token)
            gen.sources.append(source)
            gen.scores.append(float(score))
            gen.elapsed_s = now - r.started
            finished = self._finished(r)
            if finished:
                gen.text = self._final_text(r)
            else:
                keep.append(i)
            # A verifying row's tokens are final once the LLM has checked them (at a catch-up); others at once.
            newly_final = len(gen.token_ids) if r.verify == "off" or llm_ran or finished else r.final
            final = list(zip(gen.token_ids[r.final : newly_final], gen.sources[r.final : newly_final],
                             gen.scores[r.final : newly_final]))
            r.final = newly_final
            if llm_ran:
                r.draft_probs.clear()  # everything drawn so far is checked now
            steps.append(Step(r, token, source, float(score), finished, dropped.get(i, 0), final))
        self._keep(keep)
        return steps

    def _must_verify(self, r: Request, column: int, proposal: int) -> bool:
        """Whether a verifying row needs the LLM now: max_unverified tokens unread, or its output would end
        with this proposal (a row is returned only once all of it is checked)."""
        gen = r.generation
        unread = min(column - self.llm_cache.length, len(gen.token_ids) + 1)  # its generated tokens the LLM has not read
        if r.max_unverified is not None and unread >= r.max_unverified:
            return True
        return self._ends(r, gen.token_ids, proposal) is not None

    def _first_rejection(self, r: Request, logits: torch.Tensor, logits_from: int, column: int, proposal: int,
                         routed: bool, read_from: int) -> tuple[int, int] | None:
        """Check a row's generated tokens the LLM had not read (columns after `read_from`) in order against its
        logits (`logits[k]`: at column logits_from + k, predicting the next column); the first rejected
        one's column and the LLM's token there."""
        gen = r.generation
        first_generated = column - len(gen.token_ids)  # the row's generated tokens fill columns first_generated..
        last = column - 1 if routed else column  # a routed row's token at `column` is the LLM's own
        for c in range(max(read_from + 1, first_generated), last + 1):
            index = c - first_generated  # the token's index in the output
            token = gen.token_ids[index] if c < column else proposal
            replacement = self._check(r, token, logits[c - 1 - logits_from], index)
            if replacement is not None:
                return c, replacement
        return None

    def _check(self, r: Request, token: int, logits: torch.Tensor, index: int) -> int | None:
        """Verification's rule for one token against the LLM's next-token logits: None when it is kept, else the
        LLM's token in its place."""
        params = r.params
        if r.verify == "strict" and params.temperature > 0:  # speculative sampling: the output follows the LLM
            target = sampling_probs(logits[None], params)[0]
            draw = torch.rand((), generator=r.generator, device=target.device)
            residual = speculative_residual(target, r.draft_probs[index], token, draw)
            return None if residual is None else int(torch.multinomial(residual, 1, generator=r.generator))
        best = int(logits.argmax())
        kept = token == best if r.verify == "strict" else within_tolerance(logits, token, best, r.verify)
        if kept:
            return None
        return best if params.temperature == 0 else int(sample(logits[None], params, r.generator)[0])

    def _roll_back(self, rejected: dict[int, tuple[int, int]], column: int, chosen: torch.Tensor, sources: list,
                   scores: list) -> dict[int, int]:
        """Put each rejecting row back to its rejected column, the LLM's token there; returns how many earlier
        tokens each row dropped.

        Rows roll back by different amounts. Each rolled-back row is moved right by the tokens it drops,
        with as many padding columns on its left, so every row still ends at `column`: the batch stays
        rectangular and left-padded, which is all the backends and the rest of this loop assume (masking
        the dropped columns in place would leave holes in the middle of rows that every backend's
        positions would have to skip). Both caches have read every column before `column`, so they move
        the same way (`Backend.shift_rows`)."""
        shifts = [column - rejected[i][0] if i in rejected else 0 for i in range(len(self.requests))]
        for backend, cache in self._caches():
            backend.shift_rows(cache, shifts)
        ids, mask = torch.full_like(self.ids, self.engine.pad_id), torch.zeros_like(self.mask)
        for i, d in enumerate(shifts):
            ids[i, d:], mask[i, d:] = self.ids[i, : column - d], self.mask[i, : column - d]
        self._set(ids, mask)
        for i, (_, token) in rejected.items():
            r, dropped = self.requests[i], shifts[i]
            gen = r.generation
            keep = len(gen.token_ids) - dropped
            if dropped:
                scores[i] = gen.scores[keep]  # the policy's score at the rejected position
            del gen.token_ids[keep:], gen.sources[keep:], gen.scores[keep:]
            for index in [k for k in r.draft_probs if k >= keep]:
                del r.draft_probs[index]
            chosen[i], sources[i] = token, "fix"
            gen.rollbacks += 1
            gen.discarded += dropped + 1  # this step's own token was written too
        return {i: shifts[i] for i in rejected}

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
        """Per-row thresholds, or None when every row uses the policy's own."""
        if all(r.threshold is None and r.target_rate is None for r in self.requests):
            return None
        return torch.tensor([self._threshold(r) for r in self.requests], device=self.ids.device)

    def _threshold(self, r: Request) -> float:
        fixed = (self.engine.policy.threshold or 0.0) if r.threshold is None else r.threshold
        if r.target_rate is None:
            return fixed
        # A target rate: the policy maps it to a threshold from this request's recent scores, aiming off to make
        # up over the next RATE_CATCH_UP_TOKENS tokens what the request is behind or ahead of the target. Scores
        # drift within an answer (the SLM grows surer as it goes on), so the top `rate` of the past alone
        # under-routes.
        gen = r.generation
        behind = r.target_rate * len(gen.token_ids) - gen.llm_tokens  # tokens the request owes the LLM (< 0: ahead)
        aim = min(1.0, max(0.0, r.target_rate + behind / RATE_CATCH_UP_TOKENS))
        aimed = self.engine.policy.threshold_for_rate(aim, gen.scores)
        return fixed if aimed is None else aimed

    def _keep(self, rows: list[int]) -> None:
        if len(rows) == len(self.requests):
            return
        self.requests = [self.requests[i] for i in rows]
        if not rows:  # drop the caches now: on llama.cpp their cells would shift where the next request's go
            self._set(None, None)
            self.writer_cache, self.llm_cache = self._new_caches()
            return
        index = torch.tensor(rows, device=self.ids.device)
        self._set(self.ids[index], self.mask[index])
        for backend, cache in self._caches():
            backend.select_rows(cache, index)

    def _finished(self, r: Request) -> bool:
        reason = self._ends(r, r.generation.token_ids)
        if reason:
            r.generation.finish_reason = reason
        return reason is not None

    def _ends(self, r: Request, tokens: list[int], then: int | None = None) -> str | None:
        """Why an output of these tokens (followed by `then`, if given) is complete ("stop" or "length"), or None."""
        params = r.params
        last, length = (tokens[-1], len(tokens)) if then is None else (then, len(tokens) + 1)
        if last in self.engine.eos_ids and not params.ignore_eos:
            return "stop"
        if params.stop:
            # Decode only the tail: enough tokens to hold the longest stop string.
            longest = max(len(s) for s in params.stop)
            tail = tokens[-(longest + 2) :] if then is None else tokens[-(longest + 1) :] + [then]
            text = self.engine.tokenizer.decode(tail, skip_special_tokens=True)
            if any(s in text for s in params.stop):
                return "stop"
        if length >= params.max_new_tokens:
            return "length"
        return None

    def _final_text(self, r: Request) -> str:
        text = self.engine.tokenizer.decode(r.generation.token_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in r.params.stop if s in text]
        return text[: min(cuts)] if cuts else text


def sample_rows(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """One token per row, each with its request's sampling settings (greedy rows in one argmax)."""
    tokens = logits.argmax(-1)
    for i, r in enumerate(requests):
        if r.params.temperature > 0:
            tokens[i] = sample(logits[i : i + 1], r.params, r.generator)[0]
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
