"""Turning token ids back into text piece by piece, for highlighting and streaming."""

from __future__ import annotations


class Detokenizer:
    """Incremental detokenization: `push(token)` returns the text that token adds.

    Decodes a short window rather than the whole sequence, so it stays linear in length. A token
    that ends inside a multi-byte character adds "" and the character comes with the token that
    completes it; a few tokens of left context keep tokenizers that strip leading spaces honest.
    """

    def __init__(self, tokenizer, context: int = 4, skip_special_tokens: bool = True):
        self.tokenizer, self.context, self.skip = tokenizer, context, skip_special_tokens
        self.ids: list[int] = []
        self.done = 0  # tokens whose text has been returned

    def push(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        start = max(self.done - self.context, 0)
        before = self.tokenizer.decode(self.ids[start : self.done], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[start:], skip_special_tokens=self.skip)
        if after.endswith("\ufffd") and not final:
            return ""  # incomplete character: wait for the next token
        self.done = len(self.ids)
        return after[len(before) :] if after.startswith(before) else after


def token_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """One string per token whose concatenation is `tokenizer.decode(token_ids)` (special tokens skipped)."""
    detok = Detokenizer(tokenizer)
    return [detok.push(t, final=i == len(token_ids) - 1) for i, t in enumerate(token_ids)]

