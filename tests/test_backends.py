"""The backend contract (roads_to_rome/backends/base.py), one suite run against every backend: the torch backend on a
tiny model and llama.cpp on a GGUF file holding the same weights, for each architecture family (Qwen2, Qwen3,
Llama)."""

import numpy as np
import pytest
import torch
from conftest import make_backend
from tiny import FAMILIES, tiny_model

from roads_to_rome.backends.base import SCORE_CHUNK, Backend, mask_for
from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.layout import left_pad, pad_columns_left
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import AlwaysLLM, RandomPolicy

PROMPTS = ["What is 48 / 2?", "def add(a, b):\n    return", "Bonjour! Paris is the capital of which country?"]
# llama.cpp keeps its KV cache in f16 and batches rows through other kernels: close, not bit-equal.
TOLERANCE = {"torch": 1e-4, "torch-static": 1e-4, "llamacpp": 2e-2}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """Each architecture users bring (tests/tiny.py: Qwen2, Qwen3, Llama), on each backend."""
    return request.param


@pytest.fixture(scope="module")
def model(family, slm, tokenizer):
    return slm.model if family == "qwen2" else tiny_model(tokenizer, hidden=32, seed=0, family=family)


@pytest.fixture(scope="module")
def backend(kind, model, tokenizer, tmp_path_factory):
    return make_backend(kind, model, tokenizer, tmp_path_factory.mktemp("gguf"), "tiny-slm")


def test_its_logits_are_the_models_own(backend, kind, model, tokenizer):
    """The same weights give the same logits as transformers runs them (llama.cpp: through the GGUF writer)."""
    for row in token_rows(tokenizer):
        logits, _ = backend.forward_sequence(row)
        with torch.no_grad():
            expected = model(torch.tensor([row])).logits[0]
        assert close(logits, expected, kind)


def token_rows(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def close(a, b, kind):
    return torch.allclose(a.float(), b.float(), atol=TOLERANCE[kind], rtol=0)


@pytest.mark.parametrize("rope, length", [
    (None, 512),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),  # Qwen2.5's long contexts
    ({"rope_type": "dynamic", "factor": 2.0}, 1024),
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 128}, 512),  # Llama 3's scaling is counted in its positions already
])
def test_a_torch_models_context_is_its_positions_times_its_rope_scaling(rope, length):
    """As vLLM derives max_model_len: a model extended by RoPE scaling reads past `max_position_embeddings`, and
    requests up to the extended length are not refused."""
    from transformers import Qwen2Config

    from roads_to_rome.backends.torch_backend import context_length

    config = Qwen2Config(max_position_embeddings=512, **({"rope_scaling": rope} if rope else {}))
    assert context_length(config) == length


def test_it_implements_the_protocol(backend, tokenizer):
    assert isinstance(backend, Backend)
    assert backend.vocab_size == len(tokenizer) and backend.hidden_size == 32
    assert backend.num_params > 0 and backend.max_context > 0
    assert backend.embedding_table().shape[0] >= backend.vocab_size
    assert backend.embed(torch.tensor([1, 2])).shape == (2, backend.embedding_table().shape[1])


def test_llamacpps_embedding_table_is_the_files_as_gguf_py_reads_it(tokenizer, tmp_path):
    """The router's embedding table on llama.cpp is found by ggml's own GGUF reader and converted by ggml's own
    dequantization (C), not gguf-py's (Python: seconds for a real vocabulary): the same bytes, the same values, for a
    float32 table and a quantized one; a file llama.cpp cannot read is an error that says so."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from roads_to_rome.backends.llamacpp import dequantized, tensor_bytes
    from roads_to_rome.bench.shape_models import quantize

    slm = make_backend("llamacpp", tiny_model(tokenizer, hidden=32, seed=0), tokenizer, tmp_path, "slm")
    kinds = []
    for path in (slm.path, quantize(slm.path, tmp_path / "q8_0.gguf", ftype=7)):  # LLAMA_FTYPE_MOSTLY_Q8_0
        (tensor,) = [t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight"]
        raw, kind = tensor_bytes(path, "token_embd.weight")
        assert kind == tensor.tensor_type and np.array_equal(raw, tensor.data.reshape(-1).view(np.uint8))
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        assert np.array_equal(dequantized(raw, kind), expected)
        kinds.append(tensor.tensor_type.name)
    assert kinds == ["F32", "Q8_0"]
    assert torch.equal(slm.embedding_table(), torch.from_numpy(dequantized(*tensor_bytes(
        slm.path, "token_embd.weight"))).reshape(-1, slm.hidden_size).to(torch.bfloat16))
    (tmp_path / "not.gguf").write_bytes(b"not a gguf file" * 100)
    with pytest.raises(R2RError, match="is not a GGUF file"):
        tensor_bytes(tmp_path / "not.gguf", "token_embd.weight")
    with pytest.raises(R2RError, match="has no tensor"):
        tensor_bytes(slm.path, "no_such.weight")


def test_ggmls_dequantization_gives_gguf_pys_values_for_a_q4_k_m_file_and_its_bf16_copy(tokenizer, tmp_path,
                                                                                         monkeypatch):
    """The bf16 copy of a GGUF file (what torch and vLLM read, `convert_gguf`) is transformers' reading of it, with
    gguf-py's numpy dequantization swapped for ggml's own while it reads (`ggml_dequantization`): the same values for
    every tensor of a Q4_K_M file (k-quants, their fallbacks and float32 norms), so the same copy; and the file's
    header is parsed once, though transformers asks for it twice (config, weights)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    import gguf
    from transformers import AutoModelForCausalLM

    from roads_to_rome.backends.llamacpp import ggml_dequantization, gguf_py_dequantize
    from roads_to_rome.bench.shape_models import quantize
    from roads_to_rome.models.packaged import convert_gguf

    # hidden 256: k-quants need rows of 256
    source = make_backend("llamacpp", tiny_model(tokenizer, hidden=256, seed=0), tokenizer, tmp_path, "f32").path
    path = quantize(source, tmp_path / "q4_k_m.gguf")
    kinds = set()
    for tensor in gguf.GGUFReader(str(path)).tensors:
        assert np.array_equal(gguf_py_dequantize(tensor.data, tensor.tensor_type),
                              gguf.dequantize(tensor.data, tensor.tensor_type)), tensor.name
        kinds.add(tensor.tensor_type.name)
    assert {"Q4_K", "F32"} <= kinds, kinds

    own = gguf.dequantize
    with ggml_dequantization():
        assert gguf.dequantize is gguf_py_dequantize
    assert gguf.dequantize is own
    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args):
            parsed.append(path)
            super().__init__(path, *args)

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    copy = convert_gguf(path, tmp_path / "bf16", {}, tmp_path / "tokenizer")
    assert len(parsed) == 1, parsed
    assert gguf.GGUFReader is CountingReader and gguf.dequantize is own  # both put back
    monkeypatch.undo()
    fast = AutoModelForCausalLM.from_pretrained(str(copy), dtype=torch.bfloat16).state_dict()
    slow = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.bfloat16).state_dict()
    assert fast.keys() == slow.keys() and all(torch.equal(fast[k], slow[k]) for k in fast)


def test_a_local_model_decodes_token_by_token_and_complete_reads_nothing(backend, tokenizer):
    """`complete` is for a model that writes whole continuations in one go (a server); a local one says None and
    leaves the cache as it was, for the caller to step `forward`."""
    cache, rows = backend.new_cache(), token_rows(tokenizer)[:1]
    ids = torch.tensor(rows, device=backend.device)
    assert backend.complete(cache, ids, torch.ones_like(ids), 8) is None
    assert cache.length == 0
    assert backend.health() is None


def test_it_names_the_kernels_it_runs_with(backend, kind):
    from roads_to_rome.hardware import cpu

    if kind == "llamacpp":
        from roads_to_rome.backends.llamacpp import compiled_features

        assert backend.kernels.startswith("llama.cpp ")
        if "avx512f" in cpu()[1]:  # a native build uses the widest vector unit of the CPU it was built on
            assert "AVX512" in compiled_features()
        assert ("REPACK (off)" in backend.kernels) == ("AMX_INT8" in compiled_features())
    else:
        assert backend.kernels == f"torch {torch.__version__} float32 {torch.backends.cpu.get_cpu_capability()}"


def test_eos_ids_hold_the_models_end_of_turn(backend, tokenizer):
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in backend.eos_ids


def test_batched_forward_agrees_with_forward_sequence_of_each_row(backend, kind, tokenizer):
    rows = token_rows(tokenizer)
    ids, mask = left_pad(rows, tokenizer.pad_token_id, backend.device)
    cache = backend.new_cache()
    logits, hidden = backend.forward(cache, ids, mask)
    assert cache.length == ids.shape[1]
    assert logits.shape == (len(rows), len(tokenizer)) and logits.dtype == torch.float32
    for i, row in enumerate(rows):
        ref_logits, ref_hidden = backend.forward_sequence(row)
        assert close(logits[i], ref_logits[-1], kind) and close(hidden[i], ref_hidden[-1], kind)


def test_read_takes_columns_in_without_outputs(backend, kind, tokenizer):
    rows = token_rows(tokenizer)
    ids, mask = left_pad(rows, tokenizer.pad_token_id, backend.device)
    cache = backend.new_cache()
    assert backend.read(cache, ids[:, :-2], mask[:, :-2]) is None and cache.length == ids.shape[1] - 2
    logits, _ = backend.forward(cache, ids[:, -2:], mask)
    whole, _ = backend.forward(backend.new_cache(), ids, mask)
    assert close(logits, whole, kind)


def test_forward_all_gives_every_new_position(backend, kind, tokenizer):
    rows = token_rows(tokenizer)
    ids, mask = left_pad(rows, tokenizer.pad_token_id, backend.device)
    cache = backend.new_cache()
    backend.forward(cache, ids[:, :3], mask)  # the first columns, then every other at once
    logits = backend.forward_all(cache, ids[:, 3:], mask)
    assert logits.shape == (len(rows), ids.shape[1] - 3, len(tokenizer))
    for i, row in enumerate(rows):
        pad = ids.shape[1] - len(row)
        ref, _ = backend.forward_sequence(row)
        for column in range(3, ids.shape[1]):
            if column < pad:
                assert not logits[i, column - 3].any()  # padding: zeros
            else:
                assert close(logits[i, column - 3], ref[column - pad], kind), (i, column)


def test_forward_all_keeps_only_the_last_columns_asked_for(backend, kind, tokenizer):
    rows = token_rows(tokenizer)
    ids, mask = left_pad(rows, tokenizer.pad_token_id, backend.device)
    every = backend.forward_all(backend.new_cache(), ids, mask)
    last = backend.forward_all(backend.new_cache(), ids, mask, keep_last=4)
    assert last.shape == (len(rows), 4, len(tokenizer)) and close(last, every[:, -4:], kind)


def test_shift_rows_moves_a_row_right_as_if_it_had_fewer_tokens(backend, kind, tokenizer):
    """What verification's rollback does: row 0 drops its last 3 tokens and gains 3 columns of left padding."""
    rows = token_rows(tokenizer)
    cache, ids, mask = prefilled(backend, rows, tokenizer)
    backend.shift_rows(cache, [3, 0, 0])
    assert cache.length == ids.shape[1]
    ids[0], mask[0] = ids[0].roll(3), mask[0].roll(3)
    ids[0, :3], mask[0, :3] = tokenizer.pad_token_id, 0
    logits, _, _ = continue_one(backend, cache, ids, mask, token=7)
    assert close(logits[0], backend.forward_sequence(rows[0][:-3] + [7])[0][-1], kind)
    assert close(logits[1], backend.forward_sequence(rows[1] + [7])[0][-1], kind)


def test_a_row_shifted_by_its_whole_length_keeps_nothing_and_reads_again(backend, kind, tokenizer):
    """A row that stands still while the LLM is away is shifted once per step, past what the cache holds: the cache
    keeps nothing of it, and reading its columns again from the start gives its logits."""
    rows = token_rows(tokenizer)
    cache, ids, mask = prefilled(backend, rows, tokenizer)
    width = ids.shape[1]
    backend.shift_rows(cache, [width + 5, 0, 0])
    assert cache.length == width
    # The batch's row 0 is now all padding up to the cache's length; its tokens come again after it (the other rows
    # read the same tokens after theirs: only row 0 is checked).
    more = torch.tensor([rows[0]] * ids.shape[0], device=backend.device)
    mask0 = torch.cat([mask, torch.ones_like(more)], dim=1)
    mask0[0, :width] = 0
    logits = backend.forward_all(cache, more, mask0)
    assert close(logits[0, -1], backend.forward_sequence(rows[0])[0][-1], kind)


def test_forward_sequence_from_a_start_position(backend, kind, tokenizer):
    row = token_rows(tokenizer)[2]
    logits, hidden = backend.forward_sequence(row)
    tail_logits, tail_hidden = backend.forward_sequence(row, start=5)
    assert tail_logits.shape[0] == len(row) - 5
    assert close(tail_logits, logits[5:], kind) and close(tail_hidden, hidden[5:], kind)


def test_a_sequence_scored_into_a_cache_is_a_read_decoding_goes_on_from(backend, kind, tokenizer):
    """A prompt scored as it is read (`score_sequence`): the outputs of `forward_sequence`, handed over a chunk at a
    time, in order, and the cache then holds the row as a read would."""
    row = token_rows(tokenizer)[2] * 30  # longer than a chunk
    assert len(row) > SCORE_CHUNK
    logits, hidden = backend.forward_sequence(row)
    cache, chunks = backend.new_cache(), []
    backend.score_sequence(row, cache, lambda first, lg, hd: chunks.append((first, lg.clone(), hd.clone())))
    assert [first for first, _, _ in chunks] == list(range(0, len(row), SCORE_CHUNK))
    assert max(len(lg) for _, lg, _ in chunks) <= SCORE_CHUNK
    assert cache.length == len(row)
    assert close(torch.cat([lg for _, lg, _ in chunks]), logits, kind)
    assert close(torch.cat([hd for _, _, hd in chunks]), hidden, kind)
    ids = torch.tensor([row + [7]], device=backend.device)
    next_logits, _ = backend.forward(cache, ids[:, -1:], torch.ones_like(ids))
    assert close(next_logits[0], backend.forward_sequence(row + [7])[0][-1], kind)


def continue_one(backend, cache, ids, mask, token):
    """Read one more column holding `token` in every row; logits at it."""
    column = torch.full((ids.shape[0], 1), token, dtype=torch.long, device=backend.device)
    ids = torch.cat([ids, column], dim=1)
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return backend.forward(cache, ids[:, cache.length :], mask)[0], ids, mask


def test_rows_can_leave_a_cache_before_its_first_read(backend, kind, tokenizer):
    """With overlap, rows may finish before the LLM's first call has read anything: their cache holds nothing yet,
    and the rows left read as if alone."""
    rows = token_rows(tokenizer)
    cache = backend.new_cache()
    backend.select_rows(cache, torch.tensor([2, 0]))
    ids, mask = left_pad([rows[2], rows[0]], tokenizer.pad_token_id, backend.device)
    logits = backend.forward_all(cache, ids, mask)
    assert close(logits[0, -1], backend.forward_sequence(rows[2])[0][-1], kind)
    assert close(logits[1, -1], backend.forward_sequence(rows[0])[0][-1], kind)


def test_select_append_and_pad_rows_keep_each_row_as_if_alone(backend, kind, tokenizer):
    rows = token_rows(tokenizer)
    alone = [continue_one(backend, *prefilled(backend, [r], tokenizer), token=7)[0][0] for r in rows]
    # select: drop the middle row, keep the others in swapped order
    cache, ids, mask = prefilled(backend, rows, tokenizer)
    keep = torch.tensor([2, 0])
    backend.select_rows(cache, keep)
    logits, _, _ = continue_one(backend, cache, ids[keep], mask[keep], token=7)
    assert close(logits[0], alone[2], kind) and close(logits[1], alone[0], kind)
    # pad + append: a short row's cache widened to a long one's, then joined to it
    long_cache, long_ids, long_mask = prefilled(backend, [rows[2]], tokenizer)
    short_cache, short_ids, short_mask = prefilled(backend, [rows[0]], tokenizer)
    n = long_ids.shape[1] - short_ids.shape[1]
    backend.pad_left(short_cache, n)
    assert short_cache.length == long_cache.length
    short_ids, short_mask = pad_columns_left(short_ids, short_mask, n, tokenizer.pad_token_id)
    backend.append_rows(long_cache, short_cache)
    logits, _, _ = continue_one(backend, long_cache, torch.cat([long_ids, short_ids]),
                                torch.cat([long_mask, short_mask]), token=7)
    assert close(logits[0], alone[2], kind) and close(logits[1], alone[0], kind)


def test_a_static_cache_keeps_its_buffers_as_rows_leave_and_join(backend, kind, tokenizer):
    """CUDA graphs replay over a static cache's buffers: rows that leave leave their slots behind (the buffers, and
    the graphs over them, stay), rows that join fill them, and only a batch larger than its slots moves to larger
    buffers, giving the old ones back to the pool for the next cache of that shape. Each row reads on as before."""
    if kind != "torch-static":
        pytest.skip("a static cache's buffers")
    rows = token_rows(tokenizer)
    cache, ids, mask = prefilled(backend, rows, tokenizer)
    kv = cache.kv
    keep = torch.tensor([2, 0])
    backend.select_rows(cache, keep)
    _, ids, mask = continue_one(backend, cache, ids[keep], mask[keep], token=7)
    assert cache.kv is kv and (cache.rows, kv.rows) == (2, 3)
    backend.append_rows(cache, backend.copy_rows(cache, [1]))  # three rows: the slots it has
    assert cache.kv is kv and cache.rows == 3
    backend.append_rows(cache, backend.copy_rows(cache, [0]))  # four: larger buffers, rows to a power of two
    assert cache.kv is not kv and (cache.rows, cache.kv.rows) == (4, 4)
    assert any(kv in free for free in backend.pool.free.values())
    logits, _, _ = continue_one(backend, cache, ids[[0, 1, 1, 0]], mask[[0, 1, 1, 0]], token=9)
    assert close(logits[2], logits[1], kind) and close(logits[3], logits[0], kind)
    single, single_ids, single_mask = prefilled(backend, [rows[0]], tokenizer)
    _, single_ids, single_mask = continue_one(backend, single, single_ids, single_mask, token=7)
    assert close(logits[1], continue_one(backend, single, single_ids, single_mask, token=9)[0][0], kind)


def test_copied_rows_go_on_apart_and_leave_the_source_as_it_was(backend, kind, tokenizer):
    rows = token_rows(tokenizer)
    alone = [continue_one(backend, *prefilled(backend, [r], tokenizer), token=t)[0][0] for r, t in
             ((rows[1], 7), (rows[1], 9), (rows[0], 7))]
    cache, ids, mask = prefilled(backend, rows[:2], tokenizer)
    copies = backend.copy_rows(cache, [1, 1, 0])
    assert copies.length == cache.length
    column = torch.tensor([[7], [9], [7]], device=backend.device)
    mask3 = torch.cat([mask[[1, 1, 0]], mask.new_ones(3, 1)], dim=1)
    logits, _ = backend.forward(copies, column, mask3)
    for i in range(3):
        assert close(logits[i], alone[i], kind)
    del copies  # the source still reads on as if nothing had been copied
    logits, _, _ = continue_one(backend, cache, ids, mask, token=9)
    assert close(logits[0], continue_one(backend, *prefilled(backend, [rows[0]], tokenizer), token=9)[0][0], kind)
    assert close(logits[1], alone[1], kind)


def test_a_row_copied_out_of_its_batch_and_trimmed_of_its_padding_reads_on_alone(backend, kind, tokenizer):
    """What prefix caching keeps of a finished row: copied out of a left-padded batch and its padding trimmed, it
    reads on, and is cut back, as the row read alone would be."""
    rows = token_rows(tokenizer)
    cache, ids, mask = prefilled(backend, rows, tokenizer)
    short = min(range(len(rows)), key=lambda i: len(rows[i]))
    pad = ids.shape[1] - len(rows[short])
    assert pad > 0
    alone = backend.copy_rows(cache, [short])
    backend.trim_left(alone, pad)
    assert alone.length == len(rows[short])
    for keep, token in ((alone.length, 7), (3, 9)):
        backend.truncate(alone, keep)
        logits, _ = backend.forward(alone, torch.tensor([[token]], device=backend.device),
                                    torch.ones(1, keep + 1, dtype=torch.long, device=backend.device))
        assert close(logits[0], backend.forward_sequence(rows[short][:keep] + [token])[0][-1], kind)


def prefilled(backend, rows, tokenizer):
    ids, mask = left_pad(rows, tokenizer.pad_token_id, backend.device)
    cache = backend.new_cache()
    backend.forward(cache, ids, mask)
    return cache, ids, mask


def test_truncate_then_continue_equals_a_fresh_cache(backend, kind, tokenizer):
    ids = torch.tensor([token_rows(tokenizer)[0]], device=backend.device)
    mask = torch.ones_like(ids)
    cache = backend.new_cache()
    backend.forward(cache, ids, mask)
    backend.truncate(cache, 3)
    assert cache.length == 3
    logits, hidden = backend.forward(cache, ids[:, 3:6], mask[:, :6])
    fresh_logits, fresh_hidden = backend.forward(backend.new_cache(), ids[:, :6], mask[:, :6])
    assert close(logits, fresh_logits, kind) and close(hidden, fresh_hidden, kind)
    assert mask_for(cache, 2, backend.device).shape == (1, 8)
    backend.truncate(cache, 0)  # all the way: the cache is as good as new
    assert cache.length == 0
    logits, hidden = backend.forward(cache, ids[:, :6], mask[:, :6])
    assert close(logits, fresh_logits, kind) and close(hidden, fresh_hidden, kind)


@pytest.fixture(scope="module")
def padded_pair(kind, tokenizer, tmp_path_factory):
    """An SLM whose head has exactly the tokenizer's rows and an LLM with 20 padding rows more, whose
    padding rows would win every argmax if they were ever read (as in DeepSeek-R1-Distill-Qwen 1.5B
    with 151,936 rows against 32B with 152,064, one tokenizer)."""
    folder = tmp_path_factory.mktemp("padded")
    slm_model = tiny_model(tokenizer, hidden=32, seed=0)
    llm_model = tiny_model(tokenizer, hidden=64, seed=1, vocab_rows=len(tokenizer) + 20)
    with torch.no_grad():
        llm_model.lm_head.weight[len(tokenizer):] = 50.0
        llm_model.model.embed_tokens.weight[len(tokenizer):] = 0.0
    return (make_backend(kind, slm_model, tokenizer, folder, "slm"),
            make_backend(kind, llm_model, tokenizer, folder, "llm"))


def test_pairs_whose_heads_differ_in_padding_rows_work(padded_pair, tokenizer):
    slm, llm = padded_pair
    assert slm.vocab_size == llm.vocab_size == len(tokenizer)
    assert llm.embedding_table().shape[0] == len(tokenizer) + 20
    for policy in (AlwaysLLM(), RandomPolicy(0.5, seed=0)):
        engine = Engine(slm, llm, tokenizer, policy)
        prompts = [engine.prompts.chat(p) for p in PROMPTS]
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
        for gen in engine.generate(prompts, params):
            assert len(gen.token_ids) == 12 and max(gen.token_ids) < len(tokenizer)
            assert "llm" in gen.sources


def test_a_pair_whose_logits_do_not_line_up_is_refused(tokenizer, slm):
    wide = TorchBackend(tiny_model(tokenizer, hidden=64, seed=1, vocab_rows=len(tokenizer) + 20))  # no vocab_size
    with pytest.raises(R2RError, match="vocab_size"):
        Engine(slm, wide, tokenizer, AlwaysLLM())


def test_one_compile_of_the_trunk_serves_every_batch_and_read_width_above_one(slm):
    """torch.compile's trunk (the graphs' on CUDA) sees the batch's rows and a read's width as symbolic sizes: batches
    of one and of more rows, one-token reads and longer ones compile once each, whatever their sizes and order."""
    from roads_to_rome.backends.static_cache import real_columns

    backend = TorchBackend(slm.model, name="tiny", static=True, pad_reads=True)
    compiles = []

    def counting(graph, inputs):
        compiles.append(graph)
        return graph.forward

    trunk = torch.compile(backend.trunk, backend=counting)
    with torch.inference_mode():
        for rows, size in [(4, 16), (4, 1), (4, 2), (8, 16), (8, 1), (8, 4), (16, 1), (32, 2), (3, 1), (1, 1),
                           (1, 2), (1, 16), (1, 1)]:
            cache = backend.new_cache()
            kv = backend._reserve(cache, rows, 64)
            ids = torch.randint(0, 100, (rows, size))
            real = real_columns(torch.ones(rows, 40 + size, dtype=torch.bool), kv.capacity)
            expected = backend._trunk(kv, ids, real, torch.full((1,), 40))
            assert torch.allclose(backend._trunk(kv, ids, real, torch.full((1,), 40), trunk), expected, atol=1e-5)
    assert len(compiles) == 4
