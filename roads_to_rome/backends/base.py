"""The backend contract: everything the engine, the pipelines and the server ask of a model.

A backend runs one causal LM over a batch of token streams that it caches itself. The engine
never touches a framework: torch (`torch_backend.py`), llama.cpp (`llamacpp.py`) and any later
backend implement `Backend`, and one contract test suite (tests/test_backends.py) runs against
each. Conventions shared by every member:

- A batch is a set of rows, one token stream each, left-padded to one width. Columns are
  positions in that padded layout; `attention_mask` [B, columns] marks padding with 0.
- A cache remembers how many columns it has read (`cache.length`); `forward` reads the next ones.
- Logits are float32 over the tokenizer's ids only (`vocab_size` columns): rows an output head
  has beyond the tokenizer (padding rows, e.g. 151,936 vs 152,064 in the paper's own pair) are
  never returned, so they are never sampled and two models' logits always line up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

SCORE_CHUNK = 64  # positions whose logits a scored prompt holds at once (`score_sequence`): 39 MB at 150k tokens
# Columns of a scored prompt a model's trunk reads at once: its attention holds [heads, SCORE_READ, T] scores, not
# [heads, T, T], while each read stays long enough to run near the best rate.
SCORE_READ = 256
ChunkVisitor = Callable[[int, torch.Tensor, torch.Tensor], None]


class Cache(Protocol):
    length: int  # columns of the token streams already read into the cache


@runtime_checkable
class Backend(Protocol):
    name: str
    """What the model is called in results and errors (its spec or the default pair's name)."""

    num_params: int
    """Parameters as loaded (output head included): the cost of one token, as the paper counts."""

    vocab_size: int
    """Logit columns returned: the tokenizer's ids, capped by the output head's rows."""

    hidden_size: int
    """Width of the last hidden state (after the final norm, the output head's input)."""

    eos_ids: set[int]
    """Ids the model itself says end a generation (generation config, end-of-generation tokens)."""

    max_context: int
    """The most positions one row may hold (prompt + generated)."""

    kv_capacity: int | None
    """Tokens the caches of all rows hold together (a shared pool: the sum of the rows' real tokens,
    padding excluded, must stay within it); None when each row's cache is only limited by memory."""

    max_rows: int | None
    """The most rows one cache may hold at once; None when only memory limits it."""

    kernels: str
    """What runs the model's arithmetic here, for speed figures: a build's CPU kernels (llama.cpp: AVX512 REPACK
    ...), torch's CPU capability or the GPU, or the server a remote model runs on."""

    full_logits: bool
    """Whether the logits cover the whole vocabulary; False when only the top log-probabilities are known (a
    remote server's; the rest sit at a floor far below): exact for greedy, not for speculative sampling."""

    scores_prompts: bool
    """Whether the model can score a given sequence's tokens: a local model's whole logits (`forward_sequence`), or
    a server's own prompt log-probabilities (`prompt_logprobs`: vLLM's)."""

    grouped_reads: bool
    """Whether one read of several rows' new columns costs little more than a read of one row's one column, so that
    grouping routed rows into one LLM call pays (`--defer auto`): on CUDA, and torch's bf16 matrix kernels on a CPU
    that computes in bf16 itself (AMX, AVX512-BF16); not llama.cpp's CPU kernels, whose reads cost about their
    columns."""

    remote: bool
    """Whether the model runs elsewhere (a server): its calls wait on a network, not on this machine's cores, so they
    run beside the SLM's steps by default (`--overlap auto`)."""

    @property
    def device(self) -> torch.device:
        """Where the tensors the backend returns live (and where it wants its inputs)."""

    def health(self) -> dict | None:
        """None while the model answers (a local one always does); for a model behind a server that is away, what a
        health check reports of it (its address, how long it has been down)."""

    def new_cache(self) -> Cache:
        """An empty cache, for a batch of any number of rows."""

    def forward(self, cache: Cache, new_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read `new_ids` [B, n] (the columns after `cache.length`); `attention_mask` covers every
        column up to and including them. Returns the logits [B, V] and last hidden state [B, H] at
        each row's last column."""

    def read(self, cache: Cache, new_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """As `forward`, for columns whose outputs nobody needs (a prompt read ahead, a newcomer catching up
        with its batch). A local model reads them at once; a remote one leaves them to its next forward."""

    def complete(self, cache: Cache, new_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int
                 ) -> list[list[int]] | None:
        """Where the model writes whole continuations in one go (a server: one request per row, all at once): read
        `new_ids` as `read` does, then each row's greedy continuation, up to `max_new_tokens`, ending before an
        EOS. None where it decodes token by token here: then nothing is read, and the caller steps `forward`
        (`greedy` does)."""

    def forward_all(self, cache: Cache, new_ids: torch.Tensor, attention_mask: torch.Tensor,
                    keep_last: int | None = None, row_keep: list[int] | None = None) -> torch.Tensor:
        """As `forward`, but the logits at every new column [B, n, V], or at the last `keep_last` of them
        (what a verifier needs: each position's next-token distribution). Padding columns give zeros.
        `row_keep[i]`: how many of those last columns row i needs (none: 0); a backend may leave the others zero
        (a server: so that a row whose tokens nobody checks costs it nothing)."""

    def forward_sequence(self, ids: list[int], start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: logits [T - start, V] and hidden states [T - start, H] at positions start.. (positions
        before `start` are read but give no output), no cache kept."""

    def score_sequence(self, ids: list[int], cache: Cache, each_chunk: ChunkVisitor) -> None:
        """Read one sequence into `cache` (empty) as `forward_sequence` does, handing its logits and hidden states
        to `each_chunk(first, logits [n, V], hidden [n, H])` at most `SCORE_CHUNK` positions at a time (positions
        first..first + n - 1): a prompt scored in the memory of one chunk's logits, not of the whole [T, V]."""

    def tag_rows(self, cache: Cache, salts: list[str | None]) -> None:
        """Each of the cache's rows' `cache_salt`, in order, before a call that reads them: a server with a prefix
        cache of its own (vLLM's) gets each row's with its requests, so that no request reuses what another salt's
        requests read. Local backends keep no prompts of their own (core/prefix_cache.py fences theirs)."""

    def select_rows(self, cache: Cache, rows: torch.Tensor) -> None:
        """Keep only these rows, in this order (finished requests leave the batch)."""

    def copy_rows(self, cache: Cache, rows: list[int]) -> Cache:
        """A new cache holding copies of these rows of `cache` (a row may be named more than once), which is
        left as it was: branches that share a prefix read it once (the label pipeline's rollouts)."""

    def append_rows(self, cache: Cache, other: Cache) -> None:
        """Add `other`'s rows after this cache's (both cover the same columns); `other` is spent."""

    def pad_left(self, cache: Cache, n: int) -> None:
        """Prepend n padding columns to every row (a longer newcomer widens the batch). An empty cache stays empty:
        its first read covers the padding columns too."""

    def truncate(self, cache: Cache, length: int) -> None:
        """Forget every column from `length` on (no-op when the cache holds fewer)."""

    def trim_left(self, cache: Cache, n: int) -> None:
        """Forget the first n columns, padding in every row (a row copied out of its batch, kept alone: prefix
        caching); the columns after them keep their positions."""

    def shift_rows(self, cache: Cache, shifts: list[int]) -> None:
        """Move row i's columns right by shifts[i]: its last shifts[i] columns are forgotten and as many
        padding columns come in on its left (a row rolled back by verification stays left-padded)."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the token-embedding table for these ids (the router's token input)."""

    def embedding_table(self) -> torch.Tensor:
        """The whole token-embedding table [rows, E] (the router checkpoint's identity)."""


class LocalBackend:
    """What every backend whose model runs in this process shares: it always answers, decodes token by token, and
    reads columns at once (its `forward`, outputs dropped)."""

    remote = False
    scores_prompts = True  # (from its whole logits)

    def health(self) -> None:
        return None

    def tag_rows(self, cache: Cache, salts: list[str | None]) -> None:
        return None

    def complete(self, cache: Cache, new_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int
                 ) -> None:
        return None

    def read(self, cache: Cache, new_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.forward(cache, new_ids, attention_mask)


def mask_for(cache: Cache, n_new: int, device) -> torch.Tensor:
    """The attention mask of one unpadded row after reading n_new more tokens."""
    return torch.ones(1, cache.length + n_new, dtype=torch.long, device=device)


@torch.inference_mode()
def greedy(backend: Backend, cache: Cache, new_ids: list[list[int]], max_new_tokens: int | list[int], eos_ids: set[int],
           stop: Callable[[int, list[int]], bool] | None = None, attention_mask: torch.Tensor | None = None
           ) -> list[list[int]]:
    """Rows decoded greedily together. Row i reads `new_ids[i]` (every row as many) after what `cache` holds, then
    writes up to `max_new_tokens` (or its own entry of it) tokens, stopping before an EOS or after a token for
    which `stop(i, tokens_so_far)` is true. `attention_mask` covers the columns `cache` holds (default: no
    padding). A row that ends while others go on leaves the cache; the last ones stay in it, which a caller
    may cut back and reuse. A model behind a server (`complete`) writes every row there, in one request each,
    at once; each is then cut where it would have stopped."""
    n_rows = len(new_ids)
    limits = [max_new_tokens] * n_rows if isinstance(max_new_tokens, int) else list(max_new_tokens)
    outs: list[list[int]] = [[] for _ in range(n_rows)]
    mask = attention_mask if attention_mask is not None else \
        torch.ones(n_rows, cache.length, dtype=torch.long, device=backend.device)
    ids = torch.tensor(new_ids, device=backend.device)

    def add(i: int, token: int) -> bool:
        """Whether row i goes on after `token`."""
        if token in eos_ids or len(outs[i]) >= limits[i]:
            return False
        outs[i].append(token)
        return len(outs[i]) < limits[i] and not (stop is not None and stop(i, outs[i]))

    whole = backend.complete(cache, ids, torch.cat([mask, mask.new_ones(n_rows, ids.shape[1])], dim=1), max(limits))
    if whole is not None:
        for i, written in enumerate(whole):
            for token in written:
                if not add(i, token):
                    break
        return outs
    live = list(range(n_rows))  # cache row -> row
    while live:
        mask = torch.cat([mask, mask.new_ones(len(live), ids.shape[1])], dim=1)
        logits, _ = backend.forward(cache, ids, mask)
        going = [r for r, (i, token) in enumerate(zip(live, logits.argmax(-1).tolist())) if add(i, token)]
        if not going:
            break
        if len(going) < len(live):
            keep = torch.tensor(going, device=backend.device)
            backend.select_rows(cache, keep)
            mask, live = mask[keep], [live[r] for r in going]
        ids = torch.tensor([[outs[i][-1]] for i in live], device=backend.device)
    return outs
