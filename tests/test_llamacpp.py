"""The llama.cpp backend on tiny GGUF files holding the same weights as the tiny torch models."""

import json

import pytest
import torch

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (its build failed or was skipped)")

from conftest import tiny_llamacpp  # noqa: E402
from helpers import PROMPTS, run_with_joins  # noqa: E402
from tiny import save_gguf  # noqa: E402

from roads_to_rome.backends.llamacpp import LlamaCppBackend  # noqa: E402
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import R2RError  # noqa: E402
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, RandomPolicy  # noqa: E402


@pytest.fixture(scope="module")
def gguf_pair(tokenizer, slm, llm, tmp_path_factory):
    """llama.cpp backends over GGUF copies of the conftest's tiny SLM and LLM."""
    folder = tmp_path_factory.mktemp("gguf")
    backends = []
    for name, torch_backend in (("slm", slm), ("llm", llm)):
        path = folder / f"{name}.gguf"
        save_gguf(torch_backend.model, tokenizer, path)
        backends.append(tiny_llamacpp(path, name=f"tiny-{name}", n_ctx=2048, max_rows=8))
    return backends


def greedy_by_full_forward(backend, prompt, n, eos_ids):
    """Reference greedy decoding: recompute every position from scratch with the backend's prefill."""
    ids = list(prompt)
    for _ in range(n):
        logits, _ = backend.forward_sequence(ids)
        ids.append(int(logits[-1].argmax()))
        if ids[-1] in eos_ids:
            break
    return ids[len(prompt):]


def test_logits_and_hidden_states_match_the_torch_backend(gguf_pair, slm, llm, tokenizer):
    ids = tokenizer(PROMPTS[2])["input_ids"]
    for backend, reference in zip(gguf_pair, (slm, llm)):
        logits, hidden = backend.forward_sequence(ids)
        ref_logits, ref_hidden = reference.forward_sequence(ids)
        assert logits.shape == ref_logits.shape and hidden.shape == ref_hidden.shape
        # Not bit-equal: llama.cpp keeps its KV cache in f16.
        assert (hidden - ref_hidden.float()).abs().max() < 1e-2
        assert (logits - ref_logits).abs().max() < 5e-2
        assert backend.embedding_table().float().allclose(reference.embedding_table().float(), atol=1e-2)


@pytest.mark.parametrize("policy, role", [(AlwaysSLM(), "slm"), (AlwaysLLM(), "llm")])
def test_always_one_model_equals_its_own_greedy_output(gguf_pair, tokenizer, policy, role):
    engine = Engine(*gguf_pair, tokenizer, policy)
    prompts = [engine.prompts.chat(p) for p in PROMPTS]
    reference = gguf_pair[0] if role == "slm" else gguf_pair[1]
    params = SamplingParams(max_new_tokens=24)
    expected = [greedy_by_full_forward(reference, p, 24, engine.eos_ids) for p in prompts]
    assert [engine.generate([p], params)[0].token_ids for p in prompts] == expected  # unbatched
    assert [g.token_ids for g in engine.generate(prompts, params)] == expected  # batched, left-padded


@pytest.mark.parametrize("prefill_chunk", [None, 6])
def test_requests_joining_and_mixed_routing_decode_as_if_alone(gguf_pair, tokenizer, prefill_chunk):
    slm, llm = gguf_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=3))
    prompts = [engine.prompts.chat(p) for p in PROMPTS] + [engine.prompts.raw("Hi")]
    requests = run_with_joins(engine, prompts, join_after=[2, 4, 7], params=SamplingParams(max_new_tokens=12),
                              prefill_chunk=prefill_chunk)
    assert sum(r.generation.llm_tokens for r in requests) > 0
    for prompt, r in zip(prompts, requests):
        for i, (token, source) in enumerate(zip(r.generation.token_ids, r.generation.sources)):
            model = llm if source == "llm" else slm
            logits, _ = model.forward_sequence(prompt + r.generation.token_ids[:i])
            assert token == int(logits[-1].argmax()), (i, source)
    # Every sequence a finished batch held is free again.
    assert sorted(slm._free_seqs) == list(range(8)) and sorted(llm._free_seqs) == list(range(8))


def test_truncate_then_continue_equals_a_fresh_cache(gguf_pair, tokenizer):
    _, llm = gguf_pair
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    mask = torch.ones_like(ids)
    cache = llm.new_cache()
    llm.forward(cache, ids, mask)
    llm.truncate(cache, 3)
    logits, hidden = llm.forward(cache, ids[:, 3:6], mask[:, :6])
    fresh_logits, fresh_hidden = llm.forward(llm.new_cache(), ids[:, :6], mask[:, :6])
    assert torch.allclose(logits, fresh_logits, atol=1e-4) and torch.allclose(hidden, fresh_hidden, atol=1e-4)


def test_bad_files_are_refused_clearly(tmp_path):
    with pytest.raises(R2RError, match="needs a .gguf file"):
        LlamaCppBackend(tmp_path / "missing.gguf")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(R2RError, match="cannot load"):
        LlamaCppBackend(broken)


def test_cli_runs_each_backend_and_per_role_mixes(run_cli, tokenizer, tmp_path):
    from tiny import save_pair

    slm_dir, llm_dir = save_pair(tmp_path, tokenizer)
    from transformers import AutoModelForCausalLM

    for name, folder in (("slm", slm_dir), ("llm", llm_dir)):
        save_gguf(AutoModelForCausalLM.from_pretrained(folder), tokenizer, tmp_path / f"{name}.gguf")
    runs = {
        "llamacpp": (tmp_path / "slm.gguf", tmp_path / "llm.gguf"),
        "slm=llamacpp,llm=torch": (tmp_path / "slm.gguf", llm_dir),
    }
    for backend, (slm_spec, llm_spec) in runs.items():
        code, out, err = run_cli("generate", "What is 48 / 2?", "--slm", slm_spec, "--llm", llm_spec, "--backend",
                                 backend, "--router", "random", "--threshold", "0.5", "--max-new-tokens", "8", "--json",
                                 "--verify", "off")
        assert code == 0, (backend, err)
        result = json.loads(out)
        assert len(result["token_ids"]) == 8 and {"slm", "llm"} <= set(result["sources"])
    code, out, err = run_cli("generate", "hi", "--slm", slm_dir, "--llm", llm_dir, "--backend", "llamacpp")
    assert code == 2 and "GGUF" in err
    code, out, err = run_cli("generate", "hi", "--slm", slm_dir, "--llm", llm_dir, "--backend", "onnx")
    assert code == 2 and "bad --backend" in err
