"""The decode loop on tiny models: exactness against transformers' generate, routing, sampling, stopping."""

import dataclasses

import pytest
import torch
from helpers import encode, run_with_joins

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.layout import left_pad
from roads_to_rome.core.sampling import SamplingParams, sample
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, RandomPolicy


def hf_greedy(backend, engine, prompt_ids, n):
    """transformers' own greedy generation for the same (left-padded) batch, cut after EOS."""
    ids, mask = left_pad(prompt_ids, engine.pad_id, "cpu")
    out = backend.model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=engine.pad_id
    )
    rows = []
    for row in out[:, ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in engine.eos_ids), len(row))
        rows.append(row[:cut])
    return rows


@pytest.mark.parametrize("policy, role", [(AlwaysSLM(), "slm"), (AlwaysLLM(), "llm")])
def test_always_one_model_equals_its_own_greedy_generation(slm, llm, tokenizer, policy, role):
    engine = Engine(slm, llm, tokenizer, policy)
    prompts = encode(engine)
    reference_model = slm if role == "slm" else llm
    params = SamplingParams(max_new_tokens=40)
    for p in prompts:  # unbatched
        gen = engine.generate([p], params)[0]
        assert gen.token_ids == hf_greedy(reference_model, engine, [p], 40)[0]
        assert gen.sources == [role] * len(gen.token_ids)
    batched = engine.generate(prompts, params)  # batched, prompts of different lengths
    assert [g.token_ids for g in batched] == hf_greedy(reference_model, engine, prompts, 40)


def test_rows_that_finish_early_leave_the_batch_without_changing_the_others(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, AlwaysLLM())
    prompts = encode(engine)
    full = engine.generate(prompts, SamplingParams(max_new_tokens=30))
    # Make a token that the first row produces early an end-of-sequence token.
    engine.eos_ids = engine.eos_ids | {full[0].token_ids[3]}
    cut = engine.generate(prompts, SamplingParams(max_new_tokens=30))
    assert cut[0].finish_reason == "stop"
    assert cut[0].token_ids == full[0].token_ids[: full[0].token_ids.index(full[0].token_ids[3]) + 1]
    for before, after in zip(full[1:], cut[1:]):
        n = len(after.token_ids)
        assert after.token_ids == before.token_ids[:n]
        assert after.finish_reason == "stop" or n == 30


@torch.inference_mode()
def full_forward_argmax(backend, ids):
    """Next-token argmax from a forward over the whole sequence, no cache: the ground truth."""
    return backend.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item()


def test_mixed_routing_gives_each_token_to_the_model_that_was_asked(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=1))
    prompts = encode(engine)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=25))
    assert sum(g.llm_tokens for g in gens) > 0 and sum(len(g.token_ids) - g.llm_tokens for g in gens) > 0
    for prompt, gen in zip(prompts, gens):
        for i, (token, source) in enumerate(zip(gen.token_ids, gen.sources)):
            model = llm if source == "llm" else slm
            assert token == full_forward_argmax(model, prompt + gen.token_ids[:i]), (i, source)


def test_provenance_and_stats(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.5, seed=0))
    gen = engine.generate(encode(engine)[:1], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert len(gen.token_ids) == len(gen.sources) == len(gen.scores) == 20
    assert gen.llm_tokens == gen.sources.count("llm")
    assert gen.llm_rate == pytest.approx(gen.llm_tokens / len(gen.token_ids))
    expected = (slm.num_params + gen.llm_rate * llm.num_params) / 1e9
    assert gen.avg_params_b == pytest.approx(expected)
    assert gen.tokens_per_s > 0 and gen.timings.slm_s > 0 and gen.timings.llm_s > 0
    d = gen.to_dict()
    assert (d["text"], d["token_ids"], d["sources"]) == (gen.text, gen.token_ids, gen.sources)
    assert (d["llm_rate"], d["avg_params_b"], d["tokens_per_s"]) == (gen.llm_rate, gen.avg_params_b, gen.tokens_per_s)
    assert d["tokens"] == 20 and d["llm_tokens"] == gen.llm_tokens
    # The random policy's score is its draw; a draw under the rate routes the token.
    assert [s < 0.5 for s in gen.scores] == [src == "llm" for src in gen.sources]


def test_sampling_is_reproducible_with_a_seed_and_varies_without(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    prompts = encode(engine)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a = [g.token_ids for g in engine.generate(prompts, params)]
    engine.policy = RandomPolicy(0.3, seed=0)
    b = [g.token_ids for g in engine.generate(prompts, params)]
    assert a == b
    params = dataclasses.replace(params, seed=8)
    engine.policy = RandomPolicy(0.3, seed=0)
    c = [g.token_ids for g in engine.generate(prompts, params)]
    assert a != c


def test_sampling_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    assert all(sample(logits, SamplingParams(temperature=1.0, top_k=1), gen).item() == 1 for _ in range(20))
    # top-p: the best token alone holds 0.64 of the mass, so top_p=0.5 keeps only it.
    assert all(sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen).item() == 1 for _ in range(20))
    # top_k=2 never draws outside the two best.
    draws = {sample(logits, SamplingParams(temperature=5.0, top_k=2), gen).item() for _ in range(200)}
    assert draws == {1, 3}
    assert sample(logits, SamplingParams(), gen).item() == 1


def test_stop_strings_and_max_new_tokens(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, AlwaysSLM())
    prompt = encode(engine)[:1]
    full = engine.generate(prompt, SamplingParams(max_new_tokens=30))[0]
    assert len(full.token_ids) <= 30
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a non-blank stop string from the middle of the text"
    cut = engine.generate(prompt, SamplingParams(max_new_tokens=30, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_min_tokens_stop_tokens_and_include_stop_str_in_output(slm, llm, tokenizer):
    """vLLM's rules: a stop string counts once it ends beyond the first `min_tokens` tokens' text; a stop token ends
    the output and its text is left out; `include_stop_str_in_output` keeps either."""
    engine = Engine(slm, llm, tokenizer, AlwaysSLM())
    prompt = encode(engine)[:1]
    full = engine.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    ids, text = full.token_ids, full.text

    def token_at(char: int) -> int:  # the output index of the token that writes character `char`
        return next(k for k in range(len(ids)) if len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) > char)

    # A character written by two different tokens: the first ends the output, unless min_tokens reaches past it.
    stop, first, second = next((c, i, j) for i, c in enumerate(text) for j in range(i + 1, len(text))
                               if text[j] == c and c.isalnum() and token_at(j) > token_at(i))
    cut = engine.generate(prompt, SamplingParams(max_new_tokens=40, stop=(stop,)))[0]
    assert cut.text == text[:first] and len(cut.token_ids) == token_at(first) + 1 and cut.finish_reason == "stop"
    kept = engine.generate(prompt, SamplingParams(max_new_tokens=40, stop=(stop,), include_stop_str_in_output=True))[0]
    assert kept.text == text[: first + 1] and kept.token_ids == cut.token_ids
    later = engine.generate(prompt, SamplingParams(max_new_tokens=40, stop=(stop,), min_tokens=token_at(first) + 1))[0]
    assert later.text == text[:second] and len(later.token_ids) == token_at(second) + 1
    # A stop token: the output ends on it, without its text; before min_tokens it is never written.
    token = ids[3]
    ends = engine.generate(prompt, SamplingParams(max_new_tokens=40, stop_token_ids=(token,)))[0]
    at = ids.index(token)
    assert ends.token_ids == ids[: at + 1] and ends.finish_reason == "stop"
    assert ends.text == tokenizer.decode(ids[:at], skip_special_tokens=True)
    with_it = engine.generate(prompt, SamplingParams(max_new_tokens=40, stop_token_ids=(token,),
                                                     include_stop_str_in_output=True))[0]
    assert with_it.text == tokenizer.decode(ids[: at + 1], skip_special_tokens=True)
    held = engine.generate(prompt, SamplingParams(max_new_tokens=40, stop_token_ids=(token,), min_tokens=at + 2))[0]
    assert token not in held.token_ids[: at + 2] and held.token_ids[: at] == ids[:at]
    assert held.finish_reason == "length" or held.token_ids[-1] in engine.eos_ids | {token}
    # The models' own end-of-sequence tokens are held back too, unless the request ignores them.
    engine.eos_ids = {ids[1]}
    assert len(engine.generate(prompt, SamplingParams(max_new_tokens=12))[0].token_ids) == 2
    assert ids[1] not in engine.generate(prompt, SamplingParams(max_new_tokens=12, min_tokens=6))[0].token_ids[:6]


def test_ignore_eos_runs_to_max_new_tokens(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, AlwaysSLM())
    prompt = encode(engine)[:1]
    engine.eos_ids = {engine.generate(prompt, SamplingParams(max_new_tokens=5))[0].token_ids[1]}
    assert len(engine.generate(prompt, SamplingParams(max_new_tokens=12))[0].token_ids) == 2
    assert len(engine.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids) == 12


def test_stream_yields_every_token_once(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    prompts = encode(engine)
    results = []
    seen = {i: [] for i in range(len(prompts))}
    for steps in engine.stream(prompts, SamplingParams(max_new_tokens=15), results):
        for s in steps:
            seen[s.sequence.index].append((s.token_id, s.source))
    for i, gen in enumerate(results):
        assert seen[i] == list(zip(gen.token_ids, gen.sources))


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(max_new_tokens=0), "max new tokens"),
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top-p"),
        (SamplingParams(top_k=-1), "top-k"),
        (SamplingParams(stop=("",)), "stop"),
    ],
)
def test_bad_sampling_params_are_refused(slm, tokenizer, params, message):
    engine = Engine(slm, None, tokenizer)
    with pytest.raises(R2RError, match=message):
        engine.generate([[1, 2, 3]], params)


def test_empty_prompt_and_missing_llm_are_refused(slm, tokenizer):
    with pytest.raises(R2RError, match="at least one token"):
        Engine(slm, None, tokenizer).generate([[]], SamplingParams())
    with pytest.raises(R2RError, match="no LLM"):
        Engine(slm, None, tokenizer, AlwaysLLM()).generate([[1, 2]], SamplingParams())




@pytest.mark.parametrize("prefill_chunk", [None, 1, 7])
def test_requests_joining_a_running_batch_decode_as_if_alone(slm, llm, tokenizer, prefill_chunk):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=3))
    short, long_ = engine.prompts.raw("Hi"), engine.prompts.chat("Bonjour! Paris is the capital of which country?" * 3)
    prompts = [engine.prompts.chat("What is 48 / 2?"), short, long_, engine.prompts.chat("def add(a, b):")]
    # A shorter newcomer (padded to the batch), a longer one (the batch is padded to it), one late; with
    # chunked prefill, read a token or 7 per step while the batch decodes.
    sequences = run_with_joins(engine, prompts, join_after=[3, 5, 9], params=SamplingParams(max_new_tokens=16),
                               prefill_chunk=prefill_chunk)
    assert sum(s.generation.llm_tokens for s in sequences) > 0
    for prompt, s in zip(prompts, sequences):
        gen = s.generation
        assert len(gen.token_ids) > 0
        for i, (token, source) in enumerate(zip(gen.token_ids, gen.sources)):
            model = llm if source == "llm" else slm
            assert token == full_forward_argmax(model, prompt + gen.token_ids[:i]), (i, source)


def test_cancelled_request_leaves_and_others_continue(slm, llm, tokenizer):
    from roads_to_rome.core.batch import Batch
    from roads_to_rome.core.request import Request

    engine = Engine(slm, llm, tokenizer, AlwaysLLM())
    prompts = encode(engine)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = engine.generate(prompts, params)
    batch = Batch(engine.context)
    sequences = [engine.sequence(Request(p, params)) for p in prompts]
    batch.add(sequences)
    for _ in range(4):
        batch.step()
    sequences[1].cancelled = True
    while batch.sequences:
        batch.step()
    assert len(sequences[1].generation.token_ids) == 4
    for i in (0, 2):
        assert sequences[i].generation.token_ids == alone[i].token_ids


def test_per_request_forced_model_and_threshold(slm, llm, tokenizer):
    from roads_to_rome.core.request import Request
    from roads_to_rome.routing.policies import EntropyPolicy

    engine = Engine(slm, llm, tokenizer, EntropyPolicy(threshold=1.0))
    prompt = encode(engine)[0]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    requests = [Request(prompt, params, force="llm"), Request(prompt, params, force="slm"),
                Request(prompt, params, threshold=0.0), Request(prompt, params, threshold=1e9)]
    gens = engine.run(requests)
    sources = [gen.sources for gen in gens]
    assert sources == [["llm"] * 10, ["slm"] * 10, ["llm"] * 10, ["slm"] * 10]
    llm_only = Engine(slm, llm, tokenizer, AlwaysLLM()).generate([prompt], params)[0]
    slm_only = Engine(slm, None, tokenizer).generate([prompt], params)[0]
    assert gens[0].token_ids == llm_only.token_ids
    assert gens[1].token_ids == slm_only.token_ids
    # The engine's verification is for routed rows: a forced row is its model alone unless it asks for more.
    verifying = Engine(slm, llm, tokenizer, EntropyPolicy(threshold=1.0), verify="strict")
    forced = [Request(prompt, params, force="slm"), Request(prompt, params, force="slm", verify="strict")]
    assert not verifying.sequence(forced[0]).verify.on and forced[0].verify is None  # the request is left as made
    gens = verifying.run(forced)
    assert gens[0].token_ids == slm_only.token_ids
    assert gens[1].token_ids == llm_only.token_ids  # the SLM drafts, the LLM checks: speculative
    # The LLM writing alone has nothing to check: asked for, it is refused; an engine's setting leaves its rows alone
    with pytest.raises(R2RError, match="nothing for it to check"):
        verifying.sequence(Request(prompt, params, force="llm", verify="strict"))
    assert not Engine(slm, llm, tokenizer, AlwaysLLM(), verify="strict").sequence(Request(prompt, params)).verify.on
    assert Engine(slm, llm, tokenizer, AlwaysSLM(), verify="strict").sequence(Request(prompt, params)).verify.on


def test_rows_that_all_force_the_llm_leave_the_slm_idle(slm, llm, tokenizer, monkeypatch):
    """"LLM alone" through a pair costs the LLM alone; the SLM reads what it skipped once a row needs it."""
    from roads_to_rome.core.batch import Batch
    from roads_to_rome.core.request import Request
    from roads_to_rome.routing.policies import EntropyPolicy

    engine = Engine(slm, llm, tokenizer, EntropyPolicy(threshold=1.0))
    prompt = encode(engine)[0]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = [Engine.alone(model, tokenizer, role).generate([prompt], params)[0].token_ids
             for model, role in ((llm, "llm"), (slm, "slm"))]
    calls = []
    forward = slm.forward
    monkeypatch.setattr(slm, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    llm_row, slm_row = (engine.sequence(Request(prompt, params, force=model)) for model in ("llm", "slm"))
    batch = Batch(engine.context)
    batch.add([llm_row])
    calls.clear()
    for _ in range(5):
        batch.step()
    assert not calls  # the SLM never ran for the LLM's row
    batch.add([slm_row])
    while batch.sequences:
        batch.step()
    assert calls
    assert [llm_row.generation.token_ids, slm_row.generation.token_ids] == alone
    assert llm_row.generation.sources == ["llm"] * 12 and slm_row.generation.sources == ["slm"] * 12


def test_a_pairs_policy_of_one_model_runs_that_model_alone(slm, llm, tokenizer, monkeypatch):
    """`--router llm` is the LLM alone, `--router slm` unverified the SLM alone: the other model reads nothing, the
    prompt included (the SLM proposed every token for the LLM to replace, at the SLM's cost), and the parameters
    counted are that model's."""
    from roads_to_rome.core.request import Request

    prompt = encode(Engine(slm, llm, tokenizer))[0]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    reads = {}
    for model in (slm, llm):
        for name in ("forward", "forward_all", "read"):
            method = getattr(model, name)
            monkeypatch.setattr(model, name, lambda *a, _m=method, _n=model.name, **k:
                                reads.__setitem__(_n, reads.get(_n, 0) + 1) or _m(*a, **k))
    for policy, model, role in ((AlwaysLLM(), llm, "llm"), (AlwaysSLM(), slm, "slm")):
        reads.clear()
        alone = Engine.alone(model, tokenizer, role).generate([prompt], params)[0]
        assert set(reads) == {model.name}
        reads.clear()
        through_pair = Engine(slm, llm, tokenizer, policy).generate([prompt], params)[0]
        assert set(reads) == {model.name}, reads
        assert through_pair.token_ids == alone.token_ids and through_pair.sources == [role] * 10
        assert through_pair.avg_params_b == pytest.approx(model.num_params / 1e9)  # that model's parameters only
    forced = Engine(slm, llm, tokenizer, RandomPolicy(0.5, seed=0)).run([Request(prompt, params, force="llm")])[0]
    assert forced.avg_params_b == pytest.approx(llm.num_params / 1e9)  # a request forcing it alike


def test_target_llm_rate_is_tracked_per_request(slm, llm, tokenizer):
    from roads_to_rome.core.request import Request
    from roads_to_rome.routing.policies import EntropyPolicy

    engine = Engine(slm, llm, tokenizer, EntropyPolicy(threshold=1e9))  # on its own it would never route
    prompt = encode(engine)[0]
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    gens = engine.run([Request(prompt, params, target_rate=rate) for rate in (0.1, 0.3)])
    for rate, gen in zip((0.1, 0.3), gens):
        assert gen.llm_rate == pytest.approx(rate, abs=0.03)


def test_a_target_rate_holds_when_the_scores_drift(slm, llm, tokenizer):
    """Scores that fall as an answer goes on (the SLM growing surer) seldom reach the top of their own past:
    the share routed still meets the target, since the request aims off by what it is behind."""
    from roads_to_rome.core.request import Request
    from roads_to_rome.routing.policies import EntropyPolicy

    class Falling(EntropyPolicy):  # noisy scores whose level halves every 80 tokens
        draws, step = torch.Generator().manual_seed(0), 0

        def route(self, logits, hidden, tokens, thresholds=None):
            self.step += 1
            scores = torch.rand(tokens.shape[0], generator=self.draws) * 0.5 ** (self.step / 80)
            return scores >= (self.threshold if thresholds is None else thresholds), scores

    engine = Engine(slm, llm, tokenizer, Falling(threshold=1e9))
    request = Request(encode(engine)[0], SamplingParams(max_new_tokens=240, ignore_eos=True), target_rate=0.2)
    assert engine.run([request])[0].llm_rate == pytest.approx(0.2, abs=0.03)


def test_the_engine_equals_the_bare_forward_loops_of_the_benchmark(slm, tokenizer):
    """`r2r bench overhead` compares like with like: the engine (always SLM), the bare loop on a
    dynamic cache and the bare loop on a static cache write the same greedy tokens."""
    from roads_to_rome.bench.measure import bare_loop

    engine = Engine(slm, None, tokenizer)
    prompt = engine.prompts.chat("What is 48 / 2?")
    gen = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    dynamic, _ = bare_loop(slm.model, prompt, 12)
    static, _ = bare_loop(slm.model, prompt, 12, static=True)
    assert gen.token_ids == dynamic == static


def test_one_model_alone_writes_every_token_as_its_role(slm, llm, tokenizer):
    """`Engine.alone`: the LLM by itself decodes as `generate` does, and its tokens count as the LLM's."""
    engine = Engine.alone(llm, tokenizer, "llm")
    prompts = encode(engine)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [g.token_ids for g in gens] == hf_greedy(llm, engine, prompts, 20)
    for g in gens:
        assert g.sources == ["llm"] * len(g.token_ids) and g.llm_rate == 1.0
        assert g.avg_params_b == pytest.approx(llm.num_params / 1e9)
        assert g.timings.llm_s > 0 and g.timings.slm_s == 0
    slm_alone = Engine.alone(slm, tokenizer, "slm").generate(prompts[:1], SamplingParams(max_new_tokens=5))[0]
    assert slm_alone.sources == ["slm"] * 5 and slm_alone.avg_params_b == pytest.approx(slm.num_params / 1e9)
    with pytest.raises(R2RError, match="needs an SLM"):
        Engine(None, llm, tokenizer, RandomPolicy(0.5))


def test_timings_belong_to_each_request_not_to_the_batch(slm, llm, tokenizer):
    """A request that joins late, or a server's next request, does not inherit anyone else's time."""
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    prompts = encode(engine)
    requests = run_with_joins(engine, prompts, join_after=[6, 10], params=SamplingParams(max_new_tokens=8,
                                                                                         ignore_eos=True))
    for r in requests:
        t = r.generation.timings
        assert t.steps == len(r.generation.token_ids) == 8
        assert t.total_s >= t.slm_s + t.router_s + t.llm_s - 1e-9
    assert len({id(r.generation.timings) for r in requests}) == len(requests)
