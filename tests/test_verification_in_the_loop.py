"""Verification on catch-up, on both backends: strict under greedy is the LLM's own greedy output whatever
the policy and the catch-up interval; strict under sampling follows the LLM's distribution; off is plain R2R."""

import pytest
import torch
from conftest import ENGINE_LOGIC_BACKENDS, kind_fixture
from helpers import assert_stream_shows_only_tokens_that_stay, llm_greedy_reference, make_checkpoint, run_with_joins

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.grammar import OutputFormat
from roads_to_rome.core.sampling import SamplingParams, apply_penalties, parse_verify, sampling_probs
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, EntropyPolicy, NeuralPolicy, RandomPolicy

kind = kind_fixture(ENGINE_LOGIC_BACKENDS)  # (conftest.ENGINE_LOGIC_BACKENDS: why not torch-static)

PROMPTS = ["What is 48 / 2?", "def add(a, b):", "Bonjour! Paris is the capital of which country? Explain."]
N_TOKENS = 24


def policies(slm):
    return {"router": NeuralPolicy(make_checkpoint(slm), slm.embed, threshold=0.5), "entropy": EntropyPolicy(3.0),
            "random 0.1": RandomPolicy(0.1, seed=0), "random 0.5": RandomPolicy(0.5, seed=1), "slm": AlwaysSLM(),
            "llm": AlwaysLLM()}


def test_strict_under_greedy_is_the_llms_greedy_output_for_every_policy_and_interval(kind_pair, tokenizer):
    slm, llm = kind_pair
    prompts, params, expected = llm_greedy_reference(llm, tokenizer, PROMPTS, N_TOKENS)
    assert [Engine.alone(llm, tokenizer).generate([p], params)[0].token_ids for p in prompts] == expected
    fixes = 0
    for name, policy in policies(slm).items():
        for n in (1, 2, 5, None):
            engine = Engine(slm, llm, tokenizer, policy, verify="strict", max_unverified=n)
            batched = engine.generate(prompts, params)
            assert [g.token_ids for g in batched] == expected, (name, n)
            assert [engine.generate([p], params)[0].token_ids for p in prompts] == expected, (name, n)
            for g in batched:
                assert g.llm_tokens == g.sources.count("llm") + g.sources.count("fix")
                assert g.rollbacks == g.sources.count("fix") and g.discarded >= g.rollbacks
            fixes += sum(g.rollbacks for g in batched)
    assert fixes > 0  # the SLM did write tokens the LLM rejected


def test_off_is_plain_r2r_and_a_huge_tolerance_rejects_nothing(kind_pair, tokenizer):
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=2))
    prompts = [engine.prompts.chat(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=N_TOKENS)
    plain = engine.generate(prompts, params)
    for verify, n in (("off", None), ("off", 2), (1e9, None), (1e9, 3)):
        engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=2), verify=verify, max_unverified=n)
        gens = engine.generate(prompts, params)
        assert [(g.token_ids, g.sources) for g in gens] == [(g.token_ids, g.sources) for g in plain], (verify, n)
        assert all(g.rollbacks == 0 for g in gens)


def test_a_tolerance_keeps_only_tokens_the_llm_finds_nearly_as_likely(kind_pair, tokenizer):
    """Every token in a tolerance-verified output was either routed, put in by a fix, or within T nats of
    the LLM's own choice given what precedes it."""
    slm, llm = kind_pair
    tolerance = 1.0
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.1, seed=0), verify=tolerance, max_unverified=4)
    prompts = [engine.prompts.chat(p) for p in PROMPTS]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=N_TOKENS))
    assert sum(g.rollbacks for g in gens) > 0
    for prompt, gen in zip(prompts, gens):
        logits, _ = llm.forward_sequence(prompt + gen.token_ids[:-1], start=len(prompt) - 1)
        logp = torch.log_softmax(logits.float(), -1)
        for i, (token, source) in enumerate(zip(gen.token_ids, gen.sources)):
            if source == "slm":
                assert logp[i, token] >= logp[i].max() - tolerance - 1e-3, i
            else:
                assert token == int(logp[i].argmax()), i


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_requests_joining_a_verifying_batch_get_the_llms_output(kind_pair, tokenizer, prefill_chunk):
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.2, seed=3), verify="strict", max_unverified=3)
    alone = Engine.alone(llm, tokenizer)
    prompts = [engine.prompts.chat(p) for p in PROMPTS] + [engine.prompts.raw("Hi")]
    params = SamplingParams(max_new_tokens=16)
    requests = run_with_joins(engine, prompts, join_after=[2, 5, 9], params=params, prefill_chunk=prefill_chunk)
    for prompt, r in zip(prompts, requests):
        assert r.generation.token_ids == alone.generate([prompt], params)[0].token_ids


def test_stream_shows_only_final_tokens_and_ends_with_all_of_them(kind_pair, tokenizer):
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, AlwaysSLM(), verify="strict", max_unverified=4)
    assert_stream_shows_only_tokens_that_stay(engine, [engine.prompts.chat(p) for p in PROMPTS], N_TOKENS)


def test_strict_under_sampling_follows_the_llms_distribution(kind_pair, tokenizer):
    """Many seeds on one prefix: the first token's frequencies match the LLM's sampling distribution, not the
    SLM's (every token is verified at once: max_unverified 1)."""
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, AlwaysSLM(), verify="strict", max_unverified=1)
    prompt = engine.prompts.chat("What is 48 / 2?")
    base = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=20)
    target = sampling_probs(llm.forward_sequence(prompt)[0][-1:], base)[0]
    draft = sampling_probs(slm.forward_sequence(prompt)[0][-1:], base)[0]
    empirical = first_token_frequencies(engine, prompt, base, llm.max_rows or 500, len(target))
    assert distance(target, draft) > 0.3  # the two models really differ here
    assert distance(empirical, target) < 0.08, (distance(empirical, target), distance(empirical, draft))


def test_strict_under_sampling_with_penalties_follows_the_llms_penalised_distribution(slm, llm, tokenizer):
    """The same with a repetition penalty, which the first token already feels through the prompt's tokens: the
    ratio test compares the two models' penalised distributions."""
    engine = Engine(slm, llm, tokenizer, AlwaysSLM(), verify="strict", max_unverified=1)
    prompt = engine.prompts.chat("What is 48 / 2?")
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=20, repetition_penalty=3.0)
    logits = llm.forward_sequence(prompt)[0][-1]
    target = sampling_probs(apply_penalties(logits, params, prompt, [])[None], params)[0]
    plain = sampling_probs(logits[None], params)[0]
    empirical = first_token_frequencies(engine, prompt, params, 500, len(target))
    pushed_out = (target == 0) & (plain > 0)  # the prompt's tokens that the penalty drops out of the top 20
    assert plain[pushed_out].sum() > 0.1 and empirical[pushed_out].sum() == 0
    assert distance(empirical, target) < 0.08, (distance(empirical, target), distance(empirical, plain))


def first_token_frequencies(engine, prompt, params, rows, vocab, runs=3000):
    """How often each of `vocab` tokens comes first, over `runs` seeds (`rows` requests at a time)."""
    from roads_to_rome.core.request import Request

    counts = torch.zeros(vocab)
    for start in range(0, runs, rows):
        gens = engine.run([Request(prompt, SamplingParams(**{**params.__dict__, "seed": seed}))
                           for seed in range(start, min(start + rows, runs))])
        for gen in gens:
            counts[gen.token_ids[0]] += 1
    return counts / runs


def distance(p, q):
    """Total variation distance between two distributions."""
    return 0.5 * (p - q).abs().sum().item()


@pytest.mark.parametrize("value", ["sometimes", "-1", "nan", "inf", None])
def test_bad_verify_values_are_refused(value):
    with pytest.raises(R2RError, match="verify takes off, strict or a tolerance"):
        parse_verify(value)


def test_bad_intervals_and_a_missing_llm_are_refused(slm, llm, tokenizer):
    with pytest.raises(R2RError, match="at least 1"):
        Engine(slm, llm, tokenizer, verify="strict", max_unverified=0)
    with pytest.raises(R2RError, match="needs both models"):
        Engine(slm, None, tokenizer, verify="strict").generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert parse_verify("strict").strict and parse_verify("0.5").tolerance == 0.5 and parse_verify(2).value == 2.0
    assert not parse_verify("off").on and parse_verify(parse_verify("1")) == parse_verify(1.0)


def test_a_bound_on_unverified_tokens_where_nothing_is_verified_is_refused_not_ignored(slm, llm, tokenizer):
    from pathlib import Path

    from roads_to_rome import EngineConfig, load_engine
    from roads_to_rome.core.request import Request
    from roads_to_rome.eval.evaluate import EvalConfig

    for make in (lambda: load_engine(EngineConfig(verify="off", max_unverified=4)),
                 lambda: load_engine(EngineConfig(policy="slm", max_unverified=4)),  # one model: unverified
                 lambda: EvalConfig("gsm8k", ("r2r",), Path("runs"), max_unverified=4)):
        with pytest.raises(R2RError, match="nothing is checked"):  # before any model loads
            make()
    EvalConfig("gsm8k", ("r2r",), Path("runs"), verify=("off", "strict"), max_unverified=4)  # the verified ones
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0), verify=1.0)
    with pytest.raises(R2RError, match="this request is not verified"):
        engine.sequence(Request([1, 2], verify=parse_verify("off"), max_unverified=3))
    with pytest.raises(R2RError, match="this request is not verified"):  # forced onto one model: unverified
        engine.sequence(Request([1, 2], force="slm", max_unverified=3))
    assert engine.sequence(Request([1, 2], max_unverified=3)).max_unverified == 3


PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.4}


def logit_rules(alone, prompts) -> SamplingParams:
    """A logit bias that bans each prompt's first greedy token and favours another, every other token of the
    vocabulary alone allowed, and a stop token the output may not end on before its 4th token, taken from where it
    would have ended it earlier (so that each of them changes the output)."""
    plain = [g.token_ids for g in alone.generate(prompts, SamplingParams(max_new_tokens=N_TOKENS))]
    bias = {out[0]: -100.0 for out in plain} | {plain[1][3]: 4.0}
    allowed = tuple(t for t in range(alone.llm.vocab_size) if t % 2 == 0 or t in bias)
    biased = alone.generate(prompts, SamplingParams(max_new_tokens=N_TOKENS, logit_bias=bias,
                                                    allowed_token_ids=allowed))
    stop = biased[0].token_ids[1]
    return SamplingParams(max_new_tokens=N_TOKENS, logit_bias=bias, allowed_token_ids=allowed, stop_token_ids=(stop,),
                          min_tokens=4)


# A format that leaves the models much to choose (a free string), so that they disagree and verification rolls back.
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.mark.parametrize("settings", ["penalties", "logit rules", "structured output"])
def test_with_penalties_or_logit_rules_strict_is_the_llms_own_output_and_deferral_changes_nothing(kind_pair, tokenizer,
                                                                                                   settings):
    """Penalties, a logit bias, allowed tokens, ending tokens held back until `min_tokens` and a structured output
    apply to the logits a token is chosen from, whichever model writes it and whenever the LLM checks it (the
    format's walk rolls back with the output): strict verification is still the LLM's own greedy output under them,
    and a deferred routed token ends as immediate routing writes it."""
    from roads_to_rome.core.llm_calls import Deferral

    slm, llm = kind_pair
    alone = Engine.alone(llm, tokenizer)
    prompts = [alone.prompts.chat(p) for p in PROMPTS]
    if settings == "structured output":
        params = SamplingParams(max_new_tokens=N_TOKENS, output_format=OutputFormat.json_schema(ANSWER_SCHEMA,
                                                                                           any_whitespace=False))
    else:
        params = SamplingParams(max_new_tokens=N_TOKENS, **PENALTIES) if settings == "penalties" else \
            logit_rules(alone, prompts)
    expected = [g.token_ids for g in alone.generate(prompts, params)]
    assert expected != [g.token_ids for g in alone.generate(prompts, SamplingParams(max_new_tokens=N_TOKENS))]
    if settings == "logit rules":
        for out in expected:
            assert all(t % 2 == 0 or t in dict(params.logit_bias) for t in out)
            assert params.stop_token_ids[0] not in out[:4] and params.stop_token_ids[0] not in out[4:-1]
    if settings == "structured output":
        assert all(tokenizer.decode(out).lstrip().startswith('{"answer"') for out in expected)
    assert [alone.generate([p], params)[0].token_ids for p in prompts] == expected
    for defer in ("off", Deferral("continue", group=1.0, steps=4), Deferral("park", group=1.0, steps=4)):
        for overlap in (False, True):
            engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=4), verify="strict", max_unverified=3,
                            defer=defer, overlap=overlap)
            gens = engine.generate(prompts, params)
            assert [g.token_ids for g in gens] == expected, (defer, overlap)
            assert sum(g.rollbacks for g in gens) > 0
    policy = EntropyPolicy(3.0)  # a row's routing depends on its own prefix only
    immediate = Engine(slm, llm, tokenizer, policy).generate(prompts, params)
    deferred = Engine(slm, llm, tokenizer, policy, defer=Deferral("continue", group=1.0, steps=4)).generate(
        prompts, params)
    assert [(g.token_ids, g.sources) for g in deferred] == [(g.token_ids, g.sources) for g in immediate]


def test_penalised_greedy_decoding_matches_a_hand_computed_reference(llm, tokenizer):
    """The LLM alone with penalties: each token is the argmax of its logits after the repetition penalty
    (transformers' own processor) and the presence and frequency penalties counted by hand, and with the repetition
    penalty alone the output is transformers' `generate`."""
    from transformers import RepetitionPenaltyLogitsProcessor

    alone = Engine.alone(llm, tokenizer)
    prompt = alone.prompts.chat(PROMPTS[2])
    out = alone.generate([prompt], SamplingParams(max_new_tokens=N_TOKENS, **PENALTIES))[0].token_ids
    logits, _ = llm.forward_sequence(prompt + out[:-1], start=len(prompt) - 1)
    repetition = RepetitionPenaltyLogitsProcessor(PENALTIES["repetition_penalty"])
    for i, token in enumerate(out):
        row = repetition(torch.tensor([prompt + out[:i]]), logits[i : i + 1].float().clone())[0]
        for t in set(out[:i]):
            row[t] -= PENALTIES["frequency_penalty"] * out[:i].count(t) + PENALTIES["presence_penalty"]
        assert token == int(row.argmax()), i
    params = SamplingParams(max_new_tokens=N_TOKENS, repetition_penalty=1.4, ignore_eos=True)
    ours = alone.generate([prompt], params)[0].token_ids
    theirs = llm.model.generate(torch.tensor([prompt]), max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS,
                                do_sample=False, repetition_penalty=1.4, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
