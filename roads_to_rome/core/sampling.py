"""How a request samples (`SamplingParams`, and the one parser of a verification setting), and the rules that turn
logits into tokens: sampling, and verification's acceptance.

The acceptance rules are pure functions of tensors, so they are tested on their own; verification.py applies them
to the tokens an LLM catch-up checks, for `Batch` (batch.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from roads_to_rome.errors import R2RError

GREEDY_BELOW = 1e-5  # temperatures below this are greedy
MAX_LOGPROBS = 20  # the most alternatives a token's log-probability comes with (OpenAI's limit)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
# A repetition penalty divides or multiplies logits by itself: bounded both ways so that the result stays finite in
# float32 and the softmax over it a distribution.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # for benchmarks: always produce max_new_tokens
    logprobs: int | None = None  # each token's log-probability with this many alternatives (None: none)
    # Penalties on tokens already there, as vLLM and OpenAI apply them (`apply_penalties`): presence and frequency
    # on the output's tokens, repetition on the prompt's and the output's.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 is none

    def __post_init__(self):
        # A temperature this small is greedy decoding, as in vLLM: dividing logits by it overflows to inf (NaN
        # probabilities), and no draw at it could differ from the argmax anyway.
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise R2RError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):
            raise R2RError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise R2RError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise R2RError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise R2RError(f"logprobs takes 0 to {MAX_LOGPROBS} alternatives per token, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise R2RError(f"the {name.replace('_', ' ')} is in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is none), "
                               f"got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise R2RError(f"the repetition penalty is in [{low:g}, {high:g}] (1 is none, above 1 holds back tokens "
                           f"already there), got {self.repetition_penalty}")
        if any(not s for s in self.stop):
            raise R2RError("stop strings must not be empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise R2RError(f"the seed must fit in 64 bits (-2^63 to 2^64 - 1), got {self.seed}")

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def parse_verify_list(text: str) -> tuple[str | float, ...]:
    """Several verification settings, comma-separated: one system each, wherever a command compares systems (empty:
    none)."""
    return tuple(parse_verify(v.strip()) for v in str(text).split(",") if v.strip())


def parse_verify(value) -> str | float:
    """The one parser of a verification setting: `off`, `strict`, or a tolerance in nats >= 0 (a number or its
    text)."""
    if value in ("off", "strict"):
        return value
    try:
        tolerance = float(value)
    except (TypeError, ValueError):
        tolerance = float("nan")
    if not tolerance >= 0 or tolerance == float("inf"):
        raise R2RError(f"verify takes off, strict or a tolerance in nats >= 0, got {value!r}")
    return tolerance


def check_max_unverified(n: int | None) -> int | None:
    if n is not None and n < 1:
        raise R2RError(f"max unverified tokens must be at least 1 (or no limit), got {n}")
    return n


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int] | torch.Tensor,
                    output_ids: Sequence[int]) -> torch.Tensor:
    """One row's next-token logits [V] less the request's penalties for the tokens before it, in vLLM's order:
    the repetition penalty on every token of the prompt and the output (a positive logit divided by it, a negative
    one multiplied: CTRL's rule, as transformers applies it), then the frequency penalty times each token's count in
    the output and the presence penalty once per token the output holds. Unchanged without penalties. `prompt_ids`
    may be given as a tensor of the prompt's distinct tokens (`Sequence.prompt_tokens`: made once per request)."""
    if not params.penalised:
        return logits
    logits = logits.to(torch.float32, copy=True)
    output = torch.tensor(list(output_ids), dtype=torch.long, device=logits.device)
    if params.repetition_penalty != 1:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).to(logits.device)
        seen = torch.cat([prompt, output]).unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if len(output) and (params.frequency_penalty or params.presence_penalty):
        # Only the tokens the output holds change: counting them, not the whole vocabulary, keeps this to
        # microseconds beside a model's step.
        tokens, counts = output.unique(return_counts=True)
        logits[tokens] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from float32 logits [B, V]."""
    if params.temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, params), 1, generator=generator)[:, 0]


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from (temperature > 0): temperature, then top-k, then top-p."""
    logits = logits / params.temperature
    if params.top_k:
        kth_best = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[:, 0] = False  # the best token always stays (a top_p that float32 rounds to 0 would drop it too)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def within_tolerance(logits: torch.Tensor, token: int, best: int, tolerance: float) -> bool:
    """The tolerance rule: keep a token whose log-probability under the LLM is at most `tolerance` nats below that
    of the LLM's own choice `best`. The softmax's normaliser cancels in that difference, so the logits suffice."""
    return bool(logits[token] >= logits[best] - tolerance)


def speculative_residual(target: torch.Tensor, draft: torch.Tensor, token: int,
                         draw: torch.Tensor) -> torch.Tensor | None:
    """Speculative sampling's test for a token drawn from `draft` (the SLM's distribution) against `target` (the
    LLM's): kept when draw * q(token) <= p(token), `draw` uniform in [0, 1), i.e. with probability min(1, p/q).
    None when kept; else the distribution the replacement is drawn from, normalised max(0, p - q) (p itself
    where that is empty), which makes the output follow p."""
    if draw * draft[token] <= target[token]:
        return None
    residual = (target - draft).clamp(min=0)
    residual = residual if residual.sum() > 0 else target
    return residual / residual.sum()
