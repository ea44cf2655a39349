"""Extra keys per span (kvtier.base.keys): every input beside the tokens that changes KV changes the keys of the
chunks it overlaps and, through the chain, of every later chunk; the chunks before it keep their keys; no extras
give exactly the token-only chain (the golden vectors of test_keys.py)."""

import hashlib
import struct

import pytest
import torch

from kvtier.base.errors import InvalidArgument
from kvtier.base.keys import NO_EXTRAS, SPAN_END, ExtraKeys, InputKind, Namespace, SpanKey, chunk_hashes
from kvtier.base.layout import KVSpec
from tests.base.test_keys import GOLDEN_CHUNKS, NS

TOKENS = [0] * 64  # placeholder ids, the same for every image or embedding of this length
CHUNK = 8
NS8 = Namespace("extras/model@rev1", KVSpec(2, 4, 8, torch.bfloat16), CHUNK)


def image(value: bytes, start: int = 20, end: int = 36) -> ExtraKeys:
    return ExtraKeys.of([SpanKey(InputKind.MULTIMODAL, start, end, value)])


def test_no_extras_give_the_golden_token_chain():
    tokens = list(range(10))
    assert [h.hex() for h in NS.chunk_hashes(tokens, NO_EXTRAS)] == GOLDEN_CHUNKS
    assert [h.hex() for h in NS.chunk_hashes(tokens, None)] == GOLDEN_CHUNKS
    far = image(b"img", start=100, end=200)  # overlaps no full chunk of these tokens
    assert [h.hex() for h in NS.chunk_hashes(tokens, far)] == GOLDEN_CHUNKS


def test_different_inputs_differ_from_the_first_overlapping_chunk_on():
    a, b = NS8.chunk_hashes(TOKENS, image(b"cat")), NS8.chunk_hashes(TOKENS, image(b"dog"))
    plain = NS8.chunk_hashes(TOKENS)
    first = 20 // CHUNK  # the chunk holding the span's first position
    assert a[:first] == b[:first] == plain[:first]  # chunks before the span are unchanged
    assert not set(a[first:]) & set(b[first:])  # every chunk from the span on differs, past its end too
    assert not set(a[first:]) & set(plain[first:])


def test_the_same_inputs_give_the_same_keys():
    assert NS8.chunk_hashes(TOKENS, image(b"cat")) == NS8.chunk_hashes(TOKENS, image(b"cat"))


@pytest.mark.parametrize("other", [image(b"cat", 21, 36), image(b"cat", 20, 37),
                                   ExtraKeys.of([SpanKey(InputKind.PROMPT_EMBEDS, 20, 36, b"cat")])])
def test_the_span_and_the_kind_are_part_of_the_key(other):
    assert NS8.chunk_hashes(TOKENS, other)[2:] != NS8.chunk_hashes(TOKENS, image(b"cat"))[2:]


def test_order_of_spans_is_part_of_the_key():
    one, two = SpanKey(InputKind.MULTIMODAL, 0, 8, b"a"), SpanKey(InputKind.MULTIMODAL, 0, 8, b"b")
    assert NS8.chunk_hashes(TOKENS, ExtraKeys.of([one, two])) != NS8.chunk_hashes(TOKENS, ExtraKeys.of([two, one]))


def test_per_chunk_embedding_digests_key_each_chunk():
    def embeds(rows: torch.Tensor) -> ExtraKeys:
        return ExtraKeys.of(SpanKey(InputKind.PROMPT_EMBEDS, i, i + CHUNK,
                                    hashlib.sha256(rows[i : i + CHUNK].numpy().tobytes()).digest())
                            for i in range(0, len(rows), CHUNK))

    x = torch.randn(64, 16)
    y = x.clone()
    y[50] += 1  # one row of chunk 6 differs
    kx, ky = NS8.chunk_hashes(TOKENS, embeds(x)), NS8.chunk_hashes(TOKENS, embeds(y))
    assert kx[:6] == ky[:6] and not set(kx[6:]) & set(ky[6:])
    assert NS8.chunk_hashes(TOKENS, embeds(x.clone())) == kx


def test_a_span_to_the_end_keys_every_chunk():
    lora = ExtraKeys.of([SpanKey(InputKind.LORA, 0, SPAN_END, b"adapter-1")])
    assert not set(NS8.chunk_hashes(TOKENS, lora)) & set(NS8.chunk_hashes(TOKENS))


def test_documented_formula():
    span = SpanKey(InputKind.MULTIMODAL, 4, 12, b"hash")
    keys = chunk_hashes(NS8.root, TOKENS[:16], CHUNK, ExtraKeys.of([span]))
    encoded = struct.pack("<I", 2) + b"mm" + struct.pack("<QQI", 4, 12, 4) + b"hash"
    prev = NS8.root
    for i in range(2):
        body = struct.pack("<I", CHUNK) + struct.pack(f"<{CHUNK}I", *TOKENS[i * CHUNK : (i + 1) * CHUNK])
        prev = hashlib.sha256(prev + body + b"kvtier/extra/v1" + struct.pack("<I", 1) + encoded).digest()
        assert keys[i] == prev


def test_encoding_round_trips_and_rejects_garbage():
    extras = ExtraKeys.of([SpanKey(InputKind.LORA, 0, SPAN_END, b"x"), SpanKey(InputKind.CACHE_SALT, 0, 1, b"s"),
                           SpanKey(InputKind.PROMPT_EMBEDS, 8, 16, bytes(32))])
    assert ExtraKeys.decode(extras.encode()) == extras
    assert ExtraKeys.decode(NO_EXTRAS.encode()) == NO_EXTRAS
    data = extras.encode()
    for bad in (data[:-1], data + b"\0", b"", struct.pack("<I", 1) + struct.pack("<I", 3) + b"zzz" + bytes(20)):
        with pytest.raises(InvalidArgument):
            ExtraKeys.decode(bad)


@pytest.mark.parametrize("start,end", [(-1, 4), (4, 4), (5, 4), (0, SPAN_END + 1)])
def test_empty_or_negative_spans_are_rejected(start, end):
    with pytest.raises(InvalidArgument):
        SpanKey(InputKind.MULTIMODAL, start, end, b"x")
