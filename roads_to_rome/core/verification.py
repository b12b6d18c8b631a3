"""What the LLM still has to check in each row, the rules it checks by, and what a rejection takes back.

Two kinds of token wait for the LLM's word:

- *unverified* tokens: a row that verifies (`--verify strict` or a tolerance) writes the SLM's tokens at once and
  the LLM checks each at its next catch-up (`check_token`: the tolerance rule, or speculative sampling's test);
- *deferred routed* tokens: with `--defer continue` or `park` a routed row does not force an LLM call in the step
  that routes it. It keeps the SLM's token for now and the position waits in `Checks.routed`; the LLM decides it at
  its next call, grouped with the other rows' (`llm_due` says when). At a routed position the LLM's own token is
  what immediate routing would have written, so `check_routed` keeps the SLM's token only where it is that token
  (under sampling: where speculative sampling's test keeps it, so the token still follows the LLM's distribution);
  `park` takes back every waiting position, as if the row had taken no token while it waited.

Where a check fails the row goes back to that position with the LLM's token in it (`Batch._roll_back` moves the
tensors and caches; `take_back` the row's own record). Under greedy decoding either way gives every row exactly
the tokens immediate routing gives it.

`Batch` (engine.py) holds the tensors and caches and calls into this module: `llm_due` before a step's catch-up,
`first_rejection` for each row after it, `take_back` for each rejected row, `settle` when the step's token is in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from roads_to_rome.core.sampling import sample, sampling_probs, speculative_residual, within_tolerance
from roads_to_rome.errors import R2RError

DEFER_MODES = ("off", "continue", "park")
# What the commands and the server defer with when routing: continue where the LLM runs on CUDA, whose call costs
# nearly the same for many rows as for one; off on a CPU, whose call costs grow with the tokens it reads, so that
# grouping saves little and the tokens a replaced one throws away cost more (docs/benchmarks.md, "Under load").
DEFAULT_DEFER = "auto"


def resolve_defer(mode: str, llm) -> str:
    """A deferral mode, `auto` made concrete for this LLM backend (None: no LLM): grouped where its reads of several
    rows cost little more than one (`Backend.grouped_reads`), else lockstep."""
    if mode != "auto":
        return mode
    return "continue" if llm is not None and llm.grouped_reads else "off"


@dataclass(frozen=True)
class Deferral:
    """When a routed row's LLM token may wait for a grouped LLM call (`mode` off: it never waits).

    The LLM runs at the first step where `group` of the batch's rows wait (rounded up: a batch of one therefore
    runs it whenever its row is routed, as without deferral), where a waiting position is `steps` steps old, or
    where a row must be checked (it would finish, or verification's max_unverified is reached). The defaults are
    the schedule simulator's best on measured GPU step costs, batch 4 to 32 (docs/benchmarks.md)."""

    mode: str = "off"
    group: float = 0.6
    steps: int = 16

    def __post_init__(self):
        if self.mode not in DEFER_MODES:
            raise R2RError(f"defer takes {', '.join(DEFER_MODES)}, got {self.mode!r}")
        if not 0 < self.group <= 1:
            raise R2RError(f"the deferral group is a share of the batch's rows in (0, 1], got {self.group}")
        if self.steps < 1:
            raise R2RError(f"a routed token waits at most 1 step or more, got {self.steps}")

    @classmethod
    def of(cls, mode: str, group: float | None = None, steps: int | None = None) -> Deferral:
        """A rule with this mode, and the default settings where none is given."""
        return cls(mode, cls.group if group is None else group, cls.steps if steps is None else steps)

    def rows(self, batch: int) -> int:
        """How many of a batch's rows must wait before the LLM runs."""
        return max(1, math.ceil(self.group * batch - 1e-9))

    @property
    def on(self) -> bool:
        return self.mode != "off"


@dataclass
class Checks:
    """One row's outstanding checks (indices are positions in the row's output)."""

    final: int = 0  # tokens that can no longer change
    routed: list[int] = field(default_factory=list)  # deferred routed positions, oldest first
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # the SLM's distribution a sampled token
    # was drawn from (strict verification and deferred routing under sampling: the ratio test needs it)

    def clear(self) -> None:
        """The LLM has read every token: nothing is outstanding."""
        self.routed.clear()
        self.draft_probs.clear()


class Rejection(NamedTuple):
    """A row's first rejected token."""

    column: int  # where it is
    token: int  # the LLM's token in its place
    routed: bool  # whether it was a deferred routed position (else an unverified token)


def waits(s) -> bool:
    """Whether any of the row's written tokens await the LLM."""
    return s.verify != "off" or bool(s.checks.routed)


def llm_due(sequences: list, routed: list[bool], deferred: list[bool], unread: list[int],
            ends: Callable[[int], bool], deferral: Deferral) -> bool:
    """Whether the LLM runs this step. `routed`: rows the policy (or a request) gives the LLM now; `deferred`: those
    of them whose token may wait; `unread[i]`: row i's generated tokens the LLM has not read, this step's
    included; `ends(i)`: whether row i's output would end with this step's token."""
    if any(r and not d for r, d in zip(routed, deferred)):
        return True
    waiting = [bool(s.checks.routed) or d for s, d in zip(sequences, deferred)]
    for i, s in enumerate(sequences):
        if s.verify != "off" and s.max_unverified is not None and unread[i] >= s.max_unverified:
            return True
        if (s.verify != "off" or waiting[i]) and ends(i):  # a row is returned only once all of it is checked
            return True
    if not any(waiting):
        return False
    if sum(waiting) >= deferral.rows(len(sequences)):
        return True
    oldest = max((len(s.generation.token_ids) - s.checks.routed[0] for s in sequences if s.checks.routed), default=0)
    return oldest >= deferral.steps


def first_rejection(s, logits: torch.Tensor, logits_from: int, column: int, proposal: int, routed_now: bool,
                    read_from: int, park: bool, full_logits: bool) -> Rejection | None:
    """Check a row's tokens the LLM had not read (columns after `read_from`, up to this step's `column`) in order
    against its logits (`logits[k]`: at column logits_from + k, predicting the next column): verifying rows every
    such token, other rows their deferred routed positions only. The first rejected one, or None."""
    gen, routed = s.generation, set(s.checks.routed)
    first_generated = column - len(gen.token_ids)  # the row's generated tokens fill columns first_generated..
    last = column - 1 if routed_now else column  # a token routed now is the LLM's own: nothing to check
    for c in range(max(read_from + 1, first_generated), last + 1):
        index = c - first_generated  # the token's index in the output
        if index not in routed and s.verify == "off":
            continue
        token = gen.token_ids[index] if c < column else proposal
        at = logits[c - 1 - logits_from]
        replacement = (check_routed(s, token, at, index, park, full_logits) if index in routed
                       else check_token(s, token, at, index))
        if replacement is not None:
            return Rejection(c, replacement, index in routed)
        if index in routed:
            gen.deferred_kept += 1
    return None


def check_token(s, token: int, logits: torch.Tensor, index: int) -> int | None:
    """Verification's rule for one token against the LLM's next-token logits: None when it is kept, else the
    LLM's token in its place."""
    params = s.params
    if s.verify == "strict" and params.temperature > 0:  # speculative sampling: the output follows the LLM
        return _speculative(s, token, logits, index)
    best = int(logits.argmax())
    kept = token == best if s.verify == "strict" else within_tolerance(logits, token, best, s.verify)
    if kept:
        return None
    return best if params.temperature == 0 else int(sample(logits[None], s.params, s.generator)[0])


def check_routed(s, token: int, logits: torch.Tensor, index: int, park: bool, full_logits: bool) -> int | None:
    """A deferred routed position: the token the LLM writes there, or None when the SLM's token is that token.
    Parking keeps nothing. Under sampling, speculative sampling's test where the LLM's whole distribution is known,
    else the LLM draws and the SLM's token stays only where the draw is the same; both follow the LLM."""
    params = s.params
    if params.temperature == 0:
        best = int(logits.argmax())
        return best if park or token != best else None
    if full_logits and not park and index in s.checks.draft_probs:
        return _speculative(s, token, logits, index)
    drawn = int(sample(logits[None], params, s.generator)[0])
    return drawn if park or drawn != token else None


def _speculative(s, token: int, logits: torch.Tensor, index: int) -> int | None:
    target = sampling_probs(logits[None], s.params)[0]
    draw = torch.rand((), generator=s.generator, device=target.device)
    residual = speculative_residual(target, s.checks.draft_probs[index], token, draw)
    return None if residual is None else int(torch.multinomial(residual, 1, generator=s.generator))


def take_back(s, dropped: int, rejection: Rejection) -> float | None:
    """The row's record after a rejection: the `dropped` tokens from the rejected one on leave its output (the
    LLM's token goes in their place as this step's token). Returns the policy's score at the rejected position
    (None when the rejected token is this step's own)."""
    gen, checks = s.generation, s.checks
    keep = len(gen.token_ids) - dropped
    score = gen.scores[keep] if dropped else None
    del gen.token_ids[keep:], gen.sources[keep:], gen.scores[keep:]
    for index in [k for k in checks.draft_probs if k >= keep]:
        del checks.draft_probs[index]
    checks.routed = [k for k in checks.routed if k < keep]
    if rejection.routed:
        gen.deferred_replaced += 1
        gen.deferred_discarded += dropped + 1  # this step's own token was written too
    else:
        gen.rollbacks += 1
        gen.discarded += dropped + 1
    return score


def defer(s, index: int, logits: torch.Tensor | None) -> None:
    """Row s's token at `index` was routed and waits for the LLM's next call (it keeps the SLM's token for now)."""
    s.checks.routed.append(index)
    s.generation.deferred += 1
    if s.params.temperature > 0 and logits is not None and index not in s.checks.draft_probs:
        s.checks.draft_probs[index] = sampling_probs(logits[None], s.params)[0]


def settle(s, llm_ran: bool, finished: bool) -> list[tuple[int, str, float]]:
    """After a step's token is in: the (token, source, score) of the row's tokens that became final, in order.
    Everything is final once the LLM has read it (or the row is done, which the LLM checks first); until then a
    verifying row's tokens wait, and a row with deferred routed positions shows what precedes the first."""
    gen, checks = s.generation, s.checks
    if llm_ran or finished:
        checks.clear()
        newly_final = len(gen.token_ids)
    elif s.verify != "off":
        newly_final = checks.final
    else:
        newly_final = checks.routed[0] if checks.routed else len(gen.token_ids)
    final = list(zip(gen.token_ids[checks.final : newly_final], gen.sources[checks.final : newly_final],
                     gen.scores[checks.final : newly_final]))
    checks.final = newly_final
    return final


def logits_needed(s, unread: int) -> int:
    """How many of the LLM's last logits a catch-up must return to check row s: one per unread token if it
    verifies, else from its first waiting routed position on; one (the next token's) when nothing waits."""
    if s.verify != "off":
        return unread
    routed = s.checks.routed
    return len(s.generation.token_ids) - routed[0] + 1 if routed else 1


def unread_tokens(s, column: int, read_from: int) -> int:
    """Row s's generated tokens the LLM has not read, this step's (at `column`) included."""
    return min(column - read_from, len(s.generation.token_ids) + 1)
