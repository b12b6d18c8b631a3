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

from r2r.backend import Backend
from r2r.errors import R2RError
from r2r.policies import AlwaysLLM, AlwaysSLM, RoutingPolicy


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # for benchmarks: always produce max_new_tokens

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise R2RError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise R2RError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise R2RError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise R2RError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise R2RError("stop strings must not be empty")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from float32 logits [B, V]."""
    if params.temperature == 0:
        return logits.argmax(-1)
    logits = logits / params.temperature
    if params.top_k:
        kth_best = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


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
    sources: list[str] = field(default_factory=list)  # "slm" or "llm", one per generated token
    scores: list[float] = field(default_factory=list)  # the policy's score behind each decision
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length"
    elapsed_s: float = 0.0  # from the start of the call to this row's last token
    params_b: tuple[float, float, float] = (0.0, 0.0, 0.0)  # SLM, router, LLM parameters (billions)
    timings: Timings = field(default_factory=Timings)

    @property
    def llm_tokens(self) -> int:
        return self.sources.count("llm")

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
    index: int = 0  # the prompt's position in its `Engine.stream` / `Engine.generate` call
    generation: Generation | None = None  # set when the request joins a batch
    generator: torch.Generator | None = None
    cancelled: bool = False  # set from anywhere; the request leaves at the next step
    started: float = 0.0


@dataclass
class Step:
    """What one decode step added to one request."""

    request: Request
    token_id: int
    source: str  # "slm" or "llm"
    score: float  # the policy's score behind the decision
    finished: bool


class Engine:
    """The models, the tokenizer and the routing policy; `Batch` does the decoding.

    A pair (`Engine(slm, llm, tokenizer, policy)`) routes; one model alone (`Engine.alone`)
    writes every token itself, for label responses, judges and the single-model baselines."""

    def __init__(self, slm: Backend | None, llm: Backend | None, tokenizer, policy: RoutingPolicy | None = None):
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
        self.sync = torch.cuda.synchronize if self.writer.device.type == "cuda" else (lambda: None)

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
        results: list[Generation] = []
        for _ in self.stream(prompts, params, results):
            pass
        return results

    def stream(self, prompts: list[list[int]], params: SamplingParams, results: list | None = None):
        """Decode all prompts as one batch, yielding the list of `Step`s each decode step adds
        (`step.request.index` is the prompt's position in `prompts`).

        `results`, when given, is filled with one `Generation` per prompt (complete once the
        generator is exhausted)."""
        requests = [Request(list(p), params, index=i) for i, p in enumerate(prompts)]
        batch = Batch(self)
        batch.add(requests)
        if results is not None:
            results[:] = [r.generation for r in requests]
        while batch.requests:
            yield batch.step()


class Batch:
    """Requests decoding in lockstep: one row each in both models' caches.

    Requests can join between steps (continuous batching): a newcomer is left-padded to the
    batch's width (or the batch to the newcomer's) and prefilled up to where each model's cache
    already is, then its cache rows are appended. Finished and cancelled requests leave.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.requests: list[Request] = []
        self.ids = self.mask = None  # [rows, columns]: token streams (left-padded) and their padding mask
        self.writer_cache, self.llm_cache = self._new_caches()

    def _new_caches(self):
        """The writer's cache, and the LLM's when a pair routes to it (None when a model runs alone)."""
        engine = self.engine
        return engine.writer.new_cache(), engine.llm.new_cache() if engine.routes else None

    def add(self, requests: list[Request]) -> None:
        engine = self.engine
        for r in requests:
            r.params.validate()
            if not r.prompt_ids:
                raise R2RError("every prompt needs at least one token")
            routes_to_llm = r.force == "llm" or (r.force is None and engine.policy.routes_to_llm)
            if engine.llm is None and routes_to_llm:
                raise R2RError(f"the {engine.policy.name!r} policy routes to an LLM, but no LLM is loaded")
            if engine.slm is None and r.force == "slm":
                raise R2RError("this request asks for the SLM, but no SLM is loaded")
        params_b = ((engine.slm.num_params if engine.slm else 0) / 1e9,
                    (engine.policy.num_params if engine.routes else 0) / 1e9,
                    (engine.llm.num_params if engine.llm else 0) / 1e9)
        now = time.perf_counter()
        for r in requests:
            r.generation = Generation(prompt_ids=r.prompt_ids, params_b=params_b)
            r.started = now
            if r.params.seed is not None:
                r.generator = torch.Generator(engine.writer.device).manual_seed(r.params.seed)
        ids, mask = left_pad([r.prompt_ids for r in requests], engine.pad_id, engine.writer.device)
        if not self.requests:
            # An empty batch: the newcomers are the batch; the next step reads their prompts.
            self.ids, self.mask = ids, mask
            self.writer_cache, self.llm_cache = self._new_caches()
            self.requests = list(requests)
            return
        width = self.ids.shape[1]
        if ids.shape[1] > width:
            self._pad_left(ids.shape[1] - width)
        elif ids.shape[1] < width:
            ids, mask = pad_columns_left(ids, mask, width - ids.shape[1], engine.pad_id)
        # Prefill the newcomers up to where each cache is, then append their rows.
        for backend, cache in self._caches():
            if cache.length:
                fresh = backend.new_cache()
                backend.forward(fresh, ids[:, : cache.length], mask[:, : cache.length])
                backend.append_rows(cache, fresh)
        self.ids, self.mask = torch.cat([self.ids, ids]), torch.cat([self.mask, mask])
        self.requests += requests

    def _caches(self):
        """(backend, cache) for each model this batch runs."""
        yield self.engine.writer, self.writer_cache
        if self.llm_cache is not None:
            yield self.engine.llm, self.llm_cache

    def _pad_left(self, n: int) -> None:
        self.ids, self.mask = pad_columns_left(self.ids, self.mask, n, self.engine.pad_id)
        for backend, cache in self._caches():
            backend.pad_left(cache, n)

    def step(self) -> list[Step]:
        """One decode step for every request: what it added to each."""
        self._keep([i for i, r in enumerate(self.requests) if not r.cancelled])
        if not self.requests:
            return []
        engine, requests = self.engine, self.requests
        # 1. The writer (the SLM of a pair) reads the columns it has not read yet and proposes a token per row.
        t0 = time.perf_counter()
        logits, hidden = engine.writer.forward(self.writer_cache, self.ids[:, self.writer_cache.length :], self.mask)
        proposal = sample_rows(logits, requests)
        engine.sync()
        t1 = time.perf_counter()
        # 2. The policy decides which rows the LLM takes (a request may force one model).
        if engine.routes:
            to_llm, scores = engine.policy.route(logits, hidden, proposal, self._thresholds())
            routed = [r.force == "llm" if r.force else bool(x) for r, x in zip(requests, to_llm.tolist())]
            scores = scores.tolist()
        else:  # one model alone writes every token
            routed, scores = [False] * len(requests), [0.0] * len(requests)
        t2 = time.perf_counter()
        # 3. The LLM catches up on every column since it last ran, then emits its token.
        chosen = proposal
        if any(routed):
            llm_logits, _ = engine.llm.forward(self.llm_cache, self.ids[:, self.llm_cache.length :], self.mask)
            chosen = proposal.clone()
            for i in (i for i, is_llm in enumerate(routed) if is_llm):
                chosen[i] = sample_rows(llm_logits[i : i + 1], requests[i : i + 1])[0]
            engine.sync()
        t3 = time.perf_counter()

        # 4. Append the new column and record each row's token; finished rows leave the batch.
        self.ids = torch.cat([self.ids, chosen[:, None]], dim=1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(requests), 1)], dim=1)
        now = time.perf_counter()
        steps, keep = [], []
        for i, (r, token, is_llm, score) in enumerate(zip(requests, chosen.tolist(), routed, scores)):
            gen = r.generation
            self._count_time(gen.timings, t1 - t0, t2 - t1, t3 - t2, now - t0, llm_ran=any(routed))
            gen.token_ids.append(token)
            gen.sources.append("llm" if is_llm else engine.writer_source)
            gen.scores.append(float(score))
            gen.elapsed_s = now - r.started
            finished = self._finished(r, token)
            if finished:
                gen.text = self._final_text(r)
            else:
                keep.append(i)
            steps.append(Step(r, token, gen.sources[-1], float(score), finished))
        self._keep(keep)
        return steps

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
        # A target rate: the policy maps it to a threshold from this request's scores so far.
        aimed = self.engine.policy.threshold_for_rate(r.target_rate, r.generation.scores)
        return fixed if aimed is None else aimed

    def _keep(self, rows: list[int]) -> None:
        if len(rows) == len(self.requests):
            return
        self.requests = [self.requests[i] for i in rows]
        if not rows:
            return
        index = torch.tensor(rows, device=self.ids.device)
        self.ids, self.mask = self.ids[index], self.mask[index]
        for backend, cache in self._caches():
            backend.select_rows(cache, index)

    def _finished(self, r: Request, token: int) -> bool:
        gen, params = r.generation, r.params
        if token in self.engine.eos_ids and not params.ignore_eos:
            gen.finish_reason = "stop"
            return True
        if params.stop:
            # Decode only the tail: enough tokens to hold the longest stop string.
            longest = max(len(s) for s in params.stop)
            tail = self.engine.tokenizer.decode(gen.token_ids[-(longest + 2) :], skip_special_tokens=True)
            if any(s in tail for s in params.stop):
                gen.finish_reason = "stop"
                return True
        if len(gen.token_ids) >= params.max_new_tokens:
            gen.finish_reason = "length"
            return True
        return False

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
