"""Verification's acceptance rules as pure functions of tensors."""

import pytest
import torch

from roads_to_rome.core.sampling import (
    LogitRules,
    SamplingParams,
    adjust_logits,
    apply_penalties,
    sampling_probs,
    speculative_residual,
    top_p_cut,
    within_tolerance,
)
from roads_to_rome.errors import R2RError


def test_the_tolerance_rule_keeps_tokens_within_that_many_nats_of_the_best():
    logits = torch.tensor([0.0, 2.0, 1.0, -5.0])
    assert within_tolerance(logits, 1, 1, 0.0)  # the best token itself
    assert within_tolerance(logits, 2, 1, 1.0) and not within_tolerance(logits, 2, 1, 0.99)
    assert not within_tolerance(logits, 3, 1, 6.99) and within_tolerance(logits, 3, 1, 7.0)


def test_the_tolerance_rule_is_the_log_probability_gap():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(50, generator=generator) * 3
        token = int(torch.randint(50, (), generator=generator))
        tolerance = float(torch.rand((), generator=generator) * 4)
        best = int(logits.argmax())
        logp = torch.log_softmax(logits.double(), -1)
        gap = float(logp[best] - logp[token])
        if abs(gap - tolerance) > 1e-5:  # away from the boundary, where rounding could tip it either way
            assert within_tolerance(logits, token, best, tolerance) == (gap <= tolerance)


def test_speculative_acceptance_is_min_one_p_over_q():
    target = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draft = torch.tensor([0.25, 0.6, 0.1, 0.05])
    for token in range(4):
        ratio = float(target[token] / draft[token])
        if ratio >= 1:  # kept whatever the draw
            assert speculative_residual(target, draft, token, torch.tensor(0.999)) is None
        else:
            below = torch.tensor(max(ratio - 1e-3, 0.0))
            assert speculative_residual(target, draft, token, below) is None or ratio == 0
            assert speculative_residual(target, draft, token, torch.tensor(ratio + 1e-3)) is not None


def test_speculative_sampling_outputs_the_target_distribution():
    """P(out = x) = q(x) min(1, p(x)/q(x)) + P(reject) r(x) must be p(x), r the residual the rule returns."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        target = torch.rand(8, generator=generator, dtype=torch.float64).softmax(0)
        draft = (torch.rand(8, generator=generator, dtype=torch.float64) * 3).softmax(0)
        accepted = draft * torch.minimum(torch.ones_like(target), target / draft)
        rejected_token = int((target / draft).argmin())  # a token that is rejected for a draw near 1
        residual = speculative_residual(target, draft, rejected_token, torch.tensor(0.9999, dtype=torch.float64))
        assert residual is not None
        assert torch.allclose(accepted + (1 - accepted.sum()) * residual, target)


def test_speculative_residual_falls_back_to_the_target_when_it_is_empty():
    """Defensive: where rounding leaves no mass in max(0, p - q), the replacement comes from p itself."""
    target, draft = torch.tensor([0.2, 0.2]), torch.tensor([0.5, 0.5])
    residual = speculative_residual(target, draft, 0, torch.tensor(0.9))  # 0.9 * 0.5 > 0.2: rejected
    assert torch.equal(residual, torch.tensor([0.5, 0.5]))


def test_a_vanishing_temperature_is_greedy_not_nan():
    """Found by the API fuzzer: temperature 3.3e-168 made every probability NaN and failed the batch."""
    from roads_to_rome.core.sampling import SamplingParams, sample

    logits = torch.tensor([[0.5, 3.0, -1.0], [2.0, 1.0, 0.0]])
    for temperature in (3.282510075910062e-168, 5e-324, 1e-6):
        params = SamplingParams(temperature=temperature)
        assert params.temperature == 0.0
        assert sample(logits, params, torch.Generator().manual_seed(0)).tolist() == [1, 0]
    assert SamplingParams(temperature=1e-3).temperature == 1e-3


def test_a_vanishing_top_p_keeps_the_best_token():
    """Found by the API fuzzer: top_p 5e-324 is 0 in float32, which dropped every token."""
    from roads_to_rome.core.sampling import SamplingParams, sampling_probs

    logits = torch.tensor([[0.5, 3.0, -1.0]])
    for top_p in (5e-324, 1e-30):
        assert sampling_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)).tolist() == [[0.0, 1.0, 0.0]]


def test_the_repetition_penalty_is_transformers_own():
    from transformers import RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=generator) * 3
    prompt, output = [3, 7, 7, 12], [12, 30, 5]
    for penalty in (1.3, 0.7):
        ours = apply_penalties(logits, SamplingParams(repetition_penalty=penalty), prompt, output)
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[None].clone())[0]
        torch.testing.assert_close(ours, theirs)
        assert torch.equal(ours[[0, 1, 2]], logits[[0, 1, 2]])  # tokens never seen are left alone


def test_presence_and_frequency_penalties_count_the_outputs_tokens_only():
    logits = torch.zeros(10)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, prompt_ids=[1, 2, 9], output_ids=[4, 4, 4, 6])
    expected = torch.zeros(10)
    expected[4], expected[6] = -(0.5 + 3 * 0.25), -(0.5 + 0.25)
    torch.testing.assert_close(out, expected)  # the prompt's 1, 2 and 9 are not penalised
    # Negative values favour tokens already there; the order: repetition first, then the subtractions (vLLM's).
    both = apply_penalties(torch.full((10,), 2.0), SamplingParams(repetition_penalty=2.0, frequency_penalty=-1.0),
                           [1], [4, 4])
    assert float(both[1]) == 1.0 and float(both[4]) == 1.0 + 2.0 and float(both[0]) == 2.0


def test_no_penalty_leaves_the_logits_untouched_and_bad_ones_are_refused():
    logits = torch.randn(10)
    assert apply_penalties(logits, SamplingParams(), [1, 2], [3]) is logits
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                {"repetition_penalty": 5e-324}, {"repetition_penalty": 101.0}, {"presence_penalty": float("nan")}):
        with pytest.raises(R2RError, match="penalty"):
            SamplingParams(**bad).validate()


def test_min_p_is_transformers_own_and_comes_after_the_temperature():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 2
    for min_p, temperature in ((0.1, 1.0), (0.3, 0.7), (0.05, 1.5)):
        ours = sampling_probs(logits, SamplingParams(temperature=temperature, min_p=min_p))
        warped = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
        torch.testing.assert_close(ours, warped.softmax(-1))
        assert 0 < int((ours[0] > 0).sum()) < 50  # it did drop some, not all


def test_logit_bias_then_allowed_tokens_then_ending_tokens_held_back_then_penalties():
    """vLLM's order: the bias before the repetition penalty divides what it left (so a biased token's sign decides
    how the penalty acts), tokens outside the allowed ones and tokens that would end the output too early at -inf."""
    logits = torch.full((10,), 1.0)
    params = SamplingParams(max_new_tokens=8, logit_bias={2: -3.0, 5: 2.0}, repetition_penalty=2.0, min_tokens=2)
    rules = LogitRules.of(params, prompt_ids=[2, 5], ending_ids=[9])
    early = adjust_logits(logits, rules, output_ids=[1])
    assert float(early[2]) == -4.0 and float(early[5]) == 1.5 and float(early[1]) == 0.5 and float(early[0]) == 1.0
    assert early[9] == float("-inf")  # the output holds 1 token of at least 2: nothing may end it yet
    late = adjust_logits(logits, rules, output_ids=[1, 1])
    assert float(late[9]) == 1.0 and torch.equal(late[:9], early[:9])
    allowed = adjust_logits(logits, LogitRules.of(SamplingParams(allowed_token_ids=(3, 4), logit_bias={3: 1.0}),
                                                  [0]), [])
    assert allowed.tolist() == [float("-inf")] * 3 + [2.0, 1.0] + [float("-inf")] * 5
    assert adjust_logits(logits, LogitRules.of(SamplingParams(min_p=0.2), [1]), [1]) is logits  # min-p is later


def test_a_bad_words_last_token_is_banned_where_the_output_ends_with_the_rest_of_it():
    """vLLM's bad_words: a one-token word never comes; a longer word's last token not after the rest of it."""
    logits = torch.zeros(10)
    rules = LogitRules.of(SamplingParams(bad_words=((4,), (1, 2, 3), (7, 8))), [0])
    banned = lambda output: [t for t, v in enumerate(adjust_logits(logits, rules, output).tolist())  # noqa: E731
                             if v == float("-inf")]
    assert banned([]) == [4] and banned([1]) == [4] and banned([1, 2]) == [3, 4] and banned([5, 1, 2]) == [3, 4]
    assert banned([2]) == [4] and banned([7]) == [4, 8] and banned([7, 9]) == [4]
    assert SamplingParams(bad_words=((3,),)).adjusted and not SamplingParams(bad_words=((3,),)).reshapes


@pytest.mark.parametrize("bad,match", [({"min_p": 1.5}, "min-p"), ({"logit_bias": {3: 101.0}}, "logit bias"),
                                       ({"logit_bias": {-1: 1.0}}, "token -1: token ids"),
                                       ({"allowed_token_ids": ()}, "at least one token"),
                                       ({"stop_token_ids": (-2,)}, "token ids are >= 0"),
                                       ({"min_tokens": 9, "max_new_tokens": 8}, "min tokens"),
                                       ({"min_tokens": -1}, "min tokens"),
                                       ({"bad_words": ((1,), ())}, "at least one token"),
                                       ({"bad_words": ((1, -3),)}, "token ids are >= 0")])
def test_bad_sampling_settings_are_refused_saying_what_to_fix(bad, match):
    with pytest.raises(R2RError, match=match):
        SamplingParams(**bad).validate()
    with pytest.raises(R2RError, match="names token 10, beyond the vocabulary: ids are 0 to 9"):
        SamplingParams(stop_token_ids=(3, 10)).check_vocabulary(10)


@pytest.mark.parametrize("scale", [40.0, 4.0, 0.01])  # a nucleus of a few tokens, of hundreds, of most of the row
def test_top_p_ranking_only_the_likeliest_tokens_is_sorting_whole_rows(scale):
    """Top-p ranks a row's likeliest tokens only, more of them when they do not hold top_p, the whole row as a last
    resort: the same tokens kept as sorting every row, on rows of every kind, alone and batched together."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5000, generator=generator) * scale
    for top_p in (0.5, 0.9, 0.999):
        # (the row's softmax sorted, not the sorted row's softmax: that sums in another order, and a processor's
        # vector width then moves a token lying at the nucleus's edge across it)
        probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[:, 0] = False
        expected = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(drop, float("-inf")))
        assert torch.equal(top_p_cut(logits, top_p), expected)
        assert torch.equal(top_p_cut(logits[:1], top_p), expected[:1])
    mixed = torch.cat([logits[:1], torch.randn(1, 5000, generator=generator) * 40])
    assert torch.equal(top_p_cut(mixed, 0.9)[1:], top_p_cut(mixed[1:], 0.9))
