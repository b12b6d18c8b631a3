"""Model execution behind one small contract, so the decode loop never touches a framework.

A backend runs one causal LM over a batch of token streams that it caches itself:

    forward(cache, new_ids, attention_mask) -> (logits, hidden) at the last position of each row

`new_ids` are the columns of the streams the cache has not read yet; `attention_mask` covers
every column up to and including them (0 marks left padding). `select_rows` keeps some rows
of a cache (finished requests leave the batch), `append_rows` adds another cache's rows (new
requests join), `pad_left` prepends empty columns (a longer newcomer widens the batch) and
`truncate` drops the newest columns.
The PyTorch/transformers implementation lives here; others (llama.cpp, a remote engine) follow
the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class TorchCache:
    kv: DynamicCache
    length: int = 0  # columns of the token streams already read into `kv`


@dataclass
class TorchBackend:
    model: torch.nn.Module  # a transformers *ForCausalLM
    name: str = "model"
    num_params: int = field(init=False)

    def __post_init__(self):
        self.model.eval()
        # The trunk returns the last hidden state after the final norm: the router's input and
        # the head's input. Calling trunk and head separately lets us project only the last positions.
        self.trunk = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.num_params = sum(p.numel() for p in self.model.parameters())
        config = self.model.config.get_text_config()
        self.hidden_size = config.hidden_size
        self.vocab_size = self.head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def new_cache(self) -> TorchCache:
        return TorchCache(DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(self, cache: TorchCache, new_ids: torch.Tensor, attention_mask: torch.Tensor):
        start, n_new = cache.length, new_ids.shape[1]
        mask = attention_mask[:, : start + n_new]
        # Same positions as transformers' generate: count real tokens, padding sits at 0.
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, start:]
        out = self.trunk(
            input_ids=new_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache.kv,
            use_cache=True,
        )
        cache.length = start + n_new
        hidden = out.last_hidden_state[:, -1:]
        logits = self.head(hidden)[:, 0].float()
        return logits, hidden[:, 0]

    @torch.inference_mode()
    def prefill(self, ids: list[int], start: int = 0):
        """Logits [T - start, V] (float32) and last hidden states [T - start, H] at positions start.. of one
        sequence, no cache kept (positions before `start` are read but give no output)."""
        out = self.trunk(input_ids=torch.tensor([ids], device=self.device), use_cache=False)
        hidden = out.last_hidden_state[0, start:]
        return self.head(hidden).float(), hidden

    def select_rows(self, cache: TorchCache, rows: torch.Tensor) -> None:
        if cache.length:
            cache.kv.batch_select_indices(rows.to(self.device))

    def append_rows(self, cache: TorchCache, other: TorchCache) -> None:
        assert cache.length == other.length, "caches must cover the same columns"
        for layer, new in zip(cache.kv.layers, other.kv.layers):
            layer.keys = torch.cat([layer.keys, new.keys])
            layer.values = torch.cat([layer.values, new.values])

    def pad_left(self, cache: TorchCache, n: int) -> None:
        """Prepend n empty columns; the attention mask marks them as padding, so they are never read."""
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

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(token_ids.to(self.device))

    def embedding_table(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()


@torch.inference_mode()
def greedy(backend, cache, new_ids: list[int], max_new_tokens: int, eos_ids: set[int], stop=None) -> list[int]:
    """One row, greedy: read `new_ids` after what `cache` holds, then write up to `max_new_tokens`
    tokens, stopping before an EOS or after a token for which `stop(tokens_so_far)` is true."""
    out = []
    for _ in range(max_new_tokens):
        mask = torch.ones(1, cache.length + len(new_ids), dtype=torch.long, device=backend.device)
        logits, _ = backend.forward(cache, torch.tensor([new_ids], device=backend.device), mask)
        token = int(logits[0].argmax())
        if token in eos_ids:
            break
        out.append(token)
        if stop is not None and stop(out):
            break
        new_ids = [token]
    return out
