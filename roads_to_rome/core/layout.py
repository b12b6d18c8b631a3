"""A batch's tensors and caches, apart from its logic: the token streams (one row per sequence, left-padded to a
common width) and their padding mask, and each model's KV cache. Rows join (padded to the batch's width, or the
batch to theirs, and read up to where each cache is), leave, move right (a roll-back, a row that stands still) and
gain a column per step; both caches follow every move. Each model's cache holds only the rows that model may read
(`writer_rows`, `llm_rows`: `Context.readers`): a row forced onto one model costs that model alone. `Batch`
(batch.py) decides the moves; this does them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from roads_to_rome.core.context import Context

NO_ROWS = torch.empty(0, dtype=torch.long)  # the `select_rows` index that keeps none: a cache lets go of every row


class Layout:
    """The token streams, [rows, columns], in buffers with room for the columns to come (a step writes its column in
    place: `ids` and `mask` are the columns so far), and the writer's and the LLM's caches (None for one model
    alone). The writer's cache covers the rows in `writer_rows` and, once it has read, every column but the newest;
    the LLM's the rows in `llm_rows`, and the columns it has caught up on (rows ascending in both)."""

    def __init__(self, context: Context):
        self.context = context
        self._ids = self._mask = None
        self._width = 0
        self.writer_cache, self.llm_cache = self.new_caches()
        self.writer_rows: list[int] = []
        self.llm_rows: list[int] = []

    def new_caches(self):
        context = self.context
        return context.writer.new_cache(), context.llm.new_cache() if context.routes else None

    @property
    def ids(self) -> torch.Tensor | None:
        return None if self._ids is None else self._ids[:, : self._width]

    @property
    def mask(self) -> torch.Tensor | None:
        return None if self._mask is None else self._mask[:, : self._width]

    @property
    def width(self) -> int:
        return self._width

    def writer_part(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of a [rows, ...] tensor that the writer's cache holds, in its order."""
        return t if len(self.writer_rows) == t.shape[0] else t[self.writer_rows]

    def llm_part(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of a [rows, ...] tensor that the LLM's cache holds, in its order."""
        return t if len(self.llm_rows) == t.shape[0] else t[self.llm_rows]

    def caches(self):
        """(backend, cache) for each model the batch runs."""
        yield self.context.writer, self.writer_cache
        if self.llm_cache is not None:
            yield self.context.llm, self.llm_cache

    def set(self, ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        self._ids, self._mask = ids, mask
        self._width = 0 if ids is None else ids.shape[1]

    def join(self, prompts: list[tuple[int, ...]], readers: list[tuple[bool, bool]], prefilled: tuple | None = None
             ) -> None:
        """New rows: their prompts, read up to where each cache is, each by the models of its `readers` (whether the
        writer, the LLM reads it: `Context.readers`). `prefilled`: one prompt's (writer's cache, LLM's cache), each
        None where that model did not read it, read alone by the scheduler's chunked prefill. Into an empty layout
        they come as they are."""
        context = self.context
        ids, mask = left_pad(prompts, context.pad_id, context.writer.device)
        writers = [j for j, (writes, _) in enumerate(readers) if writes]
        llms = [j for j, (_, reads) in enumerate(readers) if reads]
        if self._ids is None:  # the next step reads what their caches have not
            self.set(ids, mask)
            if prefilled:  # (the layout's own caches are empty: made new, or let go by `release`)
                self.writer_cache = self.writer_cache if prefilled[0] is None else prefilled[0]
                self.llm_cache = self.llm_cache if prefilled[1] is None else prefilled[1]
            self.writer_rows, self.llm_rows = writers, llms
            return
        width, rows = self._width, self._ids.shape[0]
        if ids.shape[1] > width:
            self.pad_left(ids.shape[1] - width)
        elif ids.shape[1] < width:
            ids, mask = pad_columns_left(ids, mask, width - ids.shape[1], context.pad_id)
        pad = self._width - len(prompts[0]) if prefilled else 0  # the prefilled row's padding
        joining = self._catch_up_newcomers(ids, mask, writers, llms, prefilled, pad)
        for backend, cache, fresh in joining:
            backend.append_rows(cache, fresh)
        self.set(torch.cat([self.ids, ids]), torch.cat([self.mask, mask]))
        self.writer_rows += [rows + j for j in writers]
        self.llm_rows += [rows + j for j in llms]

    def _catch_up_newcomers(self, ids, mask, writers: list[int], llms: list[int], prefilled: tuple | None,
                            pad: int) -> list:
        """The newcomers' caches brought up to where each of the batch's is (each model's for the newcomers it
        reads): (backend, cache, theirs) to append once every forward has run (a failure leaves the batch as it
        was). A prefilled cache has read the prompt alone: cut it to what the batch's cache covers and pad it to the
        batch's columns (positions count real tokens only, so padding it afterwards changes nothing). A cache that
        has read nothing yet takes its rows at its first read: a prefilled cache for it is let go."""
        context, joining = self.context, []
        mine = lambda rows: (ids, mask) if len(rows) == ids.shape[0] else (ids[rows], mask[rows])  # noqa: E731
        parts = [(context.writer, self.writer_cache, *mine(writers), prefilled[0] if prefilled else None)]
        if self.llm_cache is not None:
            parts.append((context.llm, self.llm_cache, *mine(llms), prefilled[1] if prefilled else None))
        try:
            for backend, cache, new_ids, new_mask, fresh in parts:
                if not cache.length or not new_ids.shape[0]:
                    if fresh is not None:
                        backend.select_rows(fresh, NO_ROWS)
                    continue
                fresh = fresh if fresh is not None else backend.new_cache()
                joining.append((backend, cache, fresh))
                keep = max(0, min(fresh.length, cache.length - pad))
                backend.truncate(fresh, keep)  # (to 0: reused as new, holding no more rows than the request needs)
                if keep:
                    backend.pad_left(fresh, pad)
                if fresh.length < cache.length:
                    backend.read(fresh, new_ids[:, fresh.length : cache.length], new_mask[:, : cache.length])
        except BaseException:
            for backend, _, fresh in joining:  # now: the error's traceback keeps them (see `release`)
                backend.select_rows(fresh, NO_ROWS)
            raise
        return joining

    def keep_rows(self, rows: list[int], prefixes: tuple, salts: list[str | None]) -> None:
        """Each model with kept prompts (`prefixes`: the writer's, the LLM's) keeps what it has read of these rows,
        each alone, its padding trimmed, for requests with the row's salt (core/prefix_cache.py)."""
        pads = {i: int((self.mask[i] == 0).sum()) for i in rows}  # (a row's padding is on its left)
        for cache, held, kept in ((self.writer_cache, self.writer_rows, prefixes[0]),
                                  (self.llm_cache, self.llm_rows, prefixes[1])):
            if kept is None or cache is None:
                continue
            place = {row: k for k, row in enumerate(held)}  # batch row -> its row in the cache
            for i, salt in zip(rows, salts):
                if i in place and cache.length > pads[i]:
                    kept.keep(self.ids[i, pads[i] : cache.length].tolist(), cache, place[i], pads[i], salt)

    def append_column(self, tokens: torch.Tensor) -> None:
        """Write a column of tokens after the last one, growing the buffers (doubling them) when full."""
        rows, room = self._ids.shape
        if self._width == room:
            grow = max(room, 64)
            self._ids = torch.cat([self._ids, self._ids.new_full((rows, grow), self.context.pad_id)], dim=1)
            self._mask = torch.cat([self._mask, self._mask.new_zeros((rows, grow))], dim=1)
        self._ids[:, self._width] = tokens
        self._mask[:, self._width] = 1
        self._width += 1

    def pad_left(self, n: int) -> None:
        self.set(*pad_columns_left(self.ids, self.mask, n, self.context.pad_id))
        for backend, cache in self.caches():
            backend.pad_left(cache, n)

    def keep(self, rows: list[int]) -> None:
        """Only these rows stay, in this order. With none left the caches are let go at once: on llama.cpp their
        cells would shift where the next request's go; so is a model's when none of its rows stays."""
        if not rows:
            self.release()
            return
        self.set(self.ids[rows], self.mask[rows])
        self.writer_rows, self.writer_cache = self._keep(self.context.writer, self.writer_cache, self.writer_rows, rows)
        if self.llm_cache is not None:
            self.llm_rows, self.llm_cache = self._keep(self.context.llm, self.llm_cache, self.llm_rows, rows)

    def _keep(self, backend, cache, held: list[int], rows: list[int]) -> tuple[list[int], object]:
        """One model's cache, holding the batch rows `held`, after the batch keeps `rows`: the rows it holds then,
        and the cache (a new one when it holds none)."""
        place = {row: k for k, row in enumerate(held)}  # batch row -> its row in the cache
        kept = [place[row] for row in rows if row in place]
        if len(kept) != len(held) or kept != list(range(len(held))):
            backend.select_rows(cache, torch.tensor(kept, dtype=torch.long, device=self._ids.device))
        return [i for i, row in enumerate(rows) if row in place], cache if kept else backend.new_cache()

    def shift(self, shifts: list[int]) -> None:
        """Move each row right by its shift, with as many padding columns on its left, so that every row still ends
        at the last column: the batch stays rectangular and left-padded, which is all the backends assume. Both
        caches move the same way (`Backend.shift_rows`); what a row's shift pushes out of the LLM's is read again at
        its next catch-up."""
        self.context.writer.shift_rows(self.writer_cache, [shifts[i] for i in self.writer_rows])
        if self.llm_cache is not None:
            self.context.llm.shift_rows(self.llm_cache, [shifts[i] for i in self.llm_rows])
        width = self._width
        ids, mask = torch.full_like(self.ids, self.context.pad_id), torch.zeros_like(self.mask)
        for i, d in enumerate(shifts):
            ids[i, d:], mask[i, d:] = self.ids[i, : width - d], self.mask[i, : width - d]
        self.set(ids, mask)

    def release(self) -> None:
        """Let go of every row now. A dropped batch gives back what its caches hold (llama.cpp: one of a fixed
        number of sequences per row) when it is collected, and a failed step's traceback, which refers to it,
        puts that off until the garbage collector runs: the next requests would find no sequence free."""
        for backend, cache in self.caches():
            backend.select_rows(cache, NO_ROWS)
        self.set(None, None)
        self.writer_cache, self.llm_cache = self.new_caches()
        self.writer_rows, self.llm_rows = [], []


def pad_columns_left(ids: torch.Tensor, mask: torch.Tensor, n: int, pad_id: int):
    return (torch.cat([ids.new_full((ids.shape[0], n), pad_id), ids], dim=1),
            torch.cat([mask.new_zeros((mask.shape[0], n)), mask], dim=1))


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)
