"""Any pair, not one architecture: the engine's exactness on tiny Qwen3 and Llama pairs (Qwen2's runs through every
other suite), on each backend (torch, its static cache, llama.cpp through the project's GGUF writer). Strict
verification gives the LLM's own greedy output whatever the SLM proposes, batched or alone, with the LLM's calls in
the step or beside it, and rows that join a running batch decode as if alone."""

import pytest
from conftest import make_backend
from helpers import PROMPTS, llm_greedy_reference, run_with_joins
from tiny import tiny_model

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.routing.policies import EntropyPolicy, RandomPolicy

N_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family_pair(request, kind, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"{request.param}-{kind}")
    return tuple(make_backend(kind, tiny_model(tokenizer, hidden=hidden, seed=seed, family=request.param), tokenizer,
                              folder, role)
                 for role, hidden, seed in (("slm", 32, 0), ("llm", 64, 1)))


@pytest.mark.parametrize("overlap", [False, True])
def test_strict_verification_is_the_llms_greedy_output(family_pair, tokenizer, overlap):
    slm, llm = family_pair
    prompts, params, expected = llm_greedy_reference(llm, tokenizer, PROMPTS, N_TOKENS)
    fixes = 0
    for policy in (RandomPolicy(0.3, seed=0), EntropyPolicy(1.0)):
        engine = Engine(slm, llm, tokenizer, policy, verify="strict", max_unverified=3, overlap=overlap)
        batched = engine.generate(prompts, params)
        assert [g.token_ids for g in batched] == expected, policy.name
        assert [engine.generate([p], params)[0].token_ids for p in prompts] == expected, policy.name
        fixes += sum(g.rollbacks for g in batched)
    assert fixes > 0  # the SLM wrote tokens the LLM rejected: the check was not idle


def test_rows_joining_a_running_batch_decode_as_if_alone(family_pair, tokenizer):
    slm, llm = family_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0), verify="strict")
    prompts = [engine.prompts.chat(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=N_TOKENS)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    joined = run_with_joins(engine, prompts, join_after=[2, 5], params=params)
    assert [s.generation.token_ids for s in joined] == alone
