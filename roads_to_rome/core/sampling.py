"""How a request samples (`SamplingParams`, and the one parser of a verification setting), and the rules that turn
logits into tokens: sampling, and verification's acceptance.

The acceptance rules are pure functions of tensors, so they are tested on their own; verification.py applies them
to the tokens an LLM catch-up checks, for `Batch` (batch.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from roads_to_rome.errors import R2RError

if TYPE_CHECKING:
    from roads_to_rome.core.grammar import GrammarWalk, OutputFormat

GREEDY_BELOW = 1e-5  # temperatures below this are greedy
MAX_LOGPROBS = 20  # the most alternatives a token's log-probability comes with (OpenAI's limit)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
# A repetition penalty divides or multiplies logits by itself: bounded both ways so that the result stays finite in
# float32 and the softmax over it a distribution.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range: -100 bans a token, 100 all but forces it)


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model that wrote it (the SLM, the LLM, or the LLM's fix), and that
    model's most likely tokens there: the distribution the model gave, before penalties, temperature and top-p/top-k."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int = 1  # the token's place in that distribution, the most likely first (vLLM's `rank`)



def logprob_entries(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's entry for its token: its log-probability under the row's logits [n, V], the `top` most likely
    tokens' and its rank."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), -1)
    own = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device)[:, None])
    ranks = ((logprobs > own).sum(-1) + 1).tolist()
    values, best = logprobs.topk(top, -1) if top else (logprobs[:, :0], logprobs[:, :0])
    return [TokenLogprob(float(o), list(zip(i, v)), r)
            for o, i, v, r in zip(own[:, 0].tolist(), best.tolist(), values.tolist(), ranks)]


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
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest token's probability (0: none)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit), OpenAI's; a dict is taken too
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens may be written (None: any)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output, beside the models' end-of-sequence ones
    min_tokens: int = 0  # nothing ends the output before it holds this many tokens (vLLM's rule)
    # Token sequences the output never holds: a sequence's last token is banned where the output ends with the rest
    # (vLLM's `bad_words`, each word as its tokenizer writes it: `serving.adapter.bad_words`)
    bad_words: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False  # the stop string or stop token that ended it stays in the text
    skip_special_tokens: bool = True  # special tokens (<|im_start|>, an end of sequence...) are left out of the text
    output_format: OutputFormat | None = None  # a structured output: the format the output follows (core/grammar.py)

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "bad_words", tuple(tuple(word) for word in self.bad_words))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
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
        if not 0 <= self.min_p <= 1:
            raise R2RError(f"min-p must be in [0, 1] (0 turns it off), got {self.min_p}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise R2RError(f"logit_bias names token {token}: token ids are >= 0")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise R2RError(f"a logit bias is in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} for token "
                               f"{token}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise R2RError("allowed token ids must name at least one token (or be left out: any token)")
        if self.output_format is not None:
            if self.allowed_token_ids is not None:
                raise R2RError("allowed token ids and a structured output both say which tokens may be written: "
                               "give one of them")
            self.output_format.validate()
        if any(t < 0 for t in (*self.stop_token_ids, *(self.allowed_token_ids or ()), *self.banned_ids)):
            raise R2RError("token ids are >= 0")
        if not all(self.bad_words):
            raise R2RError("a bad word is at least one token")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise R2RError(f"min tokens must be in [0, max new tokens = {self.max_new_tokens}], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise R2RError("stop strings must not be empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise R2RError(f"the seed must fit in 64 bits (-2^63 to 2^64 - 1), got {self.seed}")

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def reshapes(self) -> bool:
        """Whether the LLM's whole distribution is needed to choose a token: penalties, a logit bias, allowed
        tokens or a structured output can lift any token above the ones a top-k list shows (ending tokens held back
        until `min_tokens` only remove a few, which a ranked list can do exactly)."""
        return (self.penalised or bool(self.logit_bias) or self.allowed_token_ids is not None
                or self.output_format is not None)

    @property
    def adjusted(self) -> bool:
        """Whether a model's logits change before a token is chosen from them (`adjust_logits`; banning tokens
        only removes them, as holding back ending ones does)."""
        return self.reshapes or self.min_tokens > 0 or bool(self.bad_words)

    @property
    def banned_ids(self) -> tuple[int, ...]:
        return tuple(t for word in self.bad_words for t in word)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token id these settings name is one of a model's `vocab_size`."""
        named = {"logit_bias": [t for t, _ in self.logit_bias], "allowed_token_ids": self.allowed_token_ids or (),
                 "stop_token_ids": self.stop_token_ids, "bad_words": self.banned_ids}
        for name, ids in named.items():
            if any(t >= vocab_size for t in ids):
                raise R2RError(f"{name} names token {max(ids)}, beyond the vocabulary: ids are 0 to {vocab_size - 1}")


@dataclass(frozen=True)
class Verify:
    """A verification setting, made by `parse_verify` only: off, strict (a routed or unverified token stays only
    where it is the LLM's own choice, or passes speculative sampling's test), or a tolerance in nats (a token within
    that many nats of the LLM's best stays)."""

    strict: bool = False
    tolerance: float | None = None  # None: off, unless strict

    @property
    def on(self) -> bool:
        return self.strict or self.tolerance is not None

    @property
    def value(self) -> str | float:
        """The setting as it is written (JSON, system names): "off", "strict" or the tolerance."""
        return "strict" if self.strict else "off" if self.tolerance is None else self.tolerance

    def __str__(self) -> str:
        return f"{self.value:g}" if self.tolerance is not None else str(self.value)


VERIFY_OFF, VERIFY_STRICT = Verify(), Verify(strict=True)


def parse_verify_list(text: str) -> tuple[Verify, ...]:
    """Several verification settings, comma-separated: one system each, wherever a command compares systems (empty:
    none)."""
    return tuple(parse_verify(v.strip()) for v in str(text).split(",") if v.strip())


def parse_verify(value) -> Verify:
    """The one parser of a verification setting: `off`, `strict`, or a tolerance in nats >= 0 (a number or its
    text)."""
    if isinstance(value, Verify):
        return value
    if value in ("off", "strict"):
        return VERIFY_STRICT if value == "strict" else VERIFY_OFF
    try:
        tolerance = float(value)
    except (TypeError, ValueError):
        tolerance = float("nan")
    if not tolerance >= 0 or tolerance == float("inf"):
        raise R2RError(f"verify takes off, strict or a tolerance in nats >= 0, got {value!r}")
    return Verify(tolerance=tolerance)


def check_max_unverified(n: int | None, verified: bool = True) -> int | None:
    """`n` if it can bound the tokens written ahead of the LLM's check, where `verified` says whether anything is
    checked (with nothing checked, a bound would be silently ignored)."""
    if n is not None and n < 1:
        raise R2RError(f"max unverified tokens must be at least 1 (or no limit), got {n}")
    if n is not None and not verified:
        raise R2RError("--max-unverified bounds the tokens written ahead of the LLM's check, and nothing is checked "
                       "(--verify off, its default for one model alone): give --verify strict or a tolerance, or "
                       "leave --max-unverified out")
    return n


@dataclass(frozen=True)
class LogitRules:
    """What `adjust_logits` reads at every token of one request, as tensors made once (`LogitRules.of`)."""

    params: SamplingParams
    prompt_tokens: torch.Tensor  # the prompt's distinct tokens, for the repetition penalty
    ending: torch.Tensor  # the tokens that would end the output, held back while it is shorter than min_tokens
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    allowed: torch.Tensor | None
    grammar: GrammarWalk | None = None  # the sequence's walk through its structured output
    bad_words: BadWords | None = None

    @property
    def narrows(self) -> bool:
        """Whether these rules can leave a row no token at all (then it fails alone: `NothingToWrite`)."""
        return (self.allowed is not None or self.grammar is not None or self.bad_words is not None
                or (self.params.min_tokens > 0 and len(self.ending) > 0))

    def banned_next(self, output_ids: Sequence[int]) -> list[int]:
        return [] if self.bad_words is None else self.bad_words.banned_next(output_ids)

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids: Sequence[int], ending_ids: Sequence[int] = (),
           grammar: GrammarWalk | None = None) -> LogitRules:
        ids = [t for t, _ in params.logit_bias]
        return cls(params, torch.tensor(list(prompt_ids), dtype=torch.long).unique(),
                   torch.tensor(sorted(ending_ids), dtype=torch.long), torch.tensor(ids, dtype=torch.long),
                   torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32),
                   None if params.allowed_token_ids is None else torch.tensor(params.allowed_token_ids,
                                                                                dtype=torch.long), grammar,
                   BadWords(params.bad_words) if params.bad_words else None)


def adjust_logits(logits: torch.Tensor, rules: LogitRules, output_ids: Sequence[int]) -> torch.Tensor:
    """One row's next-token logits [V] as a request's settings leave them before temperature, min-p and top-k/p,
    in vLLM's order: the logit bias added, then every token but the allowed ones (or those the structured output
    allows after `output_ids`), and the tokens that would end the output while it is shorter than `min_tokens`, set
    to -inf, and the last token of each bad word whose other tokens end the output; then the penalties
    (`apply_penalties`). Unchanged when no setting asks for any of it."""
    params = rules.params
    if not params.adjusted:
        return logits
    logits = logits.to(torch.float32, copy=True)
    device = logits.device
    if params.logit_bias:
        logits[rules.bias_ids.to(device)] += rules.bias_values.to(device)
    if rules.allowed is not None:
        allowed = torch.full_like(logits, float("-inf"))
        allowed[rules.allowed.to(device)] = 0
        logits += allowed
    if rules.grammar is not None and (allowed := rules.grammar.allowed(output_ids)) is not None:
        logits.masked_fill_(~allowed.to(device), float("-inf"))
    if rules.bad_words is not None:
        if len(rules.bad_words.always):
            logits[rules.bad_words.always.to(device)] = float("-inf")
        if completing := rules.bad_words.completing(output_ids):
            logits[completing] = float("-inf")
    if len(output_ids) < params.min_tokens and len(rules.ending):
        held = logits.clone() if rules.grammar is not None else None
        logits[rules.ending.to(device)] = float("-inf")
        if held is not None and not bool(torch.isfinite(logits).any()):  # the format allows nothing but its end
            logits = held
    if rules.narrows and not bool(torch.isfinite(logits).any()):
        raise NothingToWrite(nothing_left(rules, output_ids))
    return apply_penalties(logits, params, rules.prompt_tokens, output_ids)


class NothingToWrite(R2RError):
    """A row's settings leave no token it may write next: it ends with this error; the rows beside it go on."""


def nothing_left(rules: LogitRules, output_ids: Sequence[int]) -> str:
    """Which of a request's settings removed tokens at this point of its output, said so that a client can loosen
    one of them."""
    params, said = rules.params, []
    if params.allowed_token_ids is not None:
        said.append(f"allowed_token_ids allows {len(set(params.allowed_token_ids))} token(s)")
    if rules.grammar is not None:
        said.append(f"the {params.output_format.kind} structured output allows only its own continuations")
    if params.bad_words and rules.banned_next(output_ids):
        said.append(f"bad_words bans {len(set(rules.banned_next(output_ids)))} token(s) here")
    if len(output_ids) < params.min_tokens and len(rules.ending):
        said.append(f"min_tokens={params.min_tokens} holds back the tokens that end the output")
    return (f"no token is left to write after {len(output_ids)} output token(s): {'; '.join(said)}, and together "
            "they allow none; loosen one of them")


class BadWords:
    """A request's bad words indexed once, so that each step looks up only the words the output's last token could
    be completing: a one-token word's token always, a longer word's last where the output ends with the rest. A step
    costs the words that end in the output's last token, not every word."""

    def __init__(self, bad_words: tuple[tuple[int, ...], ...]):
        self.always = torch.tensor(sorted({word[0] for word in bad_words if len(word) == 1}), dtype=torch.long)
        self.by_last: dict[int, list[tuple[int, ...]]] = {}  # the token before the banned one -> words ending so
        for word in bad_words:
            if len(word) > 1:
                self.by_last.setdefault(word[-2], []).append(word)

    def completing(self, output_ids: Sequence[int]) -> list[int]:
        """The last tokens of the longer words whose other tokens end `output_ids`."""
        words = self.by_last.get(output_ids[-1], ()) if len(output_ids) else ()
        n = len(output_ids)
        return [word[-1] for word in words
                if len(word) - 1 <= n and tuple(output_ids[n - len(word) + 1 :]) == word[:-1]]

    def banned_next(self, output_ids: Sequence[int]) -> list[int]:
        return self.always.tolist() + self.completing(output_ids)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int] | torch.Tensor,
                    output_ids: Sequence[int]) -> torch.Tensor:
    """One row's next-token logits [V] less the request's penalties for the tokens before it, in vLLM's order:
    the repetition penalty on every token of the prompt and the output (a positive logit divided by it, a negative
    one multiplied: CTRL's rule, as transformers applies it), then the frequency penalty times each token's count in
    the output and the presence penalty once per token the output holds. Unchanged without penalties. `prompt_ids`
    may be given as a tensor of the prompt's distinct tokens (`LogitRules.prompt_tokens`: made once per request)."""
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
    """The distribution `sample` draws from (temperature > 0): temperature, then min-p, top-k and top-p (vLLM's
    order)."""
    logits = logits / params.temperature
    if params.min_p > 0:  # p < min_p * p_max, in logits: no softmax over the vocabulary needed
        floor = logits.max(-1, keepdim=True).values + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if params.top_k:
        kth_best = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if params.top_p < 1:
        logits = top_p_cut(logits, params.top_p)
    return logits.softmax(-1)


TOP_P_CANDIDATES = (64, 1024)  # how many of the likeliest tokens top-p ranks, in turn, before it sorts whole rows


def top_p_cut(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits [B, V] with each row's tokens outside its nucleus at -inf: a token is dropped when the tokens ranked
    above it already hold `top_p` of the mass (the best one always stays). Sorting a whole row of a large vocabulary
    costs a sizeable part of a CPU step (docs/results/2026-11-28-sampling.md); a nucleus almost always lies within a
    row's few likeliest tokens, so only they are ranked (more when they do not hold `top_p`, all as a last resort)."""
    probs = logits.softmax(-1)
    for k in TOP_P_CANDIDATES:
        if k < logits.shape[-1]:
            ranked, order = probs.topk(k, dim=-1)
            if bool((ranked.sum(-1) >= top_p).all()):
                break
    else:  # flat rows: rank everything
        ranked, order = probs.sort(dim=-1, descending=True)
    drop = ranked.cumsum(-1) - ranked >= top_p
    drop[:, 0] = False  # (a top_p that float32 rounds to 0 would drop it too)
    kept = logits.gather(-1, order).masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, kept)


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
