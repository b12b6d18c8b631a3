from roads_to_rome.text import token_pieces


def test_pieces_concatenate_to_the_decoded_text(tokenizer):
    text = "Bonjour! Über naïve café — 東京 🙂 The answer is 72."
    ids = tokenizer(text)["input_ids"]
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
