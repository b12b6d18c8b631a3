"""Prompts read before, kept so that a newcomer whose prompt begins the same way reads only the rest (prefix caching,
as vLLM's automatic prefix caching and llama.cpp's `cache_prompt` do): a conversation's next turn, an agent loop's
next step, the n choices of one prompt, prompts that share a system message.

Each model keeps its own (`PrefixCache`): a kept prompt is a one-row cache of that model holding exactly its tokens,
copied (`Backend.copy_rows`) when the scheduler's `PromptRead` has read it, and again, with its answer, when the
sequence leaves the batch finished (what the model read of it, its padding trimmed). A newcomer's read starts from a
copy of the kept cache that shares the longest beginning with its prompt, cut back to what they share. The least
recently used kept prompt goes first when the budget in tokens or in rows is spent, or when a newcomer needs its KV
room (`Scheduler.admit`).

A request's `cache_salt` (vLLM's field) fences what it keeps and finds: only requests with the same salt share,
and those without one share only among themselves. On a server shared by users who must not learn each other's
prompts (a kept prompt is read faster, and `cached_tokens` says so), each user's secret salt keeps them apart."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from roads_to_rome.core.layout import NO_ROWS

KEPT_ROWS = 16  # prompts each model keeps at most (on llama.cpp each holds one of the context's sequences)
PREFIX_TOKENS = 16384  # tokens each model keeps by default (the server's --prefix-cache-tokens, a chat's)


def kept_prompt_rows(batch_rows: int, context_rows: int | None = None) -> int:
    """Prompts a model keeps beside a batch of `batch_rows`: KEPT_ROWS, or, on a backend with a fixed number of rows
    (`context_rows`: llama.cpp's sequences, each kept prompt holding one), as many as it holds beyond the batch's."""
    return KEPT_ROWS if context_rows is None else max(0, min(KEPT_ROWS, context_rows - batch_rows))



@dataclass
class Kept:
    tokens: np.ndarray  # what the cache holds
    cache: object  # one row, no padding
    salt: str | None  # only requests with this `cache_salt` find it


class PrefixCache:
    """One model's kept prompts, least recently used first."""

    def __init__(self, model, max_tokens: int, max_rows: int = KEPT_ROWS):
        """`model`: the backend (or the LLM's queue, `LLMCalls`) whose caches these are; `max_tokens`: the tokens
        kept at most; `max_rows`: the prompts kept at most."""
        self.model, self.max_tokens, self.max_rows = model, max_tokens, max_rows
        self.kept: OrderedDict[int, Kept] = OrderedDict()
        self.tokens = 0  # held by the kept caches together
        self._keys = itertools.count()

    def take(self, ids: list[int] | tuple[int, ...], salt: str | None = None) -> tuple[object | None, int]:
        """A new cache holding the longest beginning of `ids` a prompt kept with `salt` shares (a copy: the kept one
        stays), and how many tokens that is; (None, 0) when no such kept prompt begins as `ids` does."""
        ids = np.asarray(ids, dtype=np.int64)
        best, key = 0, None
        for k, kept in self.kept.items():
            if kept.salt != salt:
                continue
            shared = common_prefix(kept.tokens, ids)
            if shared > best:
                best, key = shared, k
        if key is None:
            return None, 0
        self.kept.move_to_end(key)
        cache = self.model.copy_rows(self.kept[key].cache, [0])
        self.model.truncate(cache, best)
        return cache, best

    def keep(self, ids: list[int] | tuple[int, ...], cache, row: int = 0, pad: int = 0, salt: str | None = None):
        """Keep a copy of `cache`'s `row`, which holds `pad` padding columns and then exactly `ids`, for requests
        with `salt`. A prompt kept with it that begins `ids` goes (this one holds it too); if one holds `ids` already,
        nothing new is kept."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids) or len(ids) > self.max_tokens or not self.max_rows:
            return
        for k, kept in list(self.kept.items()):
            if kept.salt != salt:
                continue
            shared = common_prefix(kept.tokens, ids)
            if shared == len(ids):
                self.kept.move_to_end(k)
                return
            if shared == len(kept.tokens):
                self._drop(k)
        while self.kept and (self.tokens + len(ids) > self.max_tokens or len(self.kept) >= self.max_rows):
            self.evict()
        copied = self.model.copy_rows(cache, [row])
        if pad:
            self.model.trim_left(copied, pad)
        self.kept[next(self._keys)] = Kept(ids, copied, salt)
        self.tokens += len(ids)

    def evict(self) -> bool:
        """Let the least recently used kept prompt go; False when none is kept."""
        if not self.kept:
            return False
        self._drop(next(iter(self.kept)))
        return True

    def clear(self) -> None:
        while self.evict():
            pass

    def _drop(self, key: int) -> None:
        kept = self.kept.pop(key)
        self.tokens -= len(kept.tokens)
        self.model.select_rows(kept.cache, NO_ROWS)  # (llama.cpp: its sequence goes back to the context now)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens `a` and `b` share from their first."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
