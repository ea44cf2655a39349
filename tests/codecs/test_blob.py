import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.base.errors import BlobError
from kvtier.codecs import blob as blob_module
from kvtier.codecs import get_codec
from kvtier.codecs import raw as raw_codec
from kvtier.codecs.blob import MAGIC, blob_bytes, decode_blob, encode_blob, parse_blob

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
RAW = get_codec("raw")


def make(dtype=torch.bfloat16, tokens=16, seal=True, key=KEY, seed=0):
    chunk = torch.randn((3, 2, tokens, 2, 8), generator=torch.Generator().manual_seed(seed)).to(dtype)
    ids = np.arange(1000, 1000 + tokens, dtype="<u4")
    return chunk, ids, bytes(blob_bytes(encode_blob(key, ids, RAW, chunk, seal=seal)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip(dtype):
    chunk, ids, data = make(dtype)
    out = decode_blob(data, KEY, ids, codec=RAW)
    assert out.dtype == dtype and torch.equal(out, chunk)


def test_round_trip_from_non_contiguous_chunk():
    full = torch.randn(3, 2, 64, 2, 8)
    chunk = full[:, :, 16:32]
    assert not chunk.is_contiguous()
    ids = np.arange(16, dtype="<u4")
    out = decode_blob(blob_bytes(encode_blob(KEY, ids, RAW, chunk)), KEY, ids)
    assert torch.equal(out, chunk)


def test_payload_is_64_byte_aligned():
    _, ids, data = make()
    header, payload = parse_blob(data, KEY, ids)
    assert header.header_len % 64 == 0 and len(data) - payload.nbytes == header.header_len


def test_truncation_at_every_length_is_a_miss():
    _, ids, data = make(tokens=4)
    for n in range(len(data)):
        with pytest.raises(BlobError):
            decode_blob(data[:n], KEY, ids)


def test_bit_flip_anywhere_is_a_miss():
    _, ids, data = make(tokens=4)
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x10
        with pytest.raises(BlobError):
            decode_blob(bytes(flipped), KEY, ids)


def test_payload_of_another_key_is_a_miss():
    _, ids, other = make(key=OTHER_KEY)
    with pytest.raises(BlobError, match="checksum"):
        decode_blob(other, KEY, ids)


def test_other_tokens_are_a_miss():
    _, ids, data = make()
    with pytest.raises(BlobError, match="tokens"):
        decode_blob(data, KEY, ids + 1)


def test_unknown_version_and_codec_are_misses():
    _, ids, data = make()
    bad_version = bytearray(data)
    bad_version[4:6] = (99).to_bytes(2, "little")
    with pytest.raises(BlobError, match="version"):
        parse_blob(bytes(bad_version), KEY, ids, verify=False)
    bad_codec = bytearray(data)
    bad_codec[6:8] = (777).to_bytes(2, "little")
    with pytest.raises(BlobError, match="codec"):
        parse_blob(bytes(bad_codec), KEY, ids, verify=False)


def test_unsealed_blob_fails_verification_but_parses_unverified():
    chunk, ids, data = make(seal=False)
    with pytest.raises(BlobError, match="sealed"):
        decode_blob(data, KEY, ids)
    assert torch.equal(decode_blob(data, KEY, ids, verify=False), chunk)


def test_huge_declared_shape_is_refused_before_any_allocation():
    _, ids, data = make(tokens=4)
    forged = bytearray(data)
    forged[40:44] = (2**31).to_bytes(4, "little")  # first dim of the shape
    with pytest.raises(BlobError):
        parse_blob(bytes(forged), KEY, ids, verify=False)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_never_crash(data):
    with pytest.raises(BlobError):
        decode_blob(data, KEY, None)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_blobs_are_misses_or_exact(data):
    chunk, ids, blob = make(tokens=4, seed=1)
    mutated = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(mutated) - 1))
        mutated[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, len(mutated)))]
    try:
        out = decode_blob(bytes(mutated), KEY, ids)
    except BlobError:
        return
    assert bytes(mutated) == blob and torch.equal(out, chunk)  # only the untouched blob may decode


def test_magic_is_stable():
    assert MAGIC == b"KVTB"


@pytest.mark.parametrize("codec,seal", [("raw", False), ("raw", True), ("int8", False)])
def test_payloads_written_together_hold_what_each_writes_alone(codec: str, seal: bool) -> None:
    """write_payloads defers raw chunks' copies to one call at the end; the bytes are write_into's. A sealed
    blob is written whole (its checksum covers the payload), so it defers nothing."""
    from kvtier.codecs.base import write_payloads

    chunks = [torch.randn(2, 2, 8, 2, 16).to(torch.bfloat16)[:, :, 1:7] for _ in range(3)]  # strided sources
    blobs = [encode_blob(bytes([i]) * 32, np.arange(6, dtype=np.uint32), get_codec(codec), c, seal=seal)
             for i, c in enumerate(chunks)]
    outs = [bytearray(b.nbytes) for b in blobs]
    deferred = [b.deferred_copies(memoryview(bytearray(b.nbytes))) for b in blobs]
    assert all(len(d) == (1 if codec == "raw" and not seal else 0) for d in deferred)
    write_payloads([(memoryview(o), b) for o, b in zip(outs, blobs)])
    assert outs == [blob_bytes(b) for b in blobs]


# -- sealing and verifying in the copy's one pass (runs long enough for the streaming kernel) ---------------------
def long_runs(seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """A chunk cut out of a longer prompt's KV (strided), each run 32 KiB: copied with ``copy_visiting``."""
    kv = torch.randn((2, 2, 192, 4, 64), generator=torch.Generator().manual_seed(seed)).to(torch.float16)
    return kv[:, :, 64:128], np.arange(64, dtype="<u4")


def test_a_seal_hashed_while_copying_is_the_seal_of_the_copied_bytes(monkeypatch) -> None:
    chunk, ids = long_runs()
    visits = []
    real = raw_codec.copy_visiting
    monkeypatch.setattr(raw_codec, "copy_visiting", lambda *a: visits.append(1) or real(*a))
    fused = bytes(blob_bytes(encode_blob(KEY, ids, RAW, chunk)))
    assert visits, "the raw chunk was not sealed in the copy's pass"
    monkeypatch.setattr(raw_codec, "copy_visiting", lambda *a: False)  # the two-pass seal: copy, then hash
    assert fused == bytes(blob_bytes(encode_blob(KEY, ids, RAW, chunk)))
    assert torch.equal(decode_blob(fused, KEY, ids, codec=RAW), chunk)


def test_verifying_while_copying_rejects_a_flipped_bit_anywhere(monkeypatch) -> None:
    """write_early checks the checksum while it copies into ``out``: the blob as stored decodes exactly, and a
    bit flipped in the header, the token ids or anywhere in the payload (every piece's edges included) is a
    BlobError, never a returned chunk."""
    chunk, ids = long_runs(seed=3)
    data = bytes(blob_bytes(encode_blob(KEY, ids, RAW, chunk)))
    header, _ = parse_blob(data, KEY, ids)
    visits = []
    real = blob_module.copy_visiting
    monkeypatch.setattr(blob_module, "copy_visiting", lambda *a: visits.append(1) or real(*a))
    out = torch.zeros(2, 2, 256, 4, 64, dtype=torch.float16)
    dest = out[:, :, 128:192]
    assert decode_blob(data, KEY, ids, codec=RAW, out=dest, write_early=True) is dest
    assert visits and torch.equal(dest, chunk) and not out[:, :, :128].any() and not out[:, :, 192:].any()
    hl, run = header.header_len, 64 * 4 * 64 * 2
    payload = {0, 1, len(data) - hl - 1, *range(run - 1, len(data) - hl, run), *range(run, len(data) - hl, run)}
    rng = np.random.default_rng(0)
    payload |= set(rng.integers(0, len(data) - hl, 64).tolist())
    for at in [*range(hl), *(hl + p for p in sorted(payload))]:
        flipped = bytearray(data)
        flipped[at] ^= 0x04
        with pytest.raises(BlobError):
            decode_blob(bytes(flipped), KEY, ids, codec=RAW, out=dest, write_early=True)
    with pytest.raises(BlobError):  # the right bytes under another key
        decode_blob(data, OTHER_KEY, ids, codec=RAW, out=dest, write_early=True)


def test_without_write_early_a_failed_checksum_leaves_out_untouched() -> None:
    chunk, ids = long_runs()
    flipped = bytearray(blob_bytes(encode_blob(KEY, ids, RAW, chunk)))
    flipped[-1] ^= 1
    out = torch.zeros_like(chunk)
    with pytest.raises(BlobError):
        decode_blob(bytes(flipped), KEY, ids, codec=RAW, out=out)
    assert not out.any()
