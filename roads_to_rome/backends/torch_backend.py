"""The backend contract (backend.py) on PyTorch/transformers: any *ForCausalLM, on CPU or CUDA."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class TorchCache:
    kv: DynamicCache
    length: int = 0  # columns of the token streams already read into `kv`


class TorchBackend:
    max_rows = None  # only memory limits a batch
    kv_capacity = None  # each row has its own cache columns
    verifies = True
    full_logits = True

    def __init__(self, model: torch.nn.Module, name: str = "model", vocab_size: int | None = None):
        """`model`: a transformers *ForCausalLM; `vocab_size`: the tokenizer's size (default: every row
        of the output head)."""
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

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def new_cache(self) -> TorchCache:
        return TorchCache(DynamicCache(config=self.model.config))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The whole head, then the tokenizer's columns: the same numbers as the model's own forward.
        return self.head(hidden)[..., : self.vocab_size].float()

    def _read(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the trunk over the new columns; their last hidden states [B, n, H]."""
        start, n_new = cache.length, new_ids.shape[1]
        mask = attention_mask[:, : start + n_new]
        # Same positions as transformers' generate: count real tokens, padding sits at 0.
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, start:]
        out = self.trunk(input_ids=new_ids, attention_mask=mask, position_ids=positions, past_key_values=cache.kv,
                         use_cache=True)
        cache.length = start + n_new
        return out.last_hidden_state

    @torch.inference_mode()
    def forward(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor):
        hidden = self._read(cache, new_ids, attention_mask)[:, -1:]  # [B, 1, H]: the shape generate uses
        return self._logits(hidden)[:, 0], hidden[:, 0]

    @torch.inference_mode()
    def read(self, cache, new_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.forward(cache, new_ids, attention_mask)

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
        if cache.length:
            cache.kv.batch_select_indices(rows.to(self.device))

    def copy_rows(self, cache: TorchCache, rows: list[int]) -> TorchCache:
        kv = copy.deepcopy(cache.kv)
        if cache.length:
            kv.batch_select_indices(torch.tensor(rows, device=self.device))
        return TorchCache(kv, cache.length)

    def append_rows(self, cache: TorchCache, other: TorchCache) -> None:
        if cache.length != other.length:
            raise ValueError("caches must cover the same columns")
        for layer, new in zip(cache.kv.layers, other.kv.layers):
            layer.keys = torch.cat([layer.keys, new.keys])
            layer.values = torch.cat([layer.values, new.values])

    def pad_left(self, cache: TorchCache, n: int) -> None:
        # The attention mask marks the new columns as padding, so they are never read.
        if not cache.length:
            return
        for layer in cache.kv.layers:
            b, h, _, d = layer.keys.shape
            layer.keys = torch.cat([layer.keys.new_zeros(b, h, n, d), layer.keys], dim=2)
            layer.values = torch.cat([layer.values.new_zeros(b, h, n, layer.values.shape[-1]), layer.values], dim=2)
        cache.length += n

    def truncate(self, cache: TorchCache, length: int) -> None:
        if length < cache.length:
            cache.kv.crop(length - cache.length)  # negative: columns to drop
            cache.length = length

    def shift_rows(self, cache: TorchCache, shifts: list[int]) -> None:
        # Keys keep the rotary positions they were computed at, and a row's positions count its real
        # tokens only, so moving a row's entries right (and masking the new left columns) changes nothing.
        if not any(shifts):
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
