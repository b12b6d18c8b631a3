"""Turning token ids back into text piece by piece, for highlighting and streaming."""

from __future__ import annotations


def token_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """One string per token whose concatenation is `tokenizer.decode(token_ids)` (special tokens skipped).

    A token that ends inside a multi-byte character gets "" and the character goes to the token
    that completes it. Each piece is found by decoding a short window, so this is linear in length.
    """
    pieces, done = [], 0  # `done`: tokens whose text is already in `pieces`
    for i in range(len(token_ids)):
        start = max(done - 4, 0)  # a little left context: some tokenizers strip a leading space otherwise
        before = tokenizer.decode(token_ids[start:done], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[start : i + 1], skip_special_tokens=True)
        if after.endswith("\ufffd") and i + 1 < len(token_ids):
            pieces.append("")  # incomplete character: wait for the next token
            continue
        pieces.append(after[len(before) :] if after.startswith(before) else after)
        done = i + 1
    return pieces
