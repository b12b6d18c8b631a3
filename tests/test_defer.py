"""Deferred routing (--defer continue / park) on every backend: a routed row that waits for a grouped LLM call
ends with exactly the tokens immediate routing gives it (greedy: with and without verification, batched and
alone), strict verification still gives the LLM's own output, a deferred routed token under sampling follows the
LLM's distribution, and the LLM is called less often. The grouping rule and the per-row bookkeeping
(core/verification.py) are tested on their own in test_verification_rules.py."""

import pytest
import torch
from conftest import ENGINE_LOGIC_BACKENDS, kind_fixture
from helpers import assert_stream_shows_only_tokens_that_stay, llm_greedy_reference, make_checkpoint
from tiny import tiny_model, tiny_tokenizer

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.llm_calls import Deferral
from roads_to_rome.core.request import Request
from roads_to_rome.core.sampling import SamplingParams, sampling_probs
from roads_to_rome.errors import R2RError
from roads_to_rome.hardware import has_native_bf16
from roads_to_rome.routing.policies import EntropyPolicy, NeuralPolicy

kind = kind_fixture(ENGINE_LOGIC_BACKENDS)  # (conftest.ENGINE_LOGIC_BACKENDS: why not torch-static)

PROMPTS = ["What is 48 / 2?", "def add(a, b):", "Bonjour! Paris is the capital of which country? Explain.",
           "Natalia sold clips to 48 of her friends in April."]
N_TOKENS = 24


def row_policies(slm):
    """Policies whose decision for a row depends on that row's prefix only (a random policy's draws depend on the
    batch and the step, so its immediate and deferred runs route different tokens)."""
    return {"router": NeuralPolicy(make_checkpoint(slm), slm.embed, threshold=0.5), "entropy": EntropyPolicy(4.0)}


def outputs(gens):
    return [(g.token_ids, g.sources) for g in gens]


@pytest.mark.parametrize("mode", ["continue", "park"])
def test_deferred_routing_gives_every_row_the_tokens_of_immediate_routing(kind_pair, tokenizer, mode):
    slm, llm = kind_pair
    params = SamplingParams(max_new_tokens=N_TOKENS)
    deferred_total = replaced_total = 0
    calls = {"immediate": 0, "deferred": 0}  # LLM calls of the batched runs without verification
    for name, policy in row_policies(slm).items():
        for verify in ("off", 1.0, "strict"):
            immediate = Engine(slm, llm, tokenizer, policy, verify=verify)
            prompts = [immediate.prompts.chat(p) for p in PROMPTS]
            expected = outputs(immediate.generate(prompts, params))
            before = immediate.counters.llm_calls
            for rule in (Deferral(mode, group=0.75, steps=4), Deferral(mode, group=1.0, steps=50)):
                engine = Engine(slm, llm, tokenizer, policy, verify=verify, defer=rule)
                gens = engine.generate(prompts, params)
                assert outputs(gens) == expected, (name, verify, rule)
                if rule.steps == 4:  # rows alone: a batch of one calls whenever its row is routed, whatever the rule
                    assert outputs([engine.generate([p], params)[0] for p in prompts]) == expected, (name, verify)
                deferred_total += sum(g.deferred for g in gens)
                replaced_total += sum(g.deferred_replaced for g in gens)
                for g in gens:
                    assert g.deferred_replaced <= g.deferred and g.deferred_discarded >= g.deferred_replaced
                    if mode == "park" and verify == "off":  # a parked row takes back all it wrote while waiting
                        assert g.deferred_discarded >= g.deferred
            if verify == "off":
                calls["immediate"] += before
                calls["deferred"] += engine.counters.llm_calls
    assert deferred_total > 0 and replaced_total > 0
    assert calls["deferred"] < calls["immediate"]  # grouped: fewer LLM calls


def test_strict_verification_with_deferral_is_the_llms_greedy_output(kind_pair, tokenizer):
    slm, llm = kind_pair
    prompts, params, expected = llm_greedy_reference(llm, tokenizer, PROMPTS, N_TOKENS)
    for mode in ("continue", "park"):
        for n in (2, None):
            engine = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), verify="strict", max_unverified=n,
                            defer=Deferral(mode, group=0.75, steps=6))
            gens = engine.generate(prompts, params)
            assert [g.token_ids for g in gens] == expected, (mode, n)
            assert sum(g.deferred for g in gens) > 0


def test_a_stream_with_deferral_shows_only_tokens_that_stay(kind_pair, tokenizer):
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), defer=Deferral("continue", group=1.0, steps=8))
    results = assert_stream_shows_only_tokens_that_stay(engine, [engine.prompts.chat(p) for p in PROMPTS], N_TOKENS)
    assert sum(g.deferred_replaced for g in results) > 0


@pytest.mark.parametrize("mode, overlap", [("continue", False), ("park", False), ("continue", True)])
def test_a_deferred_routed_token_under_sampling_follows_the_llms_distribution(kind_pair, tokenizer, mode, overlap):
    """All rows but one of each batch are routed at every step (their request's threshold 0: entropy is never below
    it) and wait, as fewer than the grouping rule's rows (all) are waiting, until their second token ends them: the
    LLM then decides the first one, which must be drawn from its distribution, not the SLM's. The one other row is
    never routed. With overlap, the LLM's call runs beside the SLM's next step, and the rows wait for it standing
    still."""
    slm, llm = kind_pair
    rows = min(llm.max_rows or 400, 400)
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(1e9), defer=Deferral(mode, group=1.0, steps=100),
                    overlap=overlap)
    prompt = engine.prompts.chat("What is 48 / 2?")
    base = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=20, ignore_eos=True)
    target = sampling_probs(llm.forward_sequence(prompt)[0][-1:], base)[0]
    draft = sampling_probs(slm.forward_sequence(prompt)[0][-1:], base)[0]
    runs, counts, deferred, tested, seed = 2400, torch.zeros_like(target), 0, 0, 0
    while tested < runs:
        batch = min(rows, runs - tested + 1)
        requests = [Request(prompt, SamplingParams(**{**base.__dict__, "seed": seed + i}),
                            threshold=None if i == 0 else 0.0) for i in range(batch)]
        seed, tested = seed + batch, tested + batch - 1
        for request, gen in zip(requests, engine.run(requests)):
            if request.threshold is not None:
                counts[gen.token_ids[0]] += 1
                deferred += gen.deferred
                assert gen.sources == ["llm", "llm"]
    # every tested row's first token waited (with overlap its second too, and a token put back after a roll-back)
    assert deferred >= runs if overlap else deferred == runs
    empirical = counts / runs
    distance = lambda p, q: 0.5 * (p - q).abs().sum().item()  # noqa: E731
    assert distance(target, draft) > 0.3  # the two models really differ here
    assert distance(empirical, target) < 0.08, (distance(empirical, target), distance(empirical, draft))


def test_a_request_forcing_the_llm_is_never_deferred_and_bad_settings_are_refused(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(0.0), defer="continue")
    prompt = engine.prompts.chat("Hi")
    gens = engine.run([Request(prompt, SamplingParams(max_new_tokens=6), force="llm")] * 3)
    assert all(g.deferred == 0 and g.sources == ["llm"] * len(g.token_ids) for g in gens)
    with pytest.raises(R2RError, match="defer takes off, continue, park"):
        Engine(slm, llm, tokenizer, defer="later")
    with pytest.raises(R2RError, match="share of the batch's rows"):
        Deferral("continue", group=0)
    with pytest.raises(R2RError, match="waits at most"):
        Deferral("continue", steps=0)


def test_a_deferring_server_answers_concurrent_clients_as_a_lockstep_one_does(slm, llm, tokenizer):
    """Eight clients at once, streamed and whole: the same answers from a server that groups the LLM's calls as
    from one that routes in lockstep, with the deferral counted in each response's usage."""
    import concurrent.futures

    import httpx
    import openai

    from roads_to_rome.serving.background import BackgroundServer
    from roads_to_rome.serving.limits import Limits
    from roads_to_rome.serving.server import create_app

    questions = [f"{q} ({i})" for i, q in enumerate(PROMPTS * 2)]
    answers, deferred = {}, 0
    for mode in ("off", "continue"):
        engine = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), defer=Deferral(mode, group=0.5, steps=8))
        with BackgroundServer(create_app(engine, "tiny", Limits(max_batch=8, max_tokens=64))) as server:
            assert httpx.get(server.url + "/v1/models").json()["data"][0]["r2r"]["defer"] == mode
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

            def ask(question, stream):
                kw = dict(model="tiny", messages=[{"role": "user", "content": question}], temperature=0,
                          max_tokens=40)
                if stream:
                    chunks = list(client.chat.completions.create(stream=True, **kw))
                    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), 0
                out = client.chat.completions.create(**kw)
                assert out.usage.model_extra["llm_calls"] >= 1 or out.usage.model_extra["llm_tokens"] == 0
                return out.choices[0].message.content, out.usage.model_extra["deferred_tokens"]

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                for stream in (False, True):
                    got = list(pool.map(lambda q: ask(q, stream), questions))
                    answers[mode, stream] = [text for text, _ in got]
                    deferred += sum(n for _, n in got) if mode == "continue" else 0
    assert answers["continue", False] == answers["off", False] == answers["continue", True] == answers["off", True]
    assert deferred > 0


def test_auto_groups_where_the_llms_grouped_reads_are_cheap(slm, llm):
    from types import SimpleNamespace

    from roads_to_rome.core.llm_calls import resolve_defer

    cheap, dear = SimpleNamespace(grouped_reads=True), SimpleNamespace(grouped_reads=False)
    assert resolve_defer("auto", cheap) == "continue"
    assert resolve_defer("auto", dear) == "off" and resolve_defer("auto", None) == "off"
    assert resolve_defer("park", dear) == "park"
    assert not llm.grouped_reads  # the tiny models: torch in float32 on a CPU
    bf16 = TorchBackend(tiny_model(tiny_tokenizer(), hidden=32, seed=0).to(torch.bfloat16))
    assert bf16.grouped_reads == has_native_bf16()
