"""What the LLM still has to check in each row, the rules it checks by, and what a rejection takes back.

Two kinds of token wait for the LLM's word:

- *unverified* tokens: a row that verifies (`--verify strict` or a tolerance) writes the SLM's tokens at once and
  the LLM checks each at its next catch-up (`check_token`: the tolerance rule, or speculative sampling's test);
- *deferred routed* tokens: with `--defer continue` or `park` a routed row does not force an LLM call in the step
  that routes it. It keeps the SLM's token for now and the position waits in `Checks.routed` (request.py); the LLM
  decides it at its next call, grouped with the other rows' (`llm_calls.llm_due` says when; with --overlap that call
  runs beside the SLM's next steps, and every routed row goes on this way). At a routed position the LLM's own token
  is what immediate routing would have written, so `check_routed` keeps the SLM's token only where it is that token
  (under sampling: where speculative sampling's test keeps it, so the token still follows the LLM's distribution);
  `park` takes back every waiting position, as if the row had taken no token while it waited.

Where a check fails the row goes back to that position with the LLM's token in it (`Batch._roll_back` moves the
tensors and caches; `take_back` the row's own record). Under greedy decoding either way gives every row exactly
the tokens immediate routing gives it.

Positions are indices in a row's output, not columns of the batch: a row's columns move (roll-backs, a row that
stands still while the LLM checks its end), its indices do not. `Batch` (batch.py; its tensors and caches:
layout.py) calls into this module: `first_rejection` for each row a catch-up read (`RowRead`), `take_back` for each
rejected row, `settle` when the step's token is in.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from roads_to_rome.core.request import Sequence
from roads_to_rome.core.sampling import sample, sampling_probs, speculative_residual, within_tolerance
from roads_to_rome.errors import R2RError


class Rejection(NamedTuple):
    """A row's first rejected token."""

    index: int  # where it is in the row's output
    token: int  # the LLM's token in its place
    routed: bool  # whether it was a deferred routed position (else an unverified token)
    logits: torch.Tensor | None = None  # the LLM's logits there, that `token` came from


class RowRead(NamedTuple):
    """The LLM's logits over one row's tokens from one catch-up: `logits[k]` predicts output index `first + k`; the
    last predicts `reach`, the furthest token this read can check."""

    logits: torch.Tensor  # [n, V]
    first: int
    reach: int

    def at(self, index: int) -> torch.Tensor:
        return self.logits[index - self.first]

    def merged(self, later: RowRead) -> RowRead:
        """This read followed by a later one of the same row (a call that was in flight, and the columns read since
        it was sent): where both predict a token, the later's logits."""
        if later.first > self.reach + 1:
            raise R2RError(f"internal: two LLM reads leave out outputs {self.reach + 1}..{later.first - 1}")
        head = self.logits[: max(0, later.first - self.first)]
        return RowRead(torch.cat([head, later.logits]), min(self.first, later.first), later.reach)


def first_rejection(s: Sequence, read: RowRead, last: int, proposal: int, park: bool,
                    full_logits: bool) -> Rejection | None:
    """Check a row's tokens the LLM has not had its word on yet, up to output index `last` (this step's token,
    `proposal`, when `last` is its index), in order against `read`: a verifying row every such token, other rows
    their deferred routed positions only. The first rejected one, or None."""
    gen, routed = s.generation, set(s.checks.routed)
    start = s.checks.checked
    if s.verify.on and start < read.first and start <= last:
        raise R2RError(f"internal: an LLM read from output {read.first} cannot check output {start}")
    for index in range(max(start, read.first), last + 1):
        if index not in routed and not s.verify.on:
            continue
        token = gen.token_ids[index] if index < len(gen.token_ids) else proposal
        at = read.at(index)
        replacement = (check_routed(s, token, at, index, park, full_logits) if index in routed
                       else check_token(s, token, at, index))
        if replacement is not None:
            return Rejection(index, replacement, index in routed, at)
        if index in routed:
            gen.deferred_kept += 1
    return None


def check_token(s: Sequence, token: int, logits: torch.Tensor, index: int) -> int | None:
    """Verification's rule for one token against the LLM's next-token logits: None when it is kept, else the
    LLM's token in its place."""
    params, logits = s.params, s.logits_at(logits, index)
    if s.verify.strict and params.temperature > 0:  # speculative sampling: the output follows the LLM
        return _speculative(s, token, logits, index)
    best = int(logits.argmax())
    kept = token == best if s.verify.strict else within_tolerance(logits, token, best, s.verify.tolerance)
    if kept:
        return None
    return best if params.temperature == 0 else int(sample(logits[None], s.params, s.generator)[0])


def check_routed(s: Sequence, token: int, logits: torch.Tensor, index: int, park: bool,
                 full_logits: bool) -> int | None:
    """A deferred routed position: the token the LLM writes there, or None when the SLM's token is that token.
    Parking keeps nothing. Under sampling, speculative sampling's test where the LLM's whole distribution is known,
    else the LLM draws and the SLM's token stays only where the draw is the same; both follow the LLM."""
    params, logits = s.params, s.logits_at(logits, index)
    if params.temperature == 0:
        best = int(logits.argmax())
        return best if park or token != best else None
    if full_logits and not park and index in s.checks.draft_probs:
        return _speculative(s, token, logits, index)
    drawn = int(sample(logits[None], params, s.generator)[0])
    return drawn if park or drawn != token else None


def _speculative(s: Sequence, token: int, logits: torch.Tensor, index: int) -> int | None:
    target = sampling_probs(logits[None], s.params)[0]
    draw = torch.rand((), generator=s.generator, device=target.device)
    residual = speculative_residual(target, s.checks.draft_probs[index], token, draw)
    return None if residual is None else int(torch.multinomial(residual, 1, generator=s.generator))


def take_back(s: Sequence, rejection: Rejection) -> float | None:
    """The row's record after a rejection: its tokens from the rejected one on leave its output (the LLM's token
    goes in their place as this step's token, and every token before it is checked). Returns the policy's score at
    the rejected position (None when the rejected token is this step's own)."""
    gen, checks = s.generation, s.checks
    keep = rejection.index
    dropped = len(gen.token_ids) - keep
    score = gen.scores[keep] if dropped else None
    del gen.token_ids[keep:], gen.sources[keep:], gen.scores[keep:]
    if gen.logprobs is not None:
        del gen.logprobs[keep:]
    for index in [k for k in checks.draft_probs if k >= keep]:
        del checks.draft_probs[index]
    checks.routed = [k for k in checks.routed if k < keep]
    checks.through(keep)  # the LLM's own token goes in there
    checks.ends = None
    if rejection.routed:
        gen.deferred_replaced += 1
        gen.deferred_discarded += dropped + 1  # this step's own token was written too
    else:
        gen.rollbacks += 1
        gen.discarded += dropped + 1
    return score


def forget_unchecked(s: Sequence) -> None:
    """The row's tokens that still await the LLM's word leave its output, as if never written: a preempted row
    resumes from its final tokens (those shown) and writes the rest again (under greedy decoding, the same)."""
    gen, checks = s.generation, s.checks
    keep = checks.final
    del gen.token_ids[keep:], gen.sources[keep:], gen.scores[keep:]
    if gen.logprobs is not None:
        del gen.logprobs[keep:]
    gen.deferred -= len(checks.routed)  # (counted again when written again)
    checks.draft_probs = {k: p for k, p in checks.draft_probs.items() if k < keep}
    checks.routed, checks.ends, checks.checked = [], None, min(checks.checked, keep)


def defer(s: Sequence, index: int, logits: torch.Tensor | None) -> None:
    """Row s's token at `index` was routed and waits for the LLM's next call (it keeps the SLM's token for now)."""
    s.checks.routed.append(index)
    s.generation.deferred += 1
    if s.params.temperature > 0 and logits is not None and index not in s.checks.draft_probs:
        s.checks.draft_probs[index] = sampling_probs(s.logits_at(logits, index)[None], s.params)[0]


def settle(s: Sequence, finished: bool) -> list[tuple[int, str, float]]:
    """After a step's token is in: the (token, source, score) of the row's tokens that became final, in order.
    A token is final once the LLM has had its word on it (or the row is done, which the LLM checks first); until
    then a verifying row's tokens wait, and a row with deferred routed positions shows what precedes the first."""
    gen, checks = s.generation, s.checks
    if finished:
        newly_final = len(gen.token_ids)
    elif s.verify.on:
        newly_final = min(checks.checked, len(gen.token_ids))
    else:
        newly_final = checks.routed[0] if checks.routed else len(gen.token_ids)
    newly_final = max(newly_final, checks.final)
    final = list(zip(gen.token_ids[checks.final : newly_final], gen.sources[checks.final : newly_final],
                     gen.scores[checks.final : newly_final]))
    checks.final = newly_final
    return final


def logits_needed(s: Sequence, reach: int) -> int:
    """How many of the LLM's last logits a catch-up whose last logits predict output `reach` must return to check
    row s: one per token from its first unchecked one if it verifies, else from its first waiting routed position
    on; one (the next token's) when nothing waits."""
    if s.verify.on:
        first = s.checks.checked
    else:
        first = s.checks.routed[0] if s.checks.routed else reach
    return max(1, reach - first + 1)


def unread_tokens(s: Sequence, column: int, read_from: int) -> int:
    """Row s's generated tokens the LLM has not read (or been asked to), this step's (at `column`) included."""
    return min(column - read_from, len(s.generation.token_ids) + 1)
