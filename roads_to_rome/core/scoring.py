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

from roads_to_rome.core.batch import token_logprob
from roads_to_rome.core.request import Sequence, TokenLogprob
from roads_to_rome.routing import rate

if TYPE_CHECKING:
    from roads_to_rome.core.engine import Engine


def score_prompt(engine: Engine, sequence: Sequence, caches: tuple) -> tuple[list[TokenLogprob | None], list[str]]:
    """Each prompt token's entry (None for the first: nothing comes before it) and which model gave it ("slm" or
    "llm"), with the request's `prompt_logprobs` most likely tokens. Each model that scores reads the prompt once,
    whole, into its cache of `caches` (the writer's, the LLM's: a `PromptRead`'s, None for a model that does not
    read the sequence), up to its last token as a prompt read ahead does: decoding goes on from that read."""
    ids, top = list(sequence.prompt_ids), sequence.request.prompt_logprobs
    read = ids[:-1]  # the logits after each of these give the next prompt token's entry
    if not read:
        return [None], []
    writer_cache, llm_cache = caches
    with torch.inference_mode():
        logits = {}
        if writer_cache is not None:
            logits[engine.writer_source], hidden = engine.writer.forward_sequence(read, cache=writer_cache)
            sources = routed_positions(engine, sequence, logits[engine.writer_source], hidden)
        else:
            sources = ["llm"] * len(read)
        served = None
        if "llm" in sources and "llm" not in logits:
            if engine.llm.full_logits:
                logits["llm"] = engine.llm_side.forward_sequence(read, cache=llm_cache)[0]
            else:  # a server's own (vLLM's); the LLM's cache reads the prompt as any other's
                served = engine.llm.prompt_logprobs(ids, top)
        entries = [token_logprob(logits[source][t], ids[t + 1], top) if source in logits
                   else served_logprob(served[t], ids[t + 1], top) for t, source in enumerate(sources)]
    return [None, *entries], sources


def served_logprob(ranked: dict[int, tuple[float, int]], token: int, top: int) -> TokenLogprob:
    """A position's entry from a server's prompt log-probabilities (token id -> log-probability, rank)."""
    tops = sorted((rank, t, lp) for t, (lp, rank) in ranked.items() if rank <= top)
    return TokenLogprob(ranked[token][0], [(t, lp) for _, t, lp in tops], ranked[token][1])


def routed_positions(engine: Engine, sequence: Sequence, logits: torch.Tensor, hidden: torch.Tensor) -> list[str]:
    """The model each position's next token is read under, from the writer's logits and hidden states there: the
    policy's choice, as while decoding, or the one the request forces."""
    n = logits.shape[0]
    if not engine.routes:
        return [engine.writer_source] * n
    if sequence.force is not None:
        return [sequence.force] * n
    request, policy = sequence.request, engine.policy
    if request.target_rate is None:
        thresholds = None if request.threshold is None else torch.full((n,), request.threshold, device=logits.device)
        to_llm, _ = policy.route(logits, hidden, logits.argmax(-1), thresholds)
        return ["llm" if x else "slm" for x in to_llm.tolist()]
    sources, scores, routed = [], [], 0
    for t in range(n):  # the threshold at each position follows the decisions before it
        threshold = rate.row_threshold(policy, request.threshold, request.target_rate, t, routed, scores)
        to_llm, score = policy.route(logits[t : t + 1], hidden[t : t + 1], logits[t : t + 1].argmax(-1),
                                     torch.tensor([threshold], device=logits.device))
        scores.append(float(score[0]))
        routed += bool(to_llm[0])
        sources.append("llm" if to_llm[0] else "slm")
    return sources
