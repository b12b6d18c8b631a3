"""A prompt's own log-probabilities (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`): how likely each
prompt token is given the tokens before it, under the model R2R would have write it there.

The SLM reads the prompt; the routing policy looks at each position as it does while decoding (the SLM's logits,
last hidden state and greedy token there) and sends a position to the LLM or keeps it, with the request's threshold
or forced model; the LLM reads the prompt when a position goes to it. A position's entry is the log-probability of
the prompt's next token under the logits of the model it went to, and that model's most likely tokens. Verification,
which accepts or replaces tokens R2R samples, plays no part: a prompt's tokens are given. A target LLM rate is read
position by position, as a decoded answer's would be. This is what evaluation harnesses read for multiple-choice
and perplexity tasks (lm-evaluation-harness asks `echo: true, logprobs: 1`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from roads_to_rome.core.request import Sequence
from roads_to_rome.core.sampling import TokenLogprob, logprob_entries
from roads_to_rome.routing import rate

if TYPE_CHECKING:
    from roads_to_rome.core.context import Context


def score_prompt(context: Context, sequence: Sequence, caches: tuple) -> tuple[list[TokenLogprob | None], list[str]]:
    """Each prompt token's entry (None for the first: nothing comes before it) and which model gave it ("slm" or
    "llm"), with the request's `prompt_logprobs` most likely tokens. Each model that scores reads the prompt once,
    whole, into its cache of `caches` (the writer's, the LLM's: a `PromptRead`'s, None for a model that does not
    read the sequence), up to its last token as a prompt read ahead does: decoding goes on from that read. Its
    logits are looked at a chunk of positions at a time (`Backend.score_sequence`), each position's entry kept:
    memory for one chunk's logits, not for the prompt's whole [T, V]."""
    ids, top = list(sequence.prompt_ids), sequence.request.prompt_logprobs
    read = ids[:-1]  # the logits after each of these give the next prompt token's entry
    if not read:
        return [None], []
    writer_cache, llm_cache = caches
    entries: list[TokenLogprob | None] = [None] * len(read)
    sources: list[str] = []

    def keep(source: str):
        """A chunk visitor that keeps the entries of the positions `source` gives."""
        def visit(first: int, logits: torch.Tensor, _hidden: torch.Tensor) -> None:
            rows = [j for j in range(len(logits)) if sources[first + j] == source]
            for j, entry in zip(rows, logprob_entries(logits[rows], [ids[first + j + 1] for j in rows], top)):
                entries[first + j] = entry
        return visit

    with torch.inference_mode():
        if writer_cache is not None:
            routing, writer = PromptRouting(context, sequence), keep(context.writer_source)

            def route_then_keep(first: int, logits: torch.Tensor, hidden: torch.Tensor) -> None:
                sources.extend(routing.decide(logits, hidden))
                writer(first, logits, hidden)

            context.writer.score_sequence(read, writer_cache, route_then_keep)
        else:
            sources.extend(["llm"] * len(read))
        if "llm" in sources and context.writer_source != "llm":
            if context.llm.full_logits:
                context.llm.score_sequence(read, llm_cache, keep("llm"))
            else:  # a server's own (vLLM's); the LLM's cache reads the prompt as any other's
                served = context.llm.backend.prompt_logprobs(ids, top, sequence.request.cache_salt)
                for t, source in enumerate(sources):
                    if source == "llm":
                        entries[t] = served_logprob(served[t], ids[t + 1], top)
    return [None, *entries], sources


def served_logprob(ranked: dict[int, tuple[float, int]], token: int, top: int) -> TokenLogprob:
    """A position's entry from a server's prompt log-probabilities (token id -> log-probability, rank)."""
    tops = sorted((rank, t, lp) for t, (lp, rank) in ranked.items() if rank <= top)
    return TokenLogprob(ranked[token][0], [(t, lp) for _, t, lp in tops], ranked[token][1])


class PromptRouting:
    """The model each prompt position's next token is read under, from the writer's logits and hidden states there,
    a chunk of positions at a time (`decide`): the policy's choice, as while decoding, or the one the request
    forces. A target LLM rate follows the decisions before each position, across chunks."""

    def __init__(self, context: Context, sequence: Sequence):
        self.context, self.sequence = context, sequence
        self.scores: list[float] = []
        self.routed = 0

    def decide(self, logits: torch.Tensor, hidden: torch.Tensor) -> list[str]:
        context, n = self.context, logits.shape[0]
        if not context.routes:
            return [context.writer_source] * n
        if self.sequence.force is not None:
            return [self.sequence.force] * n
        request, policy = self.sequence.request, context.policy
        if request.target_rate is None:
            thresholds = None if request.threshold is None else torch.full((n,), request.threshold,
                                                                            device=logits.device)
            to_llm, _ = policy.route(logits, hidden, logits.argmax(-1), thresholds)
            return ["llm" if x else "slm" for x in to_llm.tolist()]
        sources = []
        for t in range(n):  # the threshold at each position follows the decisions before it
            threshold = rate.row_threshold(policy, request.threshold, request.target_rate, len(self.scores),
                                           self.routed, self.scores)
            to_llm, score = policy.route(logits[t : t + 1], hidden[t : t + 1], logits[t : t + 1].argmax(-1),
                                         torch.tensor([threshold], device=logits.device))
            self.scores.append(float(score[0]))
            self.routed += bool(to_llm[0])
            sources.append("llm" if to_llm[0] else "slm")
        return sources
