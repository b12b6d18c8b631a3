import itertools
import json

import pytest
import torch
from helpers import make_checkpoint

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, EntropyPolicy, NeuralPolicy, RandomPolicy, entropy
from roads_to_rome.routing.router import Router, RouterConfig, load_router, save_router, slm_identity


def test_entropy_policy_routes_uncertain_tokens():
    peaked = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    flat = torch.zeros(1, 4)
    assert entropy(flat).item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    policy = EntropyPolicy(threshold=1.0)
    to_llm, scores = policy.route(torch.cat([peaked, flat]), None, torch.tensor([0, 0]))
    assert to_llm.tolist() == [False, True]
    assert scores[0] < 0.01
    with pytest.raises(R2RError):
        EntropyPolicy(-1)


def test_random_policy_hits_its_rate():
    policy = RandomPolicy(0.2, seed=0)
    to_llm, _ = policy.route(None, None, torch.zeros(20000, dtype=torch.long))
    assert to_llm.float().mean().item() == pytest.approx(0.2, abs=0.01)
    with pytest.raises(R2RError):
        RandomPolicy(1.5)




def test_each_policy_takes_thresholds_in_its_own_range_and_the_engine_checks_a_requests(slm, llm, tokenizer):
    from roads_to_rome.core.request import Request

    router = NeuralPolicy(make_checkpoint(slm), slm.embed)
    ranges = [(router, [0.0, 0.5, 1.0], [-0.1, 1.5, float("nan")]),
              (EntropyPolicy(1.0), [0.0, 3.0, 1e9], [-1.0, float("inf"), float("nan")]),
              (RandomPolicy(0.2), [0.0, 1.0], [-0.5, 2.0, float("nan")]),
              (AlwaysSLM(), [], [0.5]), (AlwaysLLM(), [], [0.5])]
    prompt = tokenizer.encode("hi")
    for policy, taken, refused in ranges:
        engine = Engine(slm, llm, tokenizer, policy)
        for value in taken:
            assert policy.check_threshold(value) == value
            engine.sequence(Request(prompt, threshold=value))
        for value in refused:
            with pytest.raises(R2RError, match="threshold"):
                policy.check_threshold(value)
            with pytest.raises(R2RError, match="threshold"):
                engine.sequence(Request(prompt, threshold=value))
    with pytest.raises(R2RError, match="LLM rate"):  # and so is a rate they cannot aim at
        Engine(slm, llm, tokenizer, AlwaysLLM()).sequence(Request(prompt, target_rate=0.2))
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.2))
    for force, dial in itertools.product(("slm", "llm"), ({"threshold": 0.5}, {"target_rate": 0.2})):
        with pytest.raises(R2RError, match=f"every token to the {force.upper()}, and a threshold or LLM rate"):
            engine.sequence(Request(prompt, force=force, **dial))  # a forced row would read neither


def test_router_save_load_round_trips_bit_exactly(slm, tmp_path):
    ckpt = make_checkpoint(slm, threshold=0.37)
    save_router(tmp_path / "r", ckpt)
    saved = json.loads((tmp_path / "r" / "router.json").read_text())
    assert saved["slm"]["embedding_hash"] == ckpt.slm["embedding_hash"]
    loaded = load_router(tmp_path / "r", ckpt.slm)
    assert loaded.threshold == 0.37
    for (name, a), (_, b) in zip(ckpt.router.state_dict().items(), loaded.router.state_dict().items()):
        assert torch.equal(a, b), name
    # No embedding table in the file: it comes from the SLM at load time.
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "r" / "router.safetensors"))
    assert sum(t.numel() for t in stored.values()) == sum(p.numel() for p in ckpt.router.parameters())


def test_router_refuses_another_slm(slm, llm, tmp_path):
    save_router(tmp_path / "r", make_checkpoint(slm))
    other = slm_identity(llm)
    with pytest.raises(R2RError, match="trained for SLM"):
        load_router(tmp_path / "r", other)


def test_router_checkpoint_errors(tmp_path):
    with pytest.raises(R2RError, match="not a router checkpoint"):
        load_router(tmp_path)
    (tmp_path / "router.json").write_text("{}")
    (tmp_path / "router.safetensors").write_bytes(b"junk")
    with pytest.raises(R2RError, match="damaged"):
        load_router(tmp_path)


def test_neural_policy_runs_in_the_engine(slm, llm, tokenizer):
    ckpt = make_checkpoint(slm)
    policy = NeuralPolicy(ckpt, slm.embed, threshold=0.5)
    assert policy.num_params == sum(p.numel() for p in ckpt.router.parameters())
    engine = Engine(slm, llm, tokenizer, policy)
    gen = engine.generate([engine.prompts.chat("What is 48 / 2?")], SamplingParams(max_new_tokens=10))[0]
    assert all(0.0 <= s <= 1.0 for s in gen.scores)
    assert [s >= 0.5 for s in gen.scores] == [src == "llm" for src in gen.sources]
    slm_b, router_b, _ = gen.params_b
    assert router_b == pytest.approx(policy.num_params / 1e9)


def test_router_inputs_ablation_configs(slm):
    for inputs in (("hidden",), ("hidden", "token"), ("hidden", "token", "logits")):
        router = Router(RouterConfig(hidden_size=slm.hidden_size, embed_size=slm.hidden_size, inputs=inputs, top_k=8))
        out = router(torch.randn(3, slm.hidden_size), torch.randn(3, slm.hidden_size), torch.randn(3, 50))
        assert out.shape == (3,)
    with pytest.raises(R2RError):
        RouterConfig(hidden_size=4, embed_size=4, inputs=("colour",))
