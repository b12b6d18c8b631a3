"""core/verification.py on its own: when the LLM runs (the grouping rule and verification's reasons), what
becomes final, and what a rejection takes back from a row's record. The rules in action, on every backend, are
in test_verification_in_the_loop.py (verification in the decode loop) and test_defer.py (deferred routing)."""

import pytest
import torch

from roads_to_rome.core.llm_calls import Deferral, llm_due
from roads_to_rome.core.request import Checks, Generation, Request, Sequence
from roads_to_rome.core.sampling import SamplingParams, parse_verify
from roads_to_rome.core.verification import Rejection, RowRead, check_routed, first_rejection, settle, take_back
from roads_to_rome.errors import R2RError


def sequence(tokens: int, routed: list[int] = (), verify="off", max_unverified=None, max_new_tokens=100) -> Sequence:
    s = Sequence(Request([1, 2], SamplingParams(max_new_tokens=max_new_tokens)), verify=parse_verify(verify),
                 max_unverified=max_unverified, generation=Generation([1, 2]), checks=Checks(routed=list(routed)))
    s.generation.token_ids, s.generation.sources = list(range(tokens)), ["slm"] * tokens
    s.generation.scores = [0.0] * tokens
    return s


def test_the_grouping_rule():
    rule = Deferral("continue", group=0.5, steps=3)  # two of three rows
    never_ends = lambda i: False  # noqa: E731
    a, b, c = sequence(5), sequence(5), sequence(5)
    # a row routed now that may not wait calls the LLM; one that may, alone among three, does not
    assert llm_due([a, b, c], [True, False, False], [False] * 3, [1] * 3, never_ends, rule)
    assert not llm_due([a, b, c], [True, False, False], [True, False, False], [1] * 3, never_ends, rule)
    assert [rule.rows(n) for n in (1, 2, 3, 4, 8)] == [1, 1, 2, 2, 4]
    assert Deferral.of("park", steps=4) == Deferral("park", Deferral.group, 4)  # defaults where none is given
    # two rows waiting (one from before, one now) make a group
    a.checks.routed = [4]
    assert llm_due([a, b, c], [False, True, False], [False, True, False], [2] * 3, never_ends, rule)
    # a waiting position three steps old calls it alone; two steps old does not
    a.checks.routed = [2]
    assert llm_due([a, b, c], [False] * 3, [False] * 3, [4] * 3, never_ends, rule)
    a.checks.routed = [3]
    assert not llm_due([a, b, c], [False] * 3, [False] * 3, [4] * 3, never_ends, rule)
    # a waiting row that would end is checked first
    assert llm_due([a, b, c], [False] * 3, [False] * 3, [4] * 3, lambda i: i == 0, rule)
    assert not llm_due([a, b, c], [False] * 3, [False] * 3, [4] * 3, lambda i: i == 1, rule)
    # a batch of one: its routed row is a group of one, as without deferral
    assert llm_due([b], [True], [True], [1], never_ends, rule)
    # verification's own reasons
    v = sequence(5, verify="strict", max_unverified=3)
    assert llm_due([v, b], [False] * 2, [False] * 2, [3, 1], never_ends, rule)
    assert not llm_due([v, b], [False] * 2, [False] * 2, [2, 1], never_ends, rule)
    # without deferral nothing waits, and only routing or verification calls the LLM
    assert not llm_due([b, c], [False] * 2, [False] * 2, [4] * 2, never_ends, Deferral("off"))


def test_what_becomes_final_and_what_a_rejection_takes_back():
    s = sequence(6, routed=[3, 5])
    assert [t for t, _, _ in settle(s, finished=False)] == [0, 1, 2]  # up to the first waiting
    assert settle(s, finished=False) == []
    score = take_back(s, Rejection(index=3, token=99, routed=True))  # tokens 3, 4, 5 go
    assert s.generation.token_ids == [0, 1, 2] and s.checks.routed == [] and score == 0.0
    assert s.checks.checked == 4  # the LLM's token goes in at 3: everything up to it is checked
    g = s.generation
    assert (g.deferred_replaced, g.deferred_discarded, g.rollbacks, g.discarded) == (1, 4, 0, 0)
    take_back(s, Rejection(index=2, token=99, routed=False))
    assert (g.rollbacks, g.discarded) == (1, 2)
    v = sequence(4, verify=1.0)
    assert settle(v, finished=False) == [] and v.pending
    v.checks.through(1)  # a read that checked outputs 0 and 1 (overlap: a call that answered part of the row)
    assert [t for t, _, _ in settle(v, finished=False)] == [0, 1] and v.pending
    v.checks.through(3)
    assert [t for t, _, _ in settle(v, finished=False)] == [2, 3] and not v.pending


def test_a_read_checks_from_the_first_unchecked_token_and_merges_with_a_later_one():
    v = sequence(5, verify="strict")
    v.checks.checked = 2
    logits = torch.full((4, 8), -10.0)
    for k, token in enumerate([2, 3, 0, 5]):  # predicts outputs 2..5; output 4 is 4, the LLM says 0
        logits[k, token] = 0.0
    read = RowRead(logits, first=2, reach=5)
    assert first_rejection(v, read, last=5, proposal=5, park=False, full_logits=True)[:3] == (4, 0, False)
    assert first_rejection(v, read, last=3, proposal=5, park=False, full_logits=True) is None  # stops at `last`
    with pytest.raises(R2RError, match="cannot check output 2"):  # a read that starts too late is a bug, said
        first_rejection(v, RowRead(logits[1:], first=3, reach=5), last=5, proposal=5, park=False, full_logits=True)
    early, later = RowRead(logits[:2], 2, 3), RowRead(torch.zeros(3, 8), 3, 5)  # overlapping: the later wins
    merged = early.merged(later)
    assert (merged.first, merged.reach) == (2, 5) and torch.equal(merged.at(2), logits[0])
    assert torch.equal(merged.at(3), torch.zeros(8))
    with pytest.raises(R2RError, match="leave out"):
        early.merged(RowRead(torch.zeros(1, 8), 5, 5))


def test_a_deferred_routed_token_is_the_llms_choice():
    s, logits = sequence(3, routed=[1]), torch.tensor([0.0, 2.0, 1.0])
    assert check_routed(s, 1, logits, 1, park=False, full_logits=True) is None  # the SLM's token is the LLM's
    assert check_routed(s, 2, logits, 1, park=False, full_logits=True) == 1
    assert check_routed(s, 1, logits, 1, park=True, full_logits=True) == 1  # parked: replaced even when equal
