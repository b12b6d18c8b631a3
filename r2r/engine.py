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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from r2r.errors import R2RError
from r2r.policies import AlwaysSLM, RoutingPolicy


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
    """Seconds spent per part of the loop, for one `generate` call (shared by its rows)."""

    slm_s: float = 0.0
    router_s: float = 0.0
    llm_s: float = 0.0
    total_s: float = 0.0
    steps: int = 0
    llm_calls: int = 0


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
class Step:
    """What one decode step added to one row (yielded by `Engine.stream`)."""

    row: int  # index of the prompt in the call
    token_id: int
    source: str
    score: float
    finished: bool


class Engine:
    def __init__(self, slm, llm, tokenizer, policy: RoutingPolicy | None = None):
        self.slm, self.llm, self.tokenizer = slm, llm, tokenizer
        self.policy = policy or AlwaysSLM()
        self.eos_ids = eos_token_ids(slm.model if hasattr(slm, "model") else None, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.sync = torch.cuda.synchronize if slm.device.type == "cuda" else (lambda: None)

    def encode_chat(self, message: str) -> list[int]:
        """A user message in the model's chat template, ready for the assistant's answer."""
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def encode_raw(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        results: list[Generation] = []
        for _ in self.stream(prompts, params, results):
            pass
        return results

    def stream(self, prompts: list[list[int]], params: SamplingParams, results: list | None = None):
        """Decode all prompts together, yielding the list of `Step`s each decode step adds.

        `results`, when given, is filled with one `Generation` per prompt (complete once the
        generator is exhausted)."""
        params.validate()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise R2RError("every prompt needs at least one token")
        if self.llm is None and not isinstance(self.policy, AlwaysSLM):
            raise R2RError(f"the {self.policy.name!r} policy routes to an LLM, but no LLM is loaded")
        device = self.slm.device
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device).manual_seed(params.seed)
        params_b = (
            self.slm.num_params / 1e9,
            self.policy.num_params / 1e9,
            (self.llm.num_params if self.llm else 0) / 1e9,
        )
        timings = Timings()
        gens = [Generation(prompt_ids=list(p), params_b=params_b, timings=timings) for p in prompts]
        if results is not None:
            results[:] = gens

        ids, mask = left_pad(prompts, self.pad_id, device)
        rows = list(range(len(prompts)))  # which prompt each live row of the batch is
        slm_cache = self.slm.new_cache()
        llm_cache = self.llm.new_cache() if self.llm else None
        unread = ids  # the columns the SLM has not read yet
        max_stop_len = max((len(s) for s in params.stop), default=0)
        start = time.perf_counter()

        for step in range(params.max_new_tokens):
            # 1. The SLM proposes.
            t0 = time.perf_counter()
            logits, hidden = self.slm.forward(slm_cache, unread, mask)
            proposal = sample(logits, params, generator)
            self.sync()
            t1 = time.perf_counter()
            # 2. The policy decides which rows the LLM takes.
            to_llm, scores = self.policy.route(logits, hidden, proposal)
            routed = to_llm.tolist()
            t2 = time.perf_counter()
            # 3. The LLM catches up on every column since it last ran, then emits its token.
            chosen = proposal
            if any(routed):
                llm_logits, _ = self.llm.forward(llm_cache, ids[:, llm_cache.length :], mask)
                chosen = torch.where(to_llm, sample(llm_logits, params, generator), proposal)
                self.sync()
                timings.llm_calls += 1
            t3 = time.perf_counter()
            timings.slm_s += t1 - t0
            timings.router_s += t2 - t1
            timings.llm_s += t3 - t2
            timings.steps += 1

            # 4. Append the new column and record each row's token.
            ids = torch.cat([ids, chosen[:, None]], dim=1)
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            unread = chosen[:, None]
            now = time.perf_counter() - start
            steps, keep = [], []
            for i, (row, token, is_llm, score) in enumerate(zip(rows, chosen.tolist(), routed, scores.tolist())):
                gen = gens[row]
                gen.token_ids.append(token)
                gen.sources.append("llm" if is_llm else "slm")
                gen.scores.append(float(score))
                gen.elapsed_s = now
                finished = self._finished(gen, token, params, max_stop_len)
                steps.append(Step(row, token, gen.sources[-1], float(score), finished))
                if not finished:
                    keep.append(i)
            timings.total_s = now
            yield steps

            # Finished rows leave the batch, so they cost nothing from here on.
            if not keep:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=device)
                ids, mask, unread = ids[index], mask[index], unread[index]
                self.slm.select_rows(slm_cache, index)
                if llm_cache is not None:
                    self.llm.select_rows(llm_cache, index)
                rows = [rows[i] for i in keep]

        for gen in gens:
            gen.text = self._final_text(gen, params)

    def _finished(self, gen: Generation, token: int, params: SamplingParams, max_stop_len: int) -> bool:
        if token in self.eos_ids and not params.ignore_eos:
            gen.finish_reason = "stop"
            return True
        if max_stop_len:
            # Decode only the tail: enough tokens to hold the longest stop string.
            tail = self.tokenizer.decode(gen.token_ids[-(max_stop_len + 2) :], skip_special_tokens=True)
            if any(s in tail for s in params.stop):
                gen.finish_reason = "stop"
                return True
        if len(gen.token_ids) >= params.max_new_tokens:
            gen.finish_reason = "length"
            return True
        return False

    def _final_text(self, gen: Generation, params: SamplingParams) -> str:
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in params.stop if s in text]
        return text[: min(cuts)] if cuts else text


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS and the model's generation config's."""
    ids = set()
    config = getattr(model, "generation_config", None)
    for value in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
