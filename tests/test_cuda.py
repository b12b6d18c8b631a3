"""The engine on CUDA, where the torch backend runs a static cache and one-token steps as CUDA graphs: the same
tokens as transformers' own generate and as the LLM alone under strict verification (tiny models of each family
users bring: Qwen2, Qwen3, Llama). Skipped where torch sees no CUDA device (CI has none; `scripts/gpu-run.sh` runs
these on a GPU machine)."""

import pytest
import torch
from helpers import PROMPTS, encode
from tiny import FAMILIES, tiny_model

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.layout import left_pad
from roads_to_rome.core.llm_calls import Deferral
from roads_to_rome.core.request import Failure, Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, EntropyPolicy, NeuralPolicy, RandomPolicy
from roads_to_rome.routing.router import Router, RouterCheckpoint, RouterConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
N_TOKENS = 40


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


def tiny_pair(tokenizer, family: str, device: str, **options) -> tuple[TorchBackend, TorchBackend]:
    """The tests' tiny SLM and LLM (fp32: far-apart logits) of one family on `device`."""
    return tuple(TorchBackend(tiny_model(tokenizer, hidden=hidden, seed=seed, family=family).to(device),
                              name=f"tiny-{role}-{family}", **options)
                 for role, hidden, seed in (("slm", 32, 0), ("llm", 64, 1)))


@pytest.fixture(scope="module")
def pair(tokenizer, family):
    return tiny_pair(tokenizer, family, "cuda")


def cuda_greedy(backend, engine, prompt_ids, n):
    """transformers' generate on the same device (hf_greedy builds its inputs on the CPU)."""
    ids, mask = left_pad(prompt_ids, engine.pad_id, "cuda")
    out = backend.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                 pad_token_id=engine.pad_id)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in engine.eos_ids), len(row))
        rows.append(row[:cut])
    return rows


def test_cuda_backends_use_a_static_cache_and_graphs(pair):
    slm, llm = pair
    assert slm.static and slm.graphs and llm.static and llm.graphs


@pytest.mark.parametrize("policy, role", [(AlwaysSLM(), "slm"), (AlwaysLLM(), "llm")])
def test_always_one_model_equals_generate_on_cuda(pair, tokenizer, policy, role):
    slm, llm = pair
    engine = Engine(slm, llm, tokenizer, policy)
    prompts = encode(engine)
    model = slm if role == "slm" else llm
    params = SamplingParams(max_new_tokens=N_TOKENS)
    for p in prompts:
        assert engine.generate([p], params)[0].token_ids == cuda_greedy(model, engine, [p], N_TOKENS)[0]
    assert [g.token_ids for g in engine.generate(prompts, params)] == cuda_greedy(model, engine, prompts, N_TOKENS)
    assert len(model.pool.graphs) > 0  # the steps were replayed graphs


def test_cuda_equals_the_cpu(pair, tokenizer, family):
    """The graphed CUDA path writes the CPU's tokens under mixed routing (fp32 tiny models: far-apart logits)."""
    outputs = []
    for small, large in (pair, tiny_pair(tokenizer, family, "cpu")):
        engine = Engine(small, large, tokenizer, RandomPolicy(0.3, seed=0))
        outputs.append([g.token_ids for g in engine.generate(encode(engine), SamplingParams(max_new_tokens=N_TOKENS))])
    assert outputs[0] == outputs[1]
    sizes = {size for steps in pair[1].pool.graphs.values() for size in steps}
    assert 1 in sizes and max(sizes) > 1  # one-token steps and catch-ups both ran as graphs


@pytest.mark.parametrize("policy", [RandomPolicy(0.2, seed=0), EntropyPolicy(3.0), AlwaysSLM()],
                         ids=["random", "entropy", "slm"])
def test_strict_verification_equals_the_llm_alone_on_cuda(pair, tokenizer, policy):
    slm, llm = pair
    alone = Engine.alone(llm, tokenizer)
    prompts = [alone.prompts.chat(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=N_TOKENS)
    expected = [g.token_ids for g in alone.generate(prompts, params)]
    engine = Engine(slm, llm, tokenizer, policy, verify="strict")
    assert [g.token_ids for g in engine.generate(prompts, params)] == expected
    assert [engine.generate([p], params)[0].token_ids for p in prompts] == expected


def test_the_router_replays_as_a_graph_with_the_eager_scores(pair, tokenizer):
    """The graphed router (one graph per batch shape, fed by copies into its buffers) scores as the eager one, on
    fresh inputs each call, and in the engine routes the same tokens."""
    slm, llm = pair
    checkpoint = RouterCheckpoint(Router(RouterConfig(slm.hidden_size, slm.hidden_size)), threshold=0.5)
    graphed = NeuralPolicy(checkpoint, slm.embed, device="cuda")
    eager = NeuralPolicy(checkpoint, slm.embed, device="cuda", graphs=False)
    assert graphed.graphs and not eager.graphs
    generator = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 3, 1, 3):
        logits = torch.randn(rows, slm.vocab_size, device="cuda", generator=generator)
        hidden = torch.randn(rows, slm.hidden_size, device="cuda", generator=generator)
        tokens = torch.randint(0, slm.vocab_size, (rows,), device="cuda", generator=generator)
        (to_llm, scores), (eager_to_llm, eager_scores) = (p.route(logits, hidden, tokens) for p in (graphed, eager))
        torch.testing.assert_close(scores, eager_scores)
        assert torch.equal(to_llm, eager_to_llm)
    assert len(graphed.captured) == 2  # one graph per batch shape, replayed
    outputs = []
    for policy in (graphed, eager):
        engine = Engine(slm, llm, tokenizer, policy)
        results = engine.generate(encode(engine), SamplingParams(max_new_tokens=N_TOKENS))
        outputs.append([(g.token_ids, g.sources) for g in results])
    assert outputs[0] == outputs[1]


def test_the_graphs_record_the_compiled_trunk_with_the_uncompiled_tokens(tokenizer, pair, family):
    """By default the graphs record the trunk as torch.compile makes it (the other tests here run that way against
    transformers' generate); with compile=False they record it as it is, and both write the same tokens under mixed
    routing, one-token steps and catch-ups alike."""
    slm = pair[0]
    assert slm.compiled_trunk is not None and "torch.compile" in slm.kernels
    plain = tiny_pair(tokenizer, family, "cuda", compile=False)
    assert plain[0].compiled_trunk is None and "torch.compile" not in plain[0].kernels
    outputs = []
    for small, large in (pair, plain):
        engine = Engine(small, large, tokenizer, RandomPolicy(0.3, seed=0))
        results = engine.generate(encode(engine), SamplingParams(max_new_tokens=N_TOKENS))
        outputs.append([(g.token_ids, g.sources) for g in results])
    assert outputs[0] == outputs[1]


@pytest.mark.filterwarnings("error::UserWarning")  # a failed capture or compile warns and carries on without
def test_with_overlap_each_models_graphs_are_recorded_while_the_other_runs(tokenizer, family):
    """A fresh pair (nothing compiled or recorded yet) with the LLM's calls on a thread and stream of their own: its
    graphs are recorded while the SLM compiles and records its own, and each waits for the other at the gate
    (cuda_graphs.CaptureGate), so no recording fails; grouped calls, where rows finish at different steps, keep
    their buffers and graphs; strict verification still writes the LLM's greedy tokens."""
    slm, llm = tiny_pair(tokenizer, family, "cuda")
    alone = Engine.alone(llm, tokenizer)
    prompts = [alone.prompts.chat(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=N_TOKENS)
    expected = [g.token_ids for g in alone.generate(prompts, params)]
    fresh_slm, fresh_llm = tiny_pair(tokenizer, family, "cuda")
    engine = Engine(fresh_slm, fresh_llm, tokenizer, EntropyPolicy(3.0), verify="strict", overlap=True,
                    defer=Deferral("continue", group=0.5, steps=4))
    assert [g.token_ids for g in engine.generate(prompts, params)] == expected
    assert fresh_slm.graphs and fresh_llm.graphs and fresh_slm.compiled_trunk is not None
    buffers = [len(model.pool.graphs) for model in (fresh_slm, fresh_llm)]
    assert [g.token_ids for g in engine.generate(prompts, params)] == expected
    assert [len(model.pool.graphs) for model in (fresh_slm, fresh_llm)] == buffers  # the same batch: the same buffers


def test_rows_that_join_and_leave_keep_their_tokens_and_the_graphs_buffers(tokenizer, family):
    """Requests of different lengths arrive one per turn (at most 4 rows, prompts read in chunks): each ends with the
    tokens it gets alone, and every graph recorded on the way is still held over the pool's buffers: rows that leave
    leave their slots, and a batch that outgrows its buffers takes pooled ones, so no recording is thrown away with
    its buffers (as each row that left once did)."""
    slm, llm = tiny_pair(tokenizer, family, "cuda")
    policy = EntropyPolicy(3.0)
    reference = Engine(slm, llm, tokenizer, policy, verify=1.0)
    requests = [Request(reference.prompts.chat(p + " " * i), SamplingParams(max_new_tokens=8 + 5 * i))
                for i, p in enumerate(PROMPTS * 2)]
    expected = [reference.run([r])[0].token_ids for r in requests]
    fresh_slm, fresh_llm = tiny_pair(tokenizer, family, "cuda")
    engine = Engine(fresh_slm, fresh_llm, tokenizer, policy, verify=1.0)
    scheduler = engine.scheduler(max_batch=4, prefill_chunk=7)
    got, arrivals = {}, list(enumerate(requests))
    while arrivals or not scheduler.idle:
        if arrivals:
            i, request = arrivals.pop(0)
            scheduler.add(engine.sequence(request, i))
        for event in scheduler.turn():
            assert not isinstance(event, Failure), event.error
            if event.finished:
                got[event.sequence.index] = event.sequence.generation.token_ids
    assert [got[i] for i in range(len(requests))] == expected
    for model in (fresh_slm, fresh_llm):
        assert 0 < sum(len(steps) for steps in model.pool.graphs.values()) == model.captures
