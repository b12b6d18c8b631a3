"""The backend contract (backend.py) on PyTorch/transformers: any *ForCausalLM, on CPU or CUDA.

On CUDA the cache is static (static_cache.py) and reads of up to 64 tokens replay as CUDA graphs: there a small
model's step costs its kernel launches, not its weights. Inside a graph the kernels still run one after another, and
most of those a transformers layer launches are tiny (norms, rotary embeddings, residual adds), so the graphs can
record the trunk as torch.compile makes it, whose fused kernels do the same work in far fewer launches (`compile`;
loading.py compiles the SLM's). On a CPU the cache is transformers' own DynamicCache, which grows as it
is written."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from roads_to_rome.backends.cuda_graphs import capture
from roads_to_rome.backends.static_cache import (
    BufferPool,
    GraphedStep,
    StaticKV,
    additive_mask,
    capacity_for,
    padded_size,
    supports_static_cache,
)


@dataclass
class TorchCache:
    kv: DynamicCache | StaticKV | None  # a StaticKV comes with the first read, once the rows are known
    length: int = 0  # columns of the token streams already read into `kv`


class TorchBackend:
    max_rows = None  # only memory limits a batch
    kv_capacity = None  # each row has its own cache columns
    verifies = True
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
        self.max_context = getattr(config, "max_position_embeddings", None) or 1 << 31
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
        # (dynamic=None: the first shape compiles as it is, a second makes the sizes that changed symbolic, so
        # one-token reads get their own kernels and every longer read shares one set)
        self.compiled_trunk = torch.compile(self.trunk) if self.graphs and compile is not False else None

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

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
        return TorchCache(None if self.static else DynamicCache(config=self.model.config))

    def _reserve(self, cache: TorchCache, rows: int, columns: int) -> StaticKV:
        """The cache's buffers, (re)allocated to hold `rows` rows and `columns` columns."""
        kv = cache.kv
        if kv is not None and kv.rows == rows and kv.capacity >= columns:
            return kv
        shape = (rows, self.kv_heads, capacity_for(columns), self.head_dim)
        fresh = self.pool.take(shape, self.dtype, self.device, self.layers)
        if kv is not None:  # grown: keep what was written
            if kv.rows != rows:
                raise ValueError(f"a cache of {kv.rows} rows was read with {rows}")
            for old, new in zip(kv.keys + kv.values, fresh.keys + fresh.values):
                new[:, :, : cache.length] = old[:, :, : cache.length]
        cache.kv = fresh
        self.pool.give_back_when_dropped(cache, fresh)
        return fresh

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The whole head, then the tokenizer's columns: the same numbers as the model's own forward.
        return self.head(hidden)[..., : self.vocab_size].float()

    @torch.inference_mode()  # a static cache is written in place, and its buffers are inference tensors
    def _read(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the trunk over the new columns; their last hidden states [B, n, H]."""
        start, n_new = cache.length, new_ids.shape[1]
        mask = attention_mask[:, : start + n_new]
        # Same positions as transformers' generate: count real tokens, padding sits at 0.
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, start:]
        # The cache goes by position: transformers 5 renamed its keyword (past_key_values, then cache).
        if not self.static:
            out = self.trunk(new_ids, mask, positions, cache.kv, use_cache=True)
            cache.length = start + n_new
            return out.last_hidden_state
        size = padded_size(n_new) if self.graphs or self.pad_reads else None
        hidden = self._static_read(cache, new_ids, mask, positions, size or n_new, self.graphs and size is not None)
        cache.length = start + n_new
        return hidden[:, :n_new]

    def _static_read(self, cache: TorchCache, new_ids, mask, positions, size: int, graphed: bool) -> torch.Tensor:
        """The new columns padded to `size` (the padding columns are not tokens: masked, and written past the
        cache's length, where the next read overwrites them), read by a CUDA graph of that size over this cache's
        buffers (captured on first use) when `graphed`, else eagerly. Hidden states [B, size, H]."""
        start, pad = cache.length, size - new_ids.shape[1]
        kv = self._reserve(cache, new_ids.shape[0], start + size)
        if pad:
            new_ids, positions, mask = (torch.nn.functional.pad(t, (0, pad)) for t in (new_ids, positions, mask))
        step_mask = additive_mask(mask, start, size, kv.capacity, self.dtype)
        write_at = torch.arange(start, start + size, device=self.device)
        if not graphed:
            return self._trunk(kv, new_ids, positions, step_mask, write_at)
        steps = self.pool.graphs.setdefault(kv, {})
        step = steps.get(size)
        if step is None:
            try:
                step = steps[size] = self._capture(kv, new_ids, positions, step_mask, write_at)
            except RuntimeError as e:  # a model whose forward syncs with the host cannot be captured
                warnings.warn(f"{self.name}: CUDA graph capture failed ({str(e).splitlines()[0]}); "
                              "running its steps without graphs", stacklevel=2)
                self.graphs = False
                return self._trunk(kv, new_ids, positions, step_mask, write_at)
        else:
            for static, value in ((step.ids, new_ids), (step.positions, positions), (step.mask, step_mask),
                                  (step.write_at, write_at)):
                static.copy_(value)  # device to device: nothing waits for the host
            step.graph.replay()
        return step.hidden.clone()

    def _trunk(self, kv: StaticKV, ids, positions, mask, write_at, trunk=None) -> torch.Tensor:
        """The trunk over a static cache: it writes the new columns' keys and values at `write_at`; `mask` is
        additive, over the cache's whole capacity (given as transformers' mask mapping, so no mask code runs)."""
        kv.write_at = write_at
        trunk = self.trunk if trunk is None else trunk
        return trunk(ids, {"full_attention": mask}, positions, kv, use_cache=True).last_hidden_state

    def _capture(self, kv: StaticKV, ids, positions, mask, write_at) -> GraphedStep:
        # (the warm-up writes this read's own columns: the same numbers the replay writes)
        ids, positions, mask, write_at = (t.clone() for t in (ids, positions, mask, write_at))
        if self.compiled_trunk is not None:
            try:
                return self._record(kv, ids, positions, mask, write_at, self.compiled_trunk)
            except Exception as e:  # noqa: BLE001 (inductor's errors have no common type): the trunk as it is
                warnings.warn(f"{self.name}: torch.compile failed ({str(e).strip().splitlines()[0]}); its CUDA "
                              "graphs record the trunk uncompiled", stacklevel=3)
                self.compiled_trunk = None
        return self._record(kv, ids, positions, mask, write_at)

    def _record(self, kv: StaticKV, ids, positions, mask, write_at, trunk=None) -> GraphedStep:
        graph, hidden = capture(lambda: self._trunk(kv, ids, positions, mask, write_at, trunk), self.pool.memory)
        self.pool.memory = self.pool.memory or graph.pool()
        return GraphedStep(graph, ids, positions, mask, write_at, hidden)

    @torch.inference_mode()
    def forward(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor):
        hidden = self._read(cache, new_ids, attention_mask)[:, -1:]  # [B, 1, H]: the shape generate uses
        return self._logits(hidden)[:, 0], hidden[:, 0]

    @torch.inference_mode()
    def read(self, cache, new_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.forward(cache, new_ids, attention_mask)

    @torch.inference_mode()
    def forward_all(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor,
                    keep_last: int | None = None) -> torch.Tensor:
        keep = new_ids.shape[1] if keep_last is None else keep_last
        hidden = self._read(cache, new_ids, attention_mask)[:, new_ids.shape[1] - keep :]  # the head only where asked
        padding = attention_mask[:, cache.length - keep : cache.length] == 0
        return self._logits(hidden).masked_fill(padding[..., None], 0.0)

    @torch.inference_mode()
    def prefill(self, ids: list[int], start: int = 0):
        out = self.trunk(input_ids=torch.tensor([ids], device=self.device), use_cache=False)
        hidden = out.last_hidden_state[0, start:]
        return self._logits(hidden), hidden

    def select_rows(self, cache: TorchCache, rows: torch.Tensor) -> None:
        if cache.length and self.static:
            cache.kv = cache.kv.rows_of(rows.to(self.device))
        elif cache.length:
            cache.kv.batch_select_indices(rows.to(self.device))

    def copy_rows(self, cache: TorchCache, rows: list[int]) -> TorchCache:
        if self.static:
            if not cache.length:
                return TorchCache(None)
            return TorchCache(cache.kv.rows_of(torch.tensor(rows, device=self.device)), cache.length)
        kv = copy.deepcopy(cache.kv)
        if cache.length:
            kv.batch_select_indices(torch.tensor(rows, device=self.device))
        return TorchCache(kv, cache.length)

    def append_rows(self, cache: TorchCache, other: TorchCache) -> None:
        if cache.length != other.length:
            raise ValueError("caches must cover the same columns")
        if self.static:
            if cache.length:
                columns = max(cache.kv.capacity, other.kv.capacity)

                def widened(t):
                    return torch.nn.functional.pad(t, (0, 0, 0, columns - t.shape[2]))

                cache.kv = StaticKV([torch.cat([widened(a), widened(b)]) for a, b in zip(cache.kv.keys, other.kv.keys)],
                                    [torch.cat([widened(a), widened(b)])
                                     for a, b in zip(cache.kv.values, other.kv.values)])
            return
        for layer, new in zip(cache.kv.layers, other.kv.layers):
            layer.keys = torch.cat([layer.keys, new.keys])
            layer.values = torch.cat([layer.values, new.values])

    @torch.inference_mode()
    def pad_left(self, cache: TorchCache, n: int) -> None:
        # The attention mask marks the new columns as padding, so they are never read.
        if not cache.length:
            return
        if self.static:
            kv = self._reserve(cache, cache.kv.rows, cache.length + n)
            for t in kv.keys + kv.values:
                t[:, :, n : cache.length + n] = t[:, :, : cache.length].clone()
                t[:, :, :n] = 0
            cache.length += n
            return
        for layer in cache.kv.layers:
            b, h, _, d = layer.keys.shape
            layer.keys = torch.cat([layer.keys.new_zeros(b, h, n, d), layer.keys], dim=2)
            layer.values = torch.cat([layer.values.new_zeros(b, h, n, layer.values.shape[-1]), layer.values], dim=2)
        cache.length += n

    def truncate(self, cache: TorchCache, length: int) -> None:
        if length < cache.length:
            if not self.static:  # a static cache masks the columns past its length instead
                cache.kv.crop(length - cache.length)  # negative: columns to drop
            cache.length = length

    @torch.inference_mode()
    def shift_rows(self, cache: TorchCache, shifts: list[int]) -> None:
        # Keys keep the rotary positions they were computed at, and a row's positions count its real
        # tokens only, so moving a row's entries right (and masking the new left columns) changes nothing.
        if not any(shifts):
            return
        if self.static:
            for t in cache.kv.keys + cache.kv.values:
                for row, d in enumerate(shifts):
                    if d:
                        t[row, :, d : cache.length] = t[row, :, : cache.length - d].clone()
                        t[row, :, :d] = 0
            return
        for layer in cache.kv.layers:
            for tensor_name in ("keys", "values"):
                old = getattr(layer, tensor_name)
                new = torch.zeros_like(old)
                for row, d in enumerate(shifts):
                    new[row, :, d:] = old[row, :, : old.shape[2] - d]
                setattr(layer, tensor_name, new)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(token_ids.to(self.device))

    def embedding_table(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()
