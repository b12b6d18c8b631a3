"""A key-value cache of fixed capacity written in place, and reads replayed as CUDA graphs.

On a GPU, a small model's decode step is bound by launching kernels, not by reading weights: a
transformers forward launches a dozen kernels per layer from Python, and so does the LLM's catch-up over a
few tokens. A CUDA graph records one read's kernels once (one new column, or a catch-up padded to a power of
two) and replays them with one launch, but it replays fixed memory: the inputs, the cache and
the outputs must live at the same addresses every time. So the cache here holds [rows, kv heads,
capacity, head dim] buffers per layer that a forward writes into at given columns (the model's
attention layers call `update`, as they do on transformers' own caches), the mask covers all
`capacity` columns (columns not yet written are masked out), and buffers of a shape are recycled, so
that a new request's cache reuses the buffers (and the graphs) of one that finished.

Works for models whose layers all use full attention (Qwen2 and Qwen3 without sliding windows, Llama...).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

MIN_CAPACITY = 1024  # columns: capacities are powers of two from here, so few shapes (and graphs) exist
MAX_GRAPHED_READ = 64  # new columns: reads up to this many run as graphs (padded to a power of two); longer ones
# (prompts) run eagerly, where the launches are a small part of the work


def capacity_for(columns: int) -> int:
    return max(MIN_CAPACITY, 1 << max(columns - 1, 0).bit_length())


def padded_size(n_new: int) -> int | None:
    """The graph size a read of `n_new` columns runs at (None: too long for a graph)."""
    return 1 << (n_new - 1).bit_length() if n_new <= MAX_GRAPHED_READ else None


def supports_static_cache(model) -> bool:
    config = model.config.get_text_config()
    return all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])


class StaticKV:
    """Per-layer key and value buffers; a forward writes its new columns at `write_at`."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.write_at: torch.Tensor | None = None  # set before each forward (torch_backend.TorchBackend._trunk)

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.write_at, key_states.to(keys.dtype))
        values.index_copy_(2, self.write_at, value_states.to(values.dtype))
        return keys, values

    def rows_of(self, index: torch.Tensor, columns: int) -> StaticKV:
        """These rows, in this order, their first `columns` columns, in new buffers (graphs over the old ones do not
        apply to them; a read beyond them grows them). A copy kept aside (prefix caching) holds what it holds, not
        the batch's whole capacity."""
        return StaticKV([t[index, :, :columns] for t in self.keys], [t[index, :, :columns] for t in self.values])


@dataclass
class GraphedStep:
    """One captured read of `size` new columns over a fixed cache: copy the inputs in, replay, read the outputs. The
    positions, the mask and the columns written are made inside the graph from `real` and `start` (`read_inputs`),
    so that a step's host work is three copies and a replay."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B, size]
    real: torch.Tensor  # [B, capacity] bool: the columns that hold real tokens, this read's included
    start: torch.Tensor  # [1]: the first column the read writes
    hidden: torch.Tensor  # [B, size, H]: the trunk's output
    logits: torch.Tensor | None  # [B, V] float32: the head over the last column (one-token reads), else None


@dataclass
class BufferPool:
    """Buffers of caches that were dropped, by shape, for the next cache of that shape; graphs by buffers, then
    by read size."""

    free: dict = field(default_factory=dict)
    graphs: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    memory: object = None  # the CUDA graphs' shared memory pool
    loans: dict = field(default_factory=dict)  # buffers in use: how each comes back when its cache is dropped

    def take(self, shape: tuple, dtype, device, layers: int) -> StaticKV:
        stack = self.free.get((shape, dtype))
        if stack:
            return stack.pop()
        def make():
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        return StaticKV(make(), make())

    def lend(self, owner, kv: StaticKV) -> None:
        """`kv` is `owner`'s until it gives it back or is dropped."""
        self.loans[kv] = weakref.finalize(owner, self._return, kv)

    def give_back(self, kv: StaticKV) -> None:
        loan = self.loans.pop(kv, None)
        if loan is not None:  # (buffers of a row copy were never lent)
            loan()

    def _return(self, kv: StaticKV) -> None:
        self.loans.pop(kv, None)
        self.free.setdefault((tuple(kv.keys[0].shape), kv.keys[0].dtype), []).append(kv)


def real_columns(attention_mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, capacity] bool: the mask's real tokens, every column past it False."""
    return torch.nn.functional.pad(attention_mask.bool(), (0, capacity - attention_mask.shape[1]))


def read_inputs(real: torch.Tensor, query: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What a read of the cache columns `query` [size] needs, from device tensors only (so a graph can make them):
    positions [B, size] that count real tokens (as transformers' generate does; padding sits at 0), and the additive
    mask [B, 1, size, capacity]: 0 where new column q may read column j (j <= q, j a real token), else the dtype's
    minimum. A column always reads itself, so no row of the softmax is empty (padding columns produce numbers nobody
    reads, as in transformers' own masks)."""
    rows, capacity = real.shape
    at = query[None, :].expand(rows, -1)
    positions = (real.long().cumsum(-1) - 1).gather(1, at).masked_fill(~real.gather(1, at), 0)
    columns = torch.arange(capacity, device=real.device)
    causal, itself = columns[None, :] <= query[:, None], columns[None, :] == query[:, None]  # [size, capacity]
    allowed = (real[:, None, :] & causal[None]) | itself[None]
    mask = torch.zeros(rows, 1, len(query), capacity, dtype=dtype, device=real.device)
    return positions, mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
