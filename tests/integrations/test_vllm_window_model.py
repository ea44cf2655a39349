"""The window model's word-level tokenizer at a benchmark's vocabulary (harness/window_model.py): every token has a
word of its own, and a prompt of random tokens stays under the 6 characters a token vLLM's OpenAI server allows
before it tokenizes a prompt (a longer one is refused with 400 before it reaches the engine)."""

from __future__ import annotations

import random

import pytest

from harness.window_model import SMALL, TINY, word, write_tokenizer


@pytest.mark.parametrize("shape", [TINY, SMALL], ids=["tiny", "small"])
def test_words_round_trip_within_vllms_character_bound(tmp_path, shape):
    from transformers import AutoTokenizer

    vocab = shape["vocab"]
    write_tokenizer(tmp_path, vocab)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == vocab
    rng = random.Random(0)
    ids = [rng.randrange(3, vocab) for _ in range(2048)]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False).input_ids == ids
    assert len(text) <= 6 * len(ids)
    assert len({word(i, vocab) for i in range(3, vocab)}) == vocab - 3


def test_tiny_words_are_the_tests_words():
    assert [word(i) for i in (3, 40, 511)] == ["w3", "w40", "w511"]
