"""`r2r bench shapes` on tiny configurations: the random-weight builder, both backends on its output, the cost
model's arithmetic, and the errors a user can make."""

import gguf
import numpy as np
import pytest
import torch
from conftest import HAS_LLAMA, tiny_llamacpp
from tiny import save_gguf, tiny_model

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.bench import cost_model, shape_models, shapes, shapes_report, stand_ins
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.routing.policies import RandomPolicy

needs_llama = pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python is not installed")
TINY = shape_models.LlmShape("tiny", "test", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512,
                             vocab_rows=384, tied=False)
TINY_TIED = shape_models.LlmShape("tiny-tied", "test", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512,
                                  vocab_rows=320, tied=True)
TINY_QWEN3 = shape_models.LlmShape("tiny-qwen3", "test", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256,
                                   vocab_rows=320, tied=False, arch="qwen3", head_dim=64)


@pytest.fixture(scope="module")
def template(tokenizer, tmp_path_factory):
    """A Qwen2 GGUF carrying the tiny tokenizer: what the builder takes the vocabulary from."""
    path = tmp_path_factory.mktemp("template") / "template.gguf"
    save_gguf(tiny_model(tokenizer, hidden=32), tokenizer, path)
    return path


@pytest.mark.parametrize("shape", [TINY, TINY_TIED], ids=["untied, padded rows", "tied"])
def test_the_builder_writes_exactly_the_configurations_tensors(shape, template, tmp_path, tokenizer):
    path = shape_models.write_random_gguf(shape, template, tmp_path / "f16.gguf")
    reader = gguf.GGUFReader(path)
    found = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    assert found == shape_models.tensor_shapes(shape)
    assert reader.fields["qwen2.embedding_length"].contents() == shape.hidden
    assert reader.fields["qwen2.block_count"].contents() == shape.layers
    assert reader.fields["qwen2.attention.head_count_kv"].contents() == shape.kv_heads
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == shape.vocab_rows and tokens[-1] == f"[PAD{shape.vocab_rows - 1}]"
    assert sum(int(np.prod(t.shape)) for t in reader.tensors) == shape.params


@pytest.mark.parametrize("shape", [TINY, TINY_TIED, TINY_QWEN3], ids=["untied", "tied", "qwen3"])
def test_the_parameter_count_is_transformers_own(shape):
    model = shape_models.torch_shape(shape, "cpu", torch.float32)
    assert sum(p.numel() for p in model.parameters()) == shape.params


def test_the_published_shapes_have_their_known_sizes():
    sizes = {name: round(s.params / 1e9, 1) for name, s in shape_models.SHAPES.items()}
    assert sizes == {"qwen2.5-coder-0.5b": 0.5, "qwen2.5-coder-1.5b": 1.5, "qwen2.5-coder-3b": 3.1,
                     "qwen2.5-coder-7b": 7.6, "qwen2.5-coder-14b": 14.8, "qwen2.5-coder-32b": 32.8,
                     "r1-distill-qwen-1.5b": 1.8, "r1-distill-qwen-32b": 32.8, "qwen3-0.6b": 0.6, "qwen3-8b": 8.2}


def test_qwen3_shapes_are_torch_only(run_cli, tmp_path):
    code, out, err = run_cli("bench", "shapes", "--llm-shape", "qwen3-8b", "--backend", "llamacpp", "--build-only",
                             "--out", tmp_path / "s.json")
    assert code == 2 and "qwen3 model" in err and "--backend torch" in err, err


@needs_llama
def test_both_backends_run_the_shape_and_pair_it_with_an_slm(shape_file, slm, tokenizer):
    built = tiny_llamacpp(shape_file, name="tiny", vocab_size=len(tokenizer))
    torch_llm = TorchBackend(shape_models.torch_shape(TINY, "cpu", torch.float32), name="tiny",
                             vocab_size=len(tokenizer))
    prompt = Engine.alone(slm, tokenizer).prompts.chat("What is 48 / 2?")
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for llm in (built, torch_llm):
        assert llm.vocab_size == len(tokenizer) and llm.hidden_size == TINY.hidden
        gen = Engine(slm, llm, tokenizer, RandomPolicy(0.5, seed=0)).generate([prompt], params)[0]
        assert len(gen.token_ids) == 6 and 0 < gen.llm_tokens < 6
        assert all(0 <= t < len(tokenizer) for t in gen.token_ids)


@pytest.fixture(scope="module")
def shape_file(template, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shape")
    return shape_models.quantize(shape_models.write_random_gguf(TINY, template, folder / "f16.gguf"),
                                 folder / "q4.gguf")


@needs_llama
def test_the_quantized_file_keeps_the_shapes_and_is_smaller(shape_file):
    reader = gguf.GGUFReader(shape_file)
    found = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    assert found == shape_models.tensor_shapes(TINY)
    assert any(t.tensor_type.name.startswith("Q") for t in reader.tensors)


def test_cost_model_interpolates_and_extrapolates_step_costs():
    ms = {1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0}
    assert [cost_model.cost_at(ms, k) for k in (1, 3, 12)] == [10.0, 14.0, 32.0]
    assert cost_model.cost_at(ms, 0.5) == 10.0


def test_cost_model_of_routing_and_of_a_models_calls():
    ms = {1: 10.0, 100: 208.0}  # t(k) = 8 + 2k
    assert cost_model.predicted_alone_tok_s(ms, [10], 5) == pytest.approx(5 / ((28 + 4 * 10) / 1000))
    slm, llm = cost_model.routing_calls(10, 50, 1.0, np.random.default_rng(0))
    assert slm == [10] + [1] * 49 and llm == [10] + [1] * 49  # every token routed: the LLM reads like the SLM
    slm, llm = cost_model.routing_calls(10, 50, 1e-9, np.random.default_rng(0))
    assert llm == []
    for share in (0.1, 0.3):
        slm, llm = cost_model.routing_calls(20, 200, share, np.random.default_rng(1))
        assert sum(llm) <= 20 + 199 and abs(len(llm) - share * 200) < 4 * (share * 200) ** 0.5
    run = {"tokens": 4, "slm_calls": [[3, 1, 1, 1]], "llm_calls": [[3, 3]]}
    assert cost_model.predicted_from_calls(run, ms, ms) == pytest.approx(4 / ((14 + 3 * 10 + 2 * 14) / 1000))


def test_a_cheap_llm_makes_routing_pay_less_than_a_dear_one():
    slm = {1: 40.0, 64: 400.0}
    cheap, dear = {1: 80.0, 64: 650.0}, {1: 900.0, 64: 3000.0}
    gain = {name: cost_model.predicted_routing_tok_s(slm, llm, 0.15, [150], 64)
            / cost_model.predicted_alone_tok_s(llm, [150], 64)
            for name, llm in (("cheap", cheap), ("dear", dear))}
    assert gain["dear"] > 2 * gain["cheap"]


def test_the_overlapped_schedule_pays_the_larger_side_where_nothing_is_shared():
    flat = {1: 10.0, 64: 10.0}  # either model's step: 10 ms, whatever it reads
    free = {1: 0.0, 64: 0.0}
    widths, tokens = [20], 200
    lockstep = cost_model.predicted_routing_tok_s(flat, flat, 0.3, widths, tokens, samples=5)
    apart = cost_model.predicted_overlapped_tok_s(flat, flat, 0.3, widths, tokens, samples=5, accept=1.0)
    shared = cost_model.predicted_overlapped_tok_s(flat, flat, 0.3, widths, tokens, samples=5, accept=1.0,
                                                   contention=1.0)
    # the SLM's 100 tok/s alone; lockstep pays the LLM's 10 ms at about 30% of its steps
    assert lockstep == pytest.approx(100 / 1.3, rel=0.1)
    assert apart > 1.15 * lockstep and apart <= 100.5  # beside the SLM: close to the SLM alone
    assert shared < 0.9 * apart  # sharing one device takes most of that back
    assert cost_model.predicted_overlapped_tok_s(flat, free, 0.3, widths, tokens, samples=5, accept=1.0) == \
        pytest.approx(100, rel=0.02)  # a free LLM that keeps every token: the SLM alone
    rejecting = cost_model.predicted_overlapped_tok_s(flat, flat, 0.3, widths, tokens, samples=5, accept=0.0)
    assert rejecting < apart  # what roll-backs discard is paid


@pytest.mark.parametrize("args, message", [
    (["--llm-shape", "qwen2.5-coder-70b"], "unknown --llm-shape qwen2.5-coder-70b"),
    (["--llm-share", "0.1,1.5"], "strictly between 0 and 1"),
    (["--llm-share", "0"], "strictly between 0 and 1"),
    (["--llm-share", "lots"], "comma-separated numbers"),
    (["--slm-shape", "qwen3-0.6b"], "--slm-shape builds the SLM with transformers"),
    (["--slm-shape", "tiny", "--backend", "torch"], "unknown --slm-shape tiny"),
    (["--real-from", "x.json", "--backend", "torch"], "--real-from goes with --slm-shape"),
    (["--batch", "0"], "--batch value must be at least 1"),
])
def test_bad_shapes_and_shares_are_one_line_errors(run_cli, args, message, tmp_path):
    code, out, err = run_cli("bench", "shapes", *args, "--out", tmp_path / "s.json")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_cost_model_at_a_batch_routes_a_step_when_any_row_is_routed():
    assert cost_model.batch_widths([5, 9, 3, 4, 7], 2) == [9, 4, 7]
    share, tokens = 0.1, 4000
    _, one = cost_model.routing_calls(10, tokens, share, np.random.default_rng(0))
    _, four = cost_model.routing_calls(10, tokens, share, np.random.default_rng(0), rows=4)
    assert abs(len(one) / tokens - share) < 0.02 and abs(len(four) / tokens - (1 - (1 - share) ** 4)) < 0.03
    assert all(k > 0 for k in four) and sum(four) <= 10 + tokens - 1  # each reads the columns since the last
    steps = np.flatnonzero(np.random.default_rng(0).random(tokens) < share)  # one row: the same draws as before
    assert one == [10 + int(steps[0])] + np.diff(steps).tolist()
    ms = {1: 10.0, 100: 208.0}
    alone = cost_model.predicted_alone_tok_s(ms, [10], 5)
    assert cost_model.predicted_alone_tok_s(ms, [10], 5, rows=4) == pytest.approx(4 * alone)


def test_batched_rows_carry_the_cost_model_where_batched_step_costs_were_measured():
    slm_ms, llm_ms = {1: 5.0, 64: 8.0}, {1: 25.0, 64: 40.0}
    result = {"config": {"tokens": 64}, "batch_prompt_widths": {"4": [120]},
              "slm_batched_steps": {"4": {str(k): v for k, v in slm_ms.items()}}}
    entry = {"batched_steps": {"4": {str(k): v for k, v in llm_ms.items()}}}
    measured = {"llm b=4": {"tokens_per_s": 100.0, "llm_share": 1.0},
                "r2r@0.1 b=4": {"tokens_per_s": 250.0, "llm_share": 0.1}}
    llm_row, r2r_row = shapes_report.batched_rows(result, entry, measured, [0.1], 4)
    assert llm_row["predicted"] == pytest.approx(cost_model.predicted_alone_tok_s(llm_ms, [120], 64, rows=4))
    assert r2r_row["predicted"] == pytest.approx(cost_model.predicted_routing_tok_s(slm_ms, llm_ms, 0.1, [120], 64,
                                                                                    rows=4))
    assert r2r_row["x_llm"] == 2.5 and r2r_row["x_model"] == pytest.approx(250.0 / r2r_row["predicted"])
    assert r2r_row["predicted_x_llm"] == pytest.approx(r2r_row["predicted"] / llm_row["predicted"])
    # without step costs at that batch (an earlier file, or a backend that cannot hold the rows): measured only
    bare = shapes_report.batched_rows({"config": {"tokens": 64}}, {}, measured, [0.1], 4)
    assert [row["predicted"] for row in bare] == [None, None] and bare[1]["x_llm"] == 2.5


def test_step_costs_are_measured_with_the_rows_asked(slm):
    backend = TorchBackend(slm.model, name="tiny", static=True, pad_reads=True)
    table = shapes.step_table(backend, 20, [1, 4], [12, 15], rows=3)
    assert set(table) == {1, 4, 12, 15} and all(ms > 0 for ms in table.values())
    assert shapes.unmeasured_batches(shapes.Plan((TINY,), batches=(1, 2, 4)), {"2": {}}, None) == [4]
    assert shapes.unmeasured_batches(shapes.Plan((TINY,), batches=(1, 2, 4)), {}, 2) == [2]


def test_the_llm_that_agrees_at_a_rate_keeps_every_deferred_token_at_rate_one_on_torch(slm, llm, tokenizer):
    """What the grouped runs put in place of a real pair's agreement, over torch's logits (inference tensors)."""
    from roads_to_rome.core.llm_calls import Deferral

    engine = Engine(slm, stand_ins.AgreesAtRate(llm, 1.0), tokenizer, RandomPolicy(0.3, seed=0),
                    defer=Deferral("continue", 1.0, 4))
    prompts = [engine.prompts.chat(p) for p in ("What is 48 / 2?", "def add(a, b):", "Count to five.")]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert sum(g.deferred for g in gens) > 0
    assert [g.deferred_kept for g in gens] == [g.deferred for g in gens]


def test_the_llm_that_agrees_at_a_rate_prefers_the_written_token_where_it_agrees_only():
    """Every position it has read the next token of: rate 1 makes that token the top one, rate 0 changes nothing;
    the last column (whose next token is not written) is left as it is."""

    class Fixed:
        def __init__(self, logits):
            self.logits = logits

        def forward_all(self, cache, new_ids, attention_mask, n, row_keep=None):
            return self.logits.clone()

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=generator)
    new_ids = torch.randint(0, 50, (3, 6), generator=generator)
    agreed = stand_ins.AgreesAtRate(Fixed(logits), 1.0).forward_all(None, new_ids, None, 4)
    assert torch.equal(agreed[:, :3].argmax(-1), new_ids[:, 3:])
    assert torch.equal(agreed[:, 3], logits[:, 3])
    assert torch.equal(stand_ins.AgreesAtRate(Fixed(logits), 0.0).forward_all(None, new_ids, None, 4), logits)


@pytest.mark.parametrize("rate", [1.0, 0.0])
def test_an_overlapped_call_agrees_at_the_rate_with_the_slms_token_just_past_its_read(slm, llm, tokenizer, rate):
    """With the LLM's calls beside the SLM's steps a call stops just short of the routed token it checks: the SLM's
    proposal for that column (as the policy saw it) is what the agreeing LLM prefers, so routed tokens are kept at
    the rate, not never."""
    from roads_to_rome.bench.shape_models import random_router

    recorded = stand_ins.Recorded(slm)
    proposals = stand_ins.Proposals(recorded)
    engine = Engine(recorded, stand_ins.AgreesAtRate(llm, rate, proposals=proposals), tokenizer,
                    stand_ins.RouterAtShare(random_router(slm), 0.3, proposals=proposals), overlap=True)
    prompt = engine.prompts.chat("What is 48 / 2?")
    gen = engine.generate([prompt], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    assert gen.deferred > 0
    assert gen.deferred_kept == (gen.deferred if rate else 0)


def test_a_run_that_recorded_graphs_is_timed_again_and_marked_where_it_never_stopped(monkeypatch, slm, tokenizer):
    """Recording a CUDA graph (and compiling the trunk for it) is one-time work: a system whose timed run recorded
    any runs again, up to WARM_RUNS runs, and the table marks one whose last run still recorded."""
    from roads_to_rome.models import systems

    engine = systems.alone(stand_ins.Recorded(slm), tokenizer, "slm")
    prompt = engine.prompts.chat("What is 48 / 2?")
    monkeypatch.setattr(slm, "captures", 0)
    real_run = shapes.timed_run
    for recording_runs, runs, recorded in ((2, 3, 0), (0, 1, 0), (9, shapes_report.WARM_RUNS, 1)):
        timed = []

        def run_recording(*args, timed=timed, recording_runs=recording_runs):
            timed.append(args)
            slm.captures += len(timed) <= recording_runs  # this run recorded a graph
            return real_run(*args)

        monkeypatch.setattr(shapes, "timed_run", run_recording)
        result = shapes.run_system(engine, [prompt], 4)
        assert (result["runs"], result["recorded_while_timed"], len(timed)) == (runs, recorded, runs)
        assert result["tokens"] == 4
    row = {"system": "r2r@0.11 b=8", "share": 0.11, "measured": 10.0, "recorded_while_timed": 1}
    assert shapes_report.row_cells(row, False)[0] == "r2r@0.11 b=8 ‡"
    assert "‡" not in shapes_report.row_cells(row | {"recorded_while_timed": 0}, False)[0]
