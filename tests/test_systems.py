"""Systems by name (models/systems.py) and the one target-rate controller (routing/rate.py)."""

import pytest
import torch
from helpers import make_checkpoint

from roads_to_rome.errors import R2RError
from roads_to_rome.models.systems import ENTROPY_WARMUP_THRESHOLD, System, routed
from roads_to_rome.routing import rate
from roads_to_rome.routing.policies import AlwaysSLM, EntropyPolicy, RandomPolicy
from roads_to_rome.routing.router import save_router


def test_each_system_is_the_engine_its_name_says(slm, llm, tokenizer, tmp_path):
    alone = System("slm", "slm").engine(slm, None, tokenizer)
    assert (alone.slm, alone.llm, alone.routes) == (slm, None, False)
    assert System("llm", "llm").engine(slm, llm, tokenizer).writer is llm  # the LLM alone: no idle SLM beside it
    spec = System("spec+k=4", "spec", 4).engine(slm, llm, tokenizer)
    assert isinstance(spec.policy, AlwaysSLM) and (spec.verify.value, spec.max_unverified) == ("strict", 4)
    entropy = System("entropy", "entropy", 0.15)
    engine = entropy.engine(slm, llm, tokenizer)
    assert isinstance(engine.policy, EntropyPolicy) and engine.policy.threshold == ENTROPY_WARMUP_THRESHOLD
    assert entropy.target_rate == 0.15 and System("random", "random", 0.15).target_rate is None
    draws = System("random", "random", 0.2).engine(slm, llm, tokenizer).policy
    assert isinstance(draws, RandomPolicy) and draws.rate == draws.threshold == 0.2
    with pytest.raises(R2RError, match="needs a trained router"):
        System("r2r", "r2r").engine(slm, llm, tokenizer)
    save_router(tmp_path / "router", make_checkpoint(slm, threshold=0.4))
    r2r = System("r2r", "r2r", 0.3).with_verify(1.0, 4)
    assert r2r.name == "r2r+verify=1+n=4"
    engine = r2r.engine(slm, llm, tokenizer, tmp_path / "router")
    assert engine.policy.threshold == 0.3 and (engine.verify.value, engine.max_unverified) == (1.0, 4)
    assert System("r2r", "r2r").with_verify("off", 4) == System("r2r", "r2r")
    with pytest.raises(R2RError, match="unknown system"):
        System("both", "both")


def test_a_routing_policy_by_name_or_made(slm, llm, tokenizer):
    engine = routed(slm, llm, tokenizer, "entropy", 0.5, verify="strict", max_unverified=3, defer="continue")
    assert engine.policy.threshold == 0.5 and (engine.verify.value, engine.max_unverified) == ("strict", 3)
    assert engine.deferral.mode == "continue"
    policy = RandomPolicy(0.1, seed=0)
    assert routed(slm, llm, tokenizer, policy).policy is policy
    assert not routed(slm, None, tokenizer, "slm").routes  # the SLM alone: no LLM loaded


def test_the_threshold_at_a_rate_routes_exactly_that_share():
    scores = torch.tensor([0.9, 0.8, 0.7, 0.1, 0.2, 0.3])
    for share, routed_count in ((0.5, 3), (1 / 6, 1), (1.0, 6), (0.0, 0)):
        assert int((scores >= rate.threshold_at_rate(scores, share)).sum()) == routed_count


def test_a_request_aims_off_by_what_it_owes_the_llm():
    entropy, draws = EntropyPolicy(0.8), RandomPolicy(0.1)
    scores = [i / 100 for i in range(100)]
    assert rate.row_threshold(entropy, None, None, 50, 5, scores) == 0.8  # no rate: the policy's own
    assert rate.row_threshold(entropy, 0.3, None, 50, 5, scores) == 0.3  # the request's own
    few = scores[: rate.WARMUP_TOKENS - 1]
    assert rate.row_threshold(entropy, None, 0.2, len(few), 0, few) == 0.8  # too few scores: the fixed one
    # On target (10 of 50 at 0.2): the top 20% of the last WINDOW_TOKENS scores.
    on_target = rate.row_threshold(entropy, None, 0.2, 50, 10, scores)
    assert on_target == rate.threshold_at_rate(torch.tensor(scores[-rate.WINDOW_TOKENS:]), 0.2)
    behind = rate.row_threshold(entropy, None, 0.2, 50, 2, scores)  # owes 8 tokens: routes more
    ahead = rate.row_threshold(entropy, None, 0.2, 50, 18, scores)  # 8 ahead: routes fewer
    assert behind < on_target < ahead
    # Random draws: the threshold is the rate itself, aimed the same way, from the first token on.
    assert rate.row_threshold(draws, None, 0.2, 0, 0, []) == 0.2
    assert rate.row_threshold(draws, None, 0.2, 50, 2, []) == pytest.approx(0.2 + 8 / rate.CATCH_UP_TOKENS)
    assert rate.row_threshold(draws, None, 0.2, 50, 40, []) == 0.0
