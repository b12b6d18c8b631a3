"""The backend contract (base.py) on llama.cpp, running the GGUF files as shipped.

llama.cpp keeps one KV cache per context, shared by numbered sequences. A batch row is one
sequence; `LlamaCache` records which sequence each row owns and how many left-padding columns
precede its first real token (llama.cpp has no padding: a row's column c is its position
c - pad). The context is made with `embeddings=True` and no pooling, so one `llama_decode`
gives both the logits and the last hidden state (`result_norm`: after the final norm, before
the output head, the same tensor the torch backend's trunk returns) at the positions asked for.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from roads_to_rome.backends.base import SCORE_CHUNK, ChunkVisitor, LocalBackend
from roads_to_rome.errors import R2RError

try:
    import llama_cpp
except ImportError as e:  # the wheel is built from source at install time; it may have failed
    llama_cpp = None
    IMPORT_ERROR = str(e)


MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ in llama.cpp (src/llama-cparams.h): sequences one context holds


@dataclass
class LlamaCache:
    seqs: list[int] = field(default_factory=list)  # row -> llama.cpp sequence id
    pads: list[int] = field(default_factory=list)  # row -> left-padding columns before its first token
    length: int = 0  # columns of the token streams already read


def serialized(method):
    """A method of the backend that touches its llama.cpp context, run by one thread at a time. The context, its KV
    memory and its one batch buffer are not thread-safe, and two threads can reach them: an engine whose LLM runs on a
    worker (--overlap) finishes what it queued (rows given back) while another engine on the same backend reads, and a
    dropped cache gives its sequences back in whichever thread drops it."""

    @functools.wraps(method)
    def one_at_a_time(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return one_at_a_time


@functools.cache  # the build a process loaded does not change
def compiled_features() -> tuple[str, ...]:
    """What this build of llama.cpp compiled in for the CPU (its system info: AVX2, AVX512, AMX_INT8, REPACK...)."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return tuple(name.strip() for name, _, value in (item.partition("=") for item in info.split("|"))
                 if value.strip() == "1" and name.strip())


def amx_compiled() -> bool:
    return "AMX_INT8" in compiled_features()


def model_params():
    """llama.cpp's default model parameters, safe with this build."""
    params = llama_cpp.llama_model_default_params()
    # A build with AMX compiled in (on Intel Sapphire Rapids and later, unless set-up compiled it out) repacks
    # weights into its AMX buffer type, whose matmul crashes the process at the first decode (llama-cpp-python
    # 0.3.36, Q4_K_M). Extra buffer types are left on otherwise: they hold the faster repacked layouts.
    params.use_extra_bufts = not amx_compiled()
    return params


def kernels() -> str:
    """The CPU kernels this build runs a model with: its vector units and whether the repacked layouts are on."""
    wanted = [f for f in compiled_features() if f.startswith(("AVX", "AMX", "SVE", "NEON", "REPACK"))]
    if amx_compiled():  # extra buffer types off (model_params): neither AMX nor the repacked layouts run
        wanted = [f"{f} (off)" if f.startswith("AMX") or f == "REPACK" else f for f in wanted]
    return "llama.cpp " + " ".join(wanted)


def llama_cpp_available() -> bool:
    return llama_cpp is not None


class LlamaCppBackend(LocalBackend):
    device = torch.device("cpu")  # tensors handed to the engine live on the CPU
    full_logits = True
    grouped_reads = False  # its CPU kernels read k columns in about k times one column's time

    def __init__(self, gguf_file: str | Path, name: str = "model", n_ctx: int = 16384, max_rows: int = 16,
                 n_threads: int | None = None, n_batch: int = 512, vocab_size: int | None = None):
        """`vocab_size`: the tokenizer's size (default: every token of the GGUF's vocabulary)."""
        if llama_cpp is None:
            raise R2RError(f"the llama.cpp backend is not available ({IMPORT_ERROR}); install it with "
                           "pip install \"roads-to-rome[llamacpp]\" (it compiles llama.cpp) or use --backend torch")
        if not 1 <= max_rows <= MAX_SEQUENCES:
            raise R2RError(f"llama.cpp holds 1 to {MAX_SEQUENCES} sequences per context, asked for {max_rows}: "
                           "lower the batch size (--max-batch)")
        path = Path(gguf_file).expanduser()
        if not path.is_file() or path.suffix != ".gguf":
            raise R2RError(f"the llama.cpp backend needs a .gguf file, got {gguf_file}")
        self.name, self.path, self.n_batch = name, path, n_batch
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params())
        if not self._model:
            raise R2RError(f"llama.cpp cannot load {path}: not a valid GGUF model file")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max = max_rows
        # The cores this process may use (`taskset` pins it to fewer than the machine has).
        params.n_threads = params.n_threads_batch = n_threads or len(os.sched_getaffinity(0)) or 1
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        # One KV pool shared by all rows: any row may grow to n_ctx, as long as the batch fits in it.
        params.kv_unified = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise R2RError(f"llama.cpp cannot create a context for {path} (n_ctx={n_ctx})")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)  # the output head's rows
        self.vocab_size = min(vocab_size or self.n_vocab, self.n_vocab)
        self.hidden_size = llama_cpp.llama_model_n_embd(self._model)
        self.num_params = llama_cpp.llama_model_n_params(self._model)
        self.n_ctx = self.kv_capacity = n_ctx  # the KV pool every row shares
        # One row may grow to the whole pool, but not past the context the model was trained for.
        self.max_context = min(n_ctx, llama_cpp.llama_model_n_ctx_train(self._model) or n_ctx)
        self.max_rows = max_rows
        self.kernels = kernels()
        self.eos_ids = {t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)}
        self._free_seqs = list(range(max_rows))[::-1]
        self._embedding_table = None
        self._lock = threading.RLock()  # (`serialized`; reentrant: a cache dropped inside a call gives its rows back)

    # --- caches: rows are llama.cpp sequences -------------------------------------------------
    def new_cache(self) -> LlamaCache:
        cache = LlamaCache()
        # A cache dropped by its batch gives its sequences back (CPython frees it at once).
        weakref.finalize(cache, self._release, cache.seqs)
        return cache

    @serialized
    def _release(self, seqs: list[int]) -> None:
        for s in seqs:
            llama_cpp.llama_memory_seq_rm(self._memory, s, -1, -1)
            self._free_seqs.append(s)
        seqs.clear()

    def _ensure_rows(self, cache: LlamaCache, rows: int) -> None:
        while len(cache.seqs) < rows:
            if not self._free_seqs:
                raise R2RError(f"the llama.cpp backend of {self.name} has no sequence free for a row of {rows}: it "
                               f"holds {self.max_rows}, {self.max_rows - len(cache.seqs)} of them in use elsewhere; "
                               "lower the batch size")
            cache.seqs.append(self._free_seqs.pop())
            cache.pads.append(0)

    @serialized
    def select_rows(self, cache: LlamaCache, rows: torch.Tensor) -> None:
        if not cache.seqs:  # nothing read yet: its rows come with its first read
            return
        keep = rows.tolist()
        kept = set(keep)
        dropped = [s for i, s in enumerate(cache.seqs) if i not in kept]
        cache.seqs[:] = [cache.seqs[i] for i in keep]
        cache.pads[:] = [cache.pads[i] for i in keep]
        self._release(dropped)

    @serialized
    def copy_rows(self, cache: LlamaCache, rows: list[int]) -> LlamaCache:
        # The pool is unified: a copied sequence shares the source's KV cells, nothing is recomputed or moved.
        new = self.new_cache()
        self._ensure_rows(new, len(rows))
        for seq, row in zip(new.seqs, rows):
            llama_cpp.llama_memory_seq_cp(self._memory, cache.seqs[row], seq, -1, -1)
        new.pads[:] = [cache.pads[row] for row in rows]
        new.length = cache.length
        return new

    @serialized
    def append_rows(self, cache: LlamaCache, other: LlamaCache) -> None:
        assert cache.length == other.length, "caches must cover the same columns"
        cache.seqs += other.seqs
        cache.pads += other.pads
        other.seqs.clear()  # now owned by `cache`
        other.pads.clear()

    def pad_left(self, cache: LlamaCache, n: int) -> None:
        if cache.length:
            cache.pads[:] = [p + n for p in cache.pads]
            cache.length += n

    @serialized
    def truncate(self, cache: LlamaCache, length: int) -> None:
        if length < cache.length:
            for seq, pad in zip(cache.seqs, cache.pads):
                llama_cpp.llama_memory_seq_rm(self._memory, seq, max(0, length - pad), -1)
            cache.length = length

    def trim_left(self, cache: LlamaCache, n: int) -> None:
        # Padding is bookkeeping here: a row's column c sits at position c - pad before and after.
        if n and cache.length:
            cache.pads[:] = [p - n for p in cache.pads]
            cache.length -= n

    @serialized
    def shift_rows(self, cache: LlamaCache, shifts: list[int]) -> None:
        # A row's column c sits at position c - pad: one more padding column per shift keeps every kept
        # token's position, so only the dropped tail leaves the sequence.
        for row, d in enumerate(shifts):
            if d:
                keep = cache.length - d - cache.pads[row]  # positions the row keeps
                llama_cpp.llama_memory_seq_rm(self._memory, cache.seqs[row], max(0, keep), -1)
                cache.pads[row] += d

    # --- forward passes -------------------------------------------------------------------------
    def _feed(self, cache: LlamaCache, new_ids: torch.Tensor, attention_mask: torch.Tensor,
              every_from: int | None = None):
        """Feed the new columns of every row in one llama_decode (chunked by n_batch); yield
        (output index, row, new column) for each row's last real token, or with `every_from` for every
        real one from that new column on."""
        start, n_new = cache.length, new_ids.shape[1]
        rows = new_ids.shape[0]
        self._ensure_rows(cache, rows)
        mask = attention_mask[:, : start + n_new].cpu()
        ids = new_ids.cpu().tolist()
        tokens = []  # (token, position, sequence, wants output, (row, new column))
        for b in range(rows):
            pad = int((mask[b] == 0).sum())
            cache.pads[b] = pad
            real = range(max(start, pad), start + n_new)
            for c in real:
                wants = c == real[-1] if every_from is None else c - start >= every_from
                tokens.append((ids[b][c - start], c - pad, cache.seqs[b], wants, (b, c - start)))
        for out_index, (row, column) in self._decode(tokens):
            yield out_index, row, column
        cache.length = start + n_new

    @serialized
    def forward(self, cache: LlamaCache, new_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Logits [B, V] f32 and hidden [B, H] at each row's last real token (zeros for a row with none yet)."""
        logits = torch.zeros(new_ids.shape[0], self.vocab_size)
        hidden = torch.zeros(new_ids.shape[0], self.hidden_size)
        for out_index, row, _ in self._feed(cache, new_ids, attention_mask):
            logits[row] = self._logits(out_index)
            hidden[row] = self._hidden(out_index)
        return logits, hidden

    @serialized
    def forward_all(self, cache: LlamaCache, new_ids: torch.Tensor, attention_mask: torch.Tensor,
                    keep_last: int | None = None, row_keep: list[int] | None = None) -> torch.Tensor:
        skip = 0 if keep_last is None else new_ids.shape[1] - keep_last  # new columns whose logits nobody wants
        logits = torch.zeros(new_ids.shape[0], new_ids.shape[1] - skip, self.vocab_size)
        for out_index, row, column in self._feed(cache, new_ids, attention_mask, every_from=skip):
            logits[row, column - skip] = self._logits(out_index)
        return logits

    @serialized
    def forward_sequence(self, ids: list[int], start: int = 0):
        cache = self.new_cache()
        self._ensure_rows(cache, 1)
        seq = cache.seqs[0]
        logits = torch.empty(len(ids) - start, self.vocab_size)
        hidden = torch.empty(len(ids) - start, self.hidden_size)
        for out_index, row in self._decode([(t, p, seq, p >= start, p - start) for p, t in enumerate(ids)]):
            logits[row] = self._logits(out_index)
            hidden[row] = self._hidden(out_index)
        cache.length = len(ids)
        return logits, hidden

    @serialized
    def score_sequence(self, ids: list[int], cache: LlamaCache, each_chunk: ChunkVisitor) -> None:
        self._ensure_rows(cache, 1)
        seq, size = cache.seqs[0], min(len(ids), SCORE_CHUNK)
        logits, hidden = torch.empty(size, self.vocab_size), torch.empty(size, self.hidden_size)
        # (SCORE_CHUNK tokens a call: llama.cpp holds a call's logits twice, [tokens, V] float32 in its output and
        # compute buffers)
        for out_index, p in self._decode([(t, p, seq, True, p) for p, t in enumerate(ids)], SCORE_CHUNK):
            logits[p % size], hidden[p % size] = self._logits(out_index), self._hidden(out_index)
            if p % size == size - 1 or p == len(ids) - 1:  # (positions come in order)
                first = p - p % size
                each_chunk(first, logits[: p - first + 1], hidden[: p - first + 1])
        cache.length = len(ids)

    def _decode(self, tokens: list[tuple[int, int, int, bool, int]], most: int | None = None):
        """Run llama_decode over (token, position, sequence, wants output, tag) in chunks of n_batch (or `most`,
        if fewer); yield (output index in its chunk, tag) for each output, right after its chunk ran."""
        batch, size = self._batch, min(self.n_batch, most or self.n_batch)
        for lo in range(0, len(tokens), size):
            chunk = tokens[lo : lo + size]
            for i, (token, position, seq, wants, _) in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = position
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = wants
            batch.n_tokens = len(chunk)
            status = llama_cpp.llama_decode(self._ctx, batch)
            if status != 0:
                raise R2RError(f"llama.cpp decode failed on {self.name} (status {status}): the KV cache "
                               f"(n_ctx={self.n_ctx}) is full or the batch is invalid")
            for i, (*_, wants, tag) in enumerate(chunk):
                if wants:
                    yield i, tag

    def _logits(self, i: int) -> torch.Tensor:
        pointer = llama_cpp.llama_get_logits_ith(self._ctx, i)
        # The first vocab_size of the head's n_vocab rows: the tokenizer's ids only.
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)))

    def _hidden(self, i: int) -> torch.Tensor:
        pointer = llama_cpp.llama_get_embeddings_ith(self._ctx, i)
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(self.hidden_size,)))

    # --- the token-embedding table, for the router ----------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the token-embedding table, dequantized from the GGUF file on demand."""
        table = self.embedding_table()
        return table[token_ids.cpu()]

    def embedding_table(self) -> torch.Tensor:
        if self._embedding_table is None:
            table = dequantized(*tensor_bytes(self.path, "token_embd.weight")).reshape(-1, self.hidden_size)
            # bf16, as the torch backend loads it: the router's embedding hash must agree across backends.
            self._embedding_table = torch.from_numpy(table).to(torch.bfloat16)
        return self._embedding_table

    def __del__(self):
        if llama_cpp is not None and getattr(self, "_ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            llama_cpp.llama_model_free(self._model)
            self._ctx = None


class _GGUFParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


class _TypeTraits(ctypes.Structure):  # ggml.h's struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool),
                ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)),
                ("from_float_ref", ctypes.c_void_p)]


@functools.cache
def _gguf_library():
    """ggml's GGUF reader (C), as libllama's handle finds it in the ggml library it links."""
    lib = llama_cpp.llama_cpp._lib
    lib.gguf_init_from_file.restype, lib.gguf_init_from_file.argtypes = ctypes.c_void_p, [ctypes.c_char_p,
                                                                                           _GGUFParams]
    for function, result in (("gguf_find_tensor", ctypes.c_int64), ("gguf_get_tensor_offset", ctypes.c_size_t),
                             ("gguf_get_tensor_size", ctypes.c_size_t), ("gguf_get_tensor_type", ctypes.c_int)):
        getattr(lib, function).restype, getattr(lib, function).argtypes = result, [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_find_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.gguf_get_data_offset.restype, lib.gguf_get_data_offset.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    lib.gguf_free.restype, lib.gguf_free.argtypes = None, [ctypes.c_void_p]
    lib.ggml_get_type_traits.restype, lib.ggml_get_type_traits.argtypes = ctypes.POINTER(_TypeTraits), [ctypes.c_int]
    return lib


def tensor_bytes(path: Path, name: str) -> tuple[np.ndarray, int]:
    """One tensor's bytes in a GGUF file (mapped, not read) and its ggml type, found by ggml's own GGUF reader:
    gguf-py's reader parses every metadata value in Python, seconds for a 150k-token vocabulary's."""
    lib = _gguf_library()
    context = lib.gguf_init_from_file(str(path).encode(), _GGUFParams(True, None))
    if not context:
        raise R2RError(f"{path} is not a GGUF file llama.cpp can read")
    try:
        index = lib.gguf_find_tensor(context, name.encode())
        if index < 0:
            raise R2RError(f"{path} has no tensor {name}")
        start = lib.gguf_get_data_offset(context) + lib.gguf_get_tensor_offset(context, index)
        size, kind = lib.gguf_get_tensor_size(context, index), lib.gguf_get_tensor_type(context, index)
    finally:
        lib.gguf_free(context)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(size,)), kind


def dequantized(raw: np.ndarray, kind: int) -> np.ndarray:
    """A tensor's bytes of ggml type `kind` as float32, by ggml's own conversion (gguf-py's, in numpy, takes seconds
    for an embedding table)."""
    traits = _gguf_library().ggml_get_type_traits(kind).contents
    if not traits.to_float:  # float32 already (ggml converts nothing), or a type no model's weights have
        if traits.type_name != b"f32":
            raise R2RError(f"ggml cannot convert {traits.type_name.decode()} to float32")
        return raw.view(np.float32).copy()
    out = np.empty(raw.size // traits.type_size * traits.blck_size, dtype=np.float32)
    traits.to_float(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
    return out


def gguf_py_dequantize(data: np.ndarray, kind) -> np.ndarray:
    """gguf-py's `dequantize(data, type)` (a tensor as gguf-py's reader maps it: quantized rows as bytes, float types
    as their own dtype) done by ggml's own conversion; the same values, float32."""
    values = dequantized(np.ascontiguousarray(data).reshape(-1).view(np.uint8), int(kind))
    return values.reshape((*data.shape[:-1], -1) if data.dtype == np.uint8 else data.shape)


@contextlib.contextmanager
def ggml_dequantization():
    """While open, gguf-py's `dequantize` is ggml's (C) instead of its own numpy code, for what reads GGUF weights
    through it (transformers: minutes for a 1.5B model's k-quants on a CPU); without llama.cpp, gguf-py's own."""
    if llama_cpp is None:
        yield
        return
    import gguf

    own, gguf.dequantize = gguf.dequantize, gguf_py_dequantize
    try:
        yield
    finally:
        gguf.dequantize = own


if llama_cpp is not None:
    @llama_cpp.llama_log_callback
    def _quiet_log(level, text, user_data):
        if level == 4:  # GGML_LOG_LEVEL_ERROR; the rest (model loading chatter) stays quiet
            os.write(2, text)
else:
    _quiet_log = None
