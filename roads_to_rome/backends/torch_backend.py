"""The backend contract (base.py) on PyTorch/transformers: any *ForCausalLM, on CPU or CUDA.

On CUDA the cache is static (static_cache.py) and reads of up to 64 tokens replay as CUDA graphs: there a small
model's step costs its kernel launches, not its weights. Inside a graph the kernels still run one after another, and
most of those a transformers layer launches are tiny (norms, rotary embeddings, residual adds), so the graphs can
record the trunk as torch.compile makes it, whose fused kernels do the same work in far fewer launches (`compile`;
loading.py compiles the SLM's). On a CPU the cache is transformers' own DynamicCache, which grows as it
is written."""

from __future__ import annotations

import copy
import warnings

import torch
from transformers import DynamicCache

from roads_to_rome import hardware
from roads_to_rome.backends.base import SCORE_CHUNK, SCORE_READ, ChunkVisitor, LocalBackend
from roads_to_rome.backends.cuda_graphs import capture, gate, recorded_or_none
from roads_to_rome.backends.static_cache import (
    BufferPool,
    GraphedStep,
    StaticKV,
    capacity_for,
    padded_size,
    read_inputs,
    real_columns,
    supports_static_cache,
)


class TorchCache:
    """A torch backend's cache: every layer's keys and values [rows, kv heads, columns, head dim] and the columns
    read so far (`length`). Two kinds hold them: `DynamicTorchCache` (transformers' own, which grows as it is
    written: on a CPU) and `StaticTorchCache` (buffers of fixed capacity written in place, which CUDA graphs replay
    over); the row operation both do alike, in place, is written here once."""

    length: int  # columns of the token streams already read

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's keys, then every layer's values."""
        raise NotImplementedError

    def copy_rows(self, rows: torch.Tensor) -> TorchCache:
        raise NotImplementedError

    def select_rows(self, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def append_rows(self, other: TorchCache) -> None:
        raise NotImplementedError

    def pad_left(self, n: int) -> None:
        raise NotImplementedError

    def trim_left(self, n: int) -> None:
        raise NotImplementedError

    def truncate(self, length: int) -> None:
        raise NotImplementedError

    def shift_rows(self, shifts: list[int]) -> None:
        # In place: a static cache's graphs replay over its buffers.
        for t in self.tensors():
            for row, d in enumerate(shifts):
                d = min(d, self.length)  # a row moved by its whole length keeps nothing
                if d:
                    t[row, :, d : self.length] = t[row, :, : self.length - d].clone()
                    t[row, :, :d] = 0


class DynamicTorchCache(TorchCache):
    """transformers' DynamicCache: each read appends its columns, so the tensors are `length` columns wide."""

    def __init__(self, kv: DynamicCache, length: int = 0):
        self.kv, self.length = kv, length

    def tensors(self) -> list[torch.Tensor]:
        return [layer.keys for layer in self.kv.layers] + [layer.values for layer in self.kv.layers]

    def replace(self, tensors: list[torch.Tensor]) -> None:
        """Hold these tensors (as `tensors` lists them) instead."""
        n = len(self.kv.layers)
        for layer, keys, values in zip(self.kv.layers, tensors[:n], tensors[n:]):
            layer.keys, layer.values = keys, values

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.length:
            self.replace([t[rows] for t in self.tensors()])

    def append_rows(self, other: DynamicTorchCache) -> None:
        if self.length != other.length:
            raise ValueError("caches must cover the same columns")
        if self.length:
            self.replace([torch.cat([a, b]) for a, b in zip(self.tensors(), other.tensors())])

    def trim_left(self, n: int) -> None:
        # (positions were applied as the keys were written: they count real tokens only, not these columns)
        if n and self.length:
            self.replace([t[:, :, n:].contiguous() for t in self.tensors()])
            self.length -= n

    def copy_rows(self, rows: torch.Tensor) -> DynamicTorchCache:
        if not self.length:
            return DynamicTorchCache(copy.deepcopy(self.kv))
        held = self.tensors()
        self.replace([t[:0] for t in held])  # the structure copied without the batch's every row
        copied = DynamicTorchCache(copy.deepcopy(self.kv), self.length)
        self.replace(held)
        copied.replace([t[rows] for t in held])
        return copied

    def pad_left(self, n: int) -> None:
        if self.length:
            self.replace([torch.cat([t.new_zeros(*t.shape[:2], n, t.shape[3]), t], dim=2) for t in self.tensors()])
            self.length += n

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.kv.crop(length - self.length)  # negative: columns to drop
            self.length = length


class StaticTorchCache(TorchCache):
    """Buffers of a fixed capacity (static_cache.StaticKV), written in place; columns past `length` are masked.
    `reserve(cache, rows, columns)` gives the cache buffers with room for that many rows and columns, holding what
    it held (the backend's pool). The buffers may have more rows than the cache (`rows`, its first ones): a row
    that leaves the batch leaves its slot behind, so the graphs captured over the buffers still apply (with new
    buffers each step where a row finished or was parked would capture every read size again)."""

    def __init__(self, reserve, kv: StaticKV | None = None, length: int = 0):
        self.reserve, self.kv, self.length = reserve, kv, length  # the buffers come with the first read
        self.rows = 0 if kv is None else kv.rows

    def tensors(self) -> list[torch.Tensor]:
        return self.kv.keys + self.kv.values

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.length:
            for t in self.tensors():
                t[: len(rows)] = t[rows]  # (indexing copies first, so rows may move over each other)
        self.rows = len(rows)

    def append_rows(self, other: StaticTorchCache) -> None:
        if self.length != other.length:
            raise ValueError("caches must cover the same columns")
        rows = self.rows + other.rows
        if self.length:
            kv = self.reserve(self, rows, self.length)
            for ours, theirs in zip(kv.keys + kv.values, other.tensors()):
                ours[self.rows : rows, :, : self.length] = theirs[: other.rows, :, : self.length]
        self.rows = rows

    def trim_left(self, n: int) -> None:
        if n and self.length:  # in place, as the graphs replay over these buffers
            for t in self.tensors():
                t[:, :, : self.length - n] = t[:, :, n : self.length].clone()
            self.length -= n

    def copy_rows(self, rows: torch.Tensor) -> StaticTorchCache:
        if not self.length:
            return StaticTorchCache(self.reserve)
        return StaticTorchCache(self.reserve, self.kv.rows_of(rows, self.length), self.length)

    def pad_left(self, n: int) -> None:
        if not self.length:
            return
        kv = self.reserve(self, self.rows, self.length + n)
        for t in kv.keys + kv.values:
            t[:, :, n : self.length + n] = t[:, :, : self.length].clone()
            t[:, :, :n] = 0
        self.length += n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)  # the columns past it are masked, and overwritten by the next read


def symbolic_sizes(ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, kv: StaticKV) -> None:
    """A compiled trunk's inputs with the sizes that vary between reads marked symbolic, so that one compile serves
    every batch of two rows or more and every read of two columns or more (unmarked, torch.compile compiles again at
    the first change of each size, and a compile of a 1.5B trunk takes most of a minute). Sizes of one keep kernels
    of their own: a batch of one row and a one-token read are the steps that matter most."""
    rows, size = ids.shape
    if rows > 1:
        for t in (ids, positions, mask, *kv.keys, *kv.values):
            torch._dynamo.maybe_mark_dynamic(t, 0)
    if size > 1:
        for t, dim in ((ids, 1), (positions, 1), (mask, 2), (kv.write_at, 0)):
            torch._dynamo.maybe_mark_dynamic(t, dim)


def context_length(config) -> int:
    """The positions a model reads, prompt and output, as vLLM derives its max_model_len: `max_position_embeddings`,
    times a RoPE scaling's factor (YaRN's from its original length); Llama 3's and LongRoPE's scaling are counted in
    it already."""
    length = getattr(config, "max_position_embeddings", None) or 1 << 31
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "su", "longrope", "llama3"):
        if kind == "yarn" and rope.get("original_max_position_embeddings"):
            length = rope["original_max_position_embeddings"]
        length = int(length * (rope.get("factor") or 1.0))
    return length


class TorchBackend(LocalBackend):
    max_rows = None  # only memory limits a batch
    kv_capacity = None  # each row has its own cache columns
    full_logits = True

    def __init__(self, model: torch.nn.Module, name: str = "model", vocab_size: int | None = None,
                 static: bool | None = None, graphs: bool | None = None, pad_reads: bool = False,
                 compile: bool | None = None):
        """`model`: a transformers *ForCausalLM; `vocab_size`: the tokenizer's size (default: every row
        of the output head); `static`: a static cache (default: on CUDA, for models it supports); `graphs`:
        reads of up to 64 new columns as CUDA graphs, padded to a power of two (default: with a static cache on
        CUDA); `pad_reads`: pad reads as graphs do, without graphs (to test the padding on a CPU); `compile`: the
        graphs record the trunk as torch.compile makes it (default: with graphs; compiled at the first capture of
        a read, once for one-token reads and once for all longer ones)."""
        self.model, self.name = model.eval(), name
        # The trunk returns the last hidden state after the final norm: the router's input and
        # the head's input. Calling trunk and head separately lets us project only the last positions.
        self.trunk = model.base_model
        self.head = model.get_output_embeddings()
        self.num_params = sum(p.numel() for p in model.parameters())
        config = model.config.get_text_config()
        self.hidden_size = config.hidden_size
        self.max_context = context_length(config)
        head_rows = self.head.weight.shape[0]
        self.vocab_size = min(vocab_size or head_rows, head_rows)
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        on_cuda = self.device.type == "cuda"
        self.static = (on_cuda if static is None else static) and supports_static_cache(model)
        self.graphs = self.static and on_cuda and (True if graphs is None else graphs)
        self.pad_reads = self.static and pad_reads
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.pool = BufferPool()
        self.captures = 0  # graphs recorded so far, read by whoever times steps: recording is one-time work
        # (compiled once per kind of read: the sizes that vary between reads are symbolic, `symbolic_sizes`)
        self.compiled_trunk = torch.compile(self.trunk) if self.graphs and compile is not False else None

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def grouped_reads(self) -> bool:
        # bf16 matrix work in the CPU's own bf16 instructions (AMX tiles, AVX512-BF16) reads several rows' columns
        # in little more than the time of one row's one, so grouped calls pay (docs/benchmarks.md); float32 and
        # emulated bf16 have not been shown to.
        return self.device.type == "cuda" or (self.dtype == torch.bfloat16 and hardware.has_native_bf16())

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def kernels(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.device.type == "cuda":
            graphs = ("CUDA graphs of torch.compile's kernels" if self.compiled_trunk is not None else "CUDA graphs") \
                if self.graphs else "eager"
            return f"torch {torch.__version__} {dtype} on {torch.cuda.get_device_name(self.device)} ({graphs})"
        return f"torch {torch.__version__} {dtype} {torch.backends.cpu.get_cpu_capability()}"

    def new_cache(self) -> TorchCache:
        if self.static:
            return StaticTorchCache(self._reserve)
        return DynamicTorchCache(DynamicCache(config=self.model.config))

    def _reserve(self, cache: StaticTorchCache, rows: int, columns: int) -> StaticKV:
        """The cache's buffers, with room for at least `rows` rows and `columns` columns: its own where they have it,
        else pooled ones holding what its rows had written (its old buffers go back to the pool)."""
        kv = cache.kv
        if kv is not None and kv.rows >= rows and kv.capacity >= columns:
            return kv
        if kv is not None:  # grown: rows to a power of two, so a batch that gains rows one by one has few shapes
            rows = kv.rows if rows <= kv.rows else 1 << (rows - 1).bit_length()
            columns = max(columns, kv.capacity)
        shape = (rows, self.kv_heads, capacity_for(columns), self.head_dim)
        fresh = self.pool.take(shape, self.dtype, self.device, self.layers)
        if kv is not None:
            for old, new in zip(kv.keys + kv.values, fresh.keys + fresh.values):
                new[: cache.rows, :, : cache.length] = old[: cache.rows, :, : cache.length]
            self.pool.give_back(kv)  # (the copy is queued before any later use of the buffers: one stream)
        cache.kv = fresh
        self.pool.lend(cache, fresh)
        return fresh

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The whole head, then the tokenizer's columns: the same numbers as the model's own forward.
        return self.head(hidden)[..., : self.vocab_size].float()

    @torch.inference_mode()  # a static cache is written in place, and its buffers are inference tensors
    def _read(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the trunk over the new columns: their last hidden states [B, n, H], and the head's float32 logits at
        the last column [B, V] where a one-token graph made them with the read (else None)."""
        if self.graphs:  # (another thread may be recording a graph: cuda_graphs.CaptureGate)
            with gate.reading():
                return self._read_columns(cache, new_ids, attention_mask)
        return self._read_columns(cache, new_ids, attention_mask)

    def _read_columns(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        start, n_new = cache.length, new_ids.shape[1]
        mask = attention_mask[:, : start + n_new]
        if not self.static:
            # Same positions as transformers' generate: count real tokens, padding sits at 0.
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, start:]
            # The cache goes by position: transformers 5 renamed its keyword (past_key_values, then cache).
            out = self.trunk(new_ids, mask, positions, cache.kv, use_cache=True)
            cache.length = start + n_new
            return out.last_hidden_state, None
        size = padded_size(n_new) if self.graphs or self.pad_reads else None
        hidden, logits = self._static_read(cache, new_ids, mask, size or n_new, self.graphs and size is not None)
        cache.length = start + n_new
        return hidden[:, :n_new], logits

    def _static_read(self, cache: StaticTorchCache, new_ids, mask, size: int, graphed: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new columns padded to `size` (the padding columns are not tokens: masked, and written past the
        cache's length, where the next read overwrites them) and the rows to the buffers' (slots of rows that left,
        where no column is a token), read by a CUDA graph of that size over this cache's buffers (captured on first
        use) when `graphed`, else eagerly. Hidden states [B, size, H], and the last column's logits where the graph
        made them."""
        start, rows = cache.length, new_ids.shape[0]
        if start and rows != cache.rows:
            raise ValueError(f"a cache of {cache.rows} rows was read with {rows}")
        cache.rows = rows
        kv = self._reserve(cache, rows, start + size)
        if size > new_ids.shape[1] or kv.rows > rows:
            new_ids = torch.nn.functional.pad(new_ids, (0, size - new_ids.shape[1], 0, kv.rows - rows))
            mask = torch.nn.functional.pad(mask, (0, 0, 0, kv.rows - rows))
        if not graphed:
            start_at = torch.full((1,), start, device=self.device)
            return self._trunk(kv, new_ids, real_columns(mask, kv.capacity), start_at)[:rows], None
        steps = self.pool.graphs.setdefault(kv, {})
        step = steps.get(size)
        if step is None:
            real, start_at = real_columns(mask, kv.capacity), torch.full((1,), start, device=self.device)
            step = self._capture(kv, new_ids, real, start_at)
            if step is None:  # a model whose forward syncs with the host cannot be captured
                self.graphs = False
                return self._trunk(kv, new_ids, real, start_at)[:rows], None
            steps[size] = step
        else:  # device to device, and a fill: nothing waits for the host
            step.ids.copy_(new_ids)
            step.real[:, : mask.shape[1]].copy_(mask)
            step.real[:, mask.shape[1]:] = False
            step.start.fill_(start)
            step.graph.replay()
        return step.hidden[:rows].clone(), None if step.logits is None else step.logits[:rows].clone()

    def _trunk(self, kv: StaticKV, ids, real, start, compiled=None) -> torch.Tensor:
        """The trunk (torch.compile's `compiled` one where given, else the model's own) over a static cache, reading
        columns start.. of `real` (the real tokens' columns, this read's included; static_cache.read_inputs makes the
        positions and the mask from them): it writes the new columns' keys and values there."""
        kv.write_at = start + torch.arange(ids.shape[1], device=ids.device)
        positions, mask = read_inputs(real, kv.write_at, self.dtype)
        if compiled is None:
            return self.trunk(ids, mask, positions, kv, use_cache=True).last_hidden_state
        symbolic_sizes(ids, positions, mask, kv)
        return compiled(ids, mask, positions, kv, use_cache=True).last_hidden_state

    def _capture(self, kv: StaticKV, ids, real, start) -> GraphedStep | None:
        self.captures += 1
        # (the warm-up writes this read's own columns: the same numbers the replay writes)
        # (strides as a fresh tensor's: a compiled trunk's guards check them, and a view's would recompile it)
        ids, real, start = (t.clone(memory_format=torch.contiguous_format) for t in (ids, real, start))
        if self.compiled_trunk is not None:
            try:
                return self._record(kv, ids, real, start, self.compiled_trunk)
            except Exception as e:  # noqa: BLE001 (inductor's errors have no common type): the trunk as it is
                warnings.warn(f"{self.name}: torch.compile failed ({str(e).strip().splitlines()[0]}); its CUDA "
                              "graphs record the trunk uncompiled", stacklevel=3)
                self.compiled_trunk = None
        return recorded_or_none(lambda: self._record(kv, ids, real, start), self.name)

    def _record(self, kv: StaticKV, ids, real, start, compiled=None) -> GraphedStep:
        def read():
            hidden = self._trunk(kv, ids, real, start, compiled)
            # a one-token read is a decode step, whose logits are always wanted: the head runs in the same graph
            return hidden, self._logits(hidden[:, -1]) if ids.shape[1] == 1 else None

        graph, (hidden, logits) = capture(read, self.pool.memory)
        self.pool.memory = self.pool.memory or graph.pool()
        return GraphedStep(graph, ids, real, start, hidden, logits)

    @torch.inference_mode()
    def forward(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor):
        hidden, logits = self._read(cache, new_ids, attention_mask)
        last = hidden[:, -1]
        return (self._logits(last) if logits is None else logits), last

    @torch.inference_mode()
    def forward_all(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor,
                    keep_last: int | None = None, row_keep: list[int] | None = None) -> torch.Tensor:
        keep = new_ids.shape[1] if keep_last is None else keep_last
        hidden = self._read(cache, new_ids, attention_mask)[0][:, new_ids.shape[1] - keep :]  # the head where asked
        padding = attention_mask[:, cache.length - keep : cache.length] == 0
        return self._logits(hidden).masked_fill(padding[..., None], 0.0)

    @torch.inference_mode()
    def forward_sequence(self, ids: list[int], start: int = 0):
        tokens = torch.tensor([ids], device=self.device)
        hidden = self.trunk(input_ids=tokens, use_cache=False).last_hidden_state[0, start:]
        return self._logits(hidden), hidden

    @torch.inference_mode()
    def score_sequence(self, ids: list[int], cache: TorchCache, each_chunk: ChunkVisitor) -> None:
        # Read SCORE_READ columns at a time: the trunk's attention over the whole prompt at once would hold
        # [heads, T, T] scores, which grow with the square of the prompt.
        tokens = torch.tensor([ids], device=self.device)
        mask = torch.ones(1, cache.length + len(ids), dtype=tokens.dtype, device=self.device)
        for read in range(0, len(ids), SCORE_READ):
            hidden = self._read(cache, tokens[:, read : read + SCORE_READ], mask)[0][0]
            for first in range(0, len(hidden), SCORE_CHUNK):
                part = hidden[first : first + SCORE_CHUNK]
                each_chunk(read + first, self._logits(part), part)

    # (the row operations write a static cache's buffers, inference tensors as reads make them, in place or into
    # new ones of the same kind: a compiled trunk's guards tell the two kinds apart and would compile again)
    @torch.inference_mode()
    def select_rows(self, cache: TorchCache, rows: torch.Tensor) -> None:
        cache.select_rows(rows.to(self.device))

    @torch.inference_mode()
    def copy_rows(self, cache: TorchCache, rows: list[int]) -> TorchCache:
        return cache.copy_rows(torch.tensor(rows, device=self.device))

    @torch.inference_mode()
    def append_rows(self, cache: TorchCache, other: TorchCache) -> None:
        cache.append_rows(other)

    @torch.inference_mode()
    def pad_left(self, cache: TorchCache, n: int) -> None:
        cache.pad_left(n)  # the attention mask marks the new columns as padding, so they are never read

    def truncate(self, cache: TorchCache, length: int) -> None:
        cache.truncate(length)

    @torch.inference_mode()
    def trim_left(self, cache: TorchCache, n: int) -> None:
        cache.trim_left(n)

    @torch.inference_mode()
    def shift_rows(self, cache: TorchCache, shifts: list[int]) -> None:
        # Keys keep the rotary positions they were computed at, and a row's positions count its real
        # tokens only, so moving a row's entries right (and masking the new left columns) changes nothing.
        if any(shifts):
            cache.shift_rows(shifts)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(token_ids.to(self.device))

    def embedding_table(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()
