"""Compressed tiers through KVCache: round trips, corruption as a miss, no cross-codec reads."""

from __future__ import annotations

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.errors import BlobError
from kvtier.codecs import BytesPayload, get_codec
from kvtier.codecs.blob import blob_bytes, decode_blob, encode_blob
from kvtier.tiers import MemoryTierConfig
from tests.codecs.conftest import kv_like

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
CHUNK = 16


def make_cache(codec: str) -> KVCache:
    tiers = (MemoryTierConfig(capacity_bytes=4 << 20, codec=codec, prefault=False),)
    return KVCache(SPEC, model="test-model@1", config=CacheConfig(chunk_size=CHUNK, tiers=tiers))


def tokens_and_kv(n_chunks: int = 3, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    tokens = list(range(seed * 1000, seed * 1000 + n_chunks * CHUNK))
    return tokens, kv_like(layers=2, tokens=n_chunks * CHUNK, heads=2, dim=64, seed=seed)


@pytest.mark.parametrize("codec,tolerance", [("lossless", 0.0), ("int8", 0.01), ("int4", 0.15), ("cachegen", 0.15)])
def test_store_retrieve_through_compressed_tier(codec: str, tolerance: float) -> None:
    with make_cache(codec) as cache:
        tokens, kv = tokens_and_kv()
        assert cache.store(tokens, kv) == len(tokens)
        out, n = cache.retrieve(tokens)
        assert n == len(tokens)
        rel = ((out.float() - kv.float()).norm() / kv.float().norm()).item()
        assert rel <= tolerance
        if codec == "lossless":
            assert torch.equal(out, kv)
        used = cache.tiers[0].stats().used_bytes
        assert used < kv.numel() * 2 * (0.8 if codec == "lossless" else 0.6)


def test_compressed_tier_holds_more_chunks_than_raw() -> None:
    counts = {}
    for codec in ("raw", "int4"):
        tiers = (MemoryTierConfig(capacity_bytes=64 << 10, codec=codec, prefault=False),)
        with KVCache(SPEC, model="m", config=CacheConfig(chunk_size=CHUNK, tiers=tiers)) as cache:
            for seed in range(12):
                tokens, kv = tokens_and_kv(1, seed)
                cache.store(tokens, kv)
            counts[codec] = cache.tiers[0].stats().entries
    assert counts["int4"] >= 3 * counts["raw"]


def _replace(cache: KVCache, key: bytes, data: bytes | bytearray) -> None:
    tier = cache.tiers[0]
    tier.delete([key])
    assert tier.put([(key, BytesPayload(data))]) == [True]


def _blob_of(cache: KVCache, key: bytes) -> bytearray:
    with cache.tiers[0].get([key]) as [view]:
        return bytearray(view)


DAMAGE = [(c, d) for c in ("lossless", "int8", "int4", "cachegen")
          for d in ("truncate", "extend", "payload_header", "params")]
DAMAGE += [("lossless", "frame"), ("cachegen", "frame")]  # int8/int4 have no frames: fixed-size fields only


@pytest.mark.parametrize("codec,damage", DAMAGE)
def test_damaged_payload_is_a_miss(codec: str, damage: str) -> None:
    """The memory tier keeps unsealed blobs, so the codec itself must catch structural damage. (Damage to
    the quantised values themselves is caught only by sealed tiers' checksums: see the next test.)"""
    with make_cache(codec) as cache:
        tokens, kv = tokens_and_kv()
        cache.store(tokens, kv)
        key = cache.keys(tokens)[1]
        blob = _blob_of(cache, key)
        from kvtier.codecs.blob import parse_blob

        start = parse_blob(blob, key, verify=False)[0].header_len
        if damage == "truncate":
            blob = blob[:-7]
        elif damage == "extend":
            blob = blob + b"\0" * 5
        elif damage == "payload_header":
            blob[start] ^= 0xFF  # version byte of the codec payload
        elif damage == "params":
            blob[start + 1 : start + 4] = bytes([3, 3, 0])  # item size / bits / group / anchor fields
        else:  # the first plane's / slab's length and frame header
            at = start + (4 if codec == "lossless" else 20 + SPEC.num_layers * 2 * CHUNK * SPEC.num_kv_heads * 2)
            blob[at : at + 24] = bytes(24)
        if damage in ("truncate", "extend"):  # keep the blob header's payload length consistent
            import struct

            struct.pack_into("<Q", blob, 16, len(blob) - start)
        _replace(cache, key, blob)
        out, n = cache.retrieve(tokens)
        assert n == CHUNK  # the first chunk loads, the damaged second ends the prefix
        assert torch.equal(out[:, :, :CHUNK], cache_roundtrip(codec, kv[:, :, :CHUNK]))
        assert cache.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 1
        assert cache.tiers[0].contains([key]) == [False]  # deleted, so the engine's recompute can refill it


def cache_roundtrip(codec: str, chunk: torch.Tensor) -> torch.Tensor:
    c = get_codec(codec)
    buf = bytearray(c.encode(chunk).nbytes)
    c.encode(chunk).write_into(memoryview(buf))
    return c.decode(memoryview(buf), tuple(chunk.shape), chunk.dtype)


@pytest.mark.parametrize("codec", ["lossless", "int4", "cachegen"])
def test_sealed_blob_with_any_flipped_payload_byte_is_rejected(codec: str) -> None:
    """Tiers whose bytes leave the process seal blobs: a flipped byte anywhere is a BlobError, not garbage."""
    key, tokens = b"k" * 32, torch.arange(CHUNK).numpy().astype("<u4")
    chunk = kv_like(layers=2, tokens=CHUNK, heads=2, dim=64)
    blob = blob_bytes(encode_blob(key, tokens, get_codec(codec), chunk, seal=True))
    decode_blob(blob, key, tokens)
    for at in range(64, len(blob), max(1, len(blob) // 50)):
        bad = bytearray(blob)
        bad[at] ^= 0x10
        with pytest.raises(BlobError):
            decode_blob(bad, key, tokens)


@pytest.mark.parametrize("writer,reader", [("int8", "int4"), ("int4", "raw"), ("raw", "lossless"),
                                           ("cachegen", "int4"), ("lossless", "cachegen")])
def test_blob_of_another_codec_is_never_returned(writer: str, reader: str) -> None:
    with make_cache(writer) as a, make_cache(reader) as b:
        tokens, kv = tokens_and_kv()
        a.store(tokens, kv)
        for key in a.keys(tokens):
            b.tiers[0].put([(key, BytesPayload(_blob_of(a, key)))])
        assert b.lookup(tokens) == len(tokens)  # present under the same keys...
        _, n = b.retrieve(tokens)
        assert n == 0  # ...but never decoded as the reader's codec
        assert b.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 3
        assert b.lookup(tokens) == 0  # and dropped


def test_variant_of_the_same_family_is_read() -> None:
    """int4-g32 blobs carry their group size; an int4 tier decodes them exactly as written."""
    with make_cache("int4-g32") as a, make_cache("int4") as b:
        tokens, kv = tokens_and_kv()
        a.store(tokens, kv)
        for key in a.keys(tokens):
            b.tiers[0].put([(key, BytesPayload(_blob_of(a, key)))])
        out_b, n = b.retrieve(tokens)
        out_a, _ = a.retrieve(tokens)
        assert n == len(tokens) and torch.equal(out_a, out_b)


def test_write_back_from_raw_memory_into_int8_tier() -> None:
    tiers = (MemoryTierConfig(capacity_bytes=40 << 10, prefault=False),
             MemoryTierConfig(capacity_bytes=4 << 20, codec="int8", write="back", prefault=False))
    with KVCache(SPEC, model="m", config=CacheConfig(chunk_size=CHUNK, tiers=tiers)) as cache:
        stored = [tokens_and_kv(1, seed) for seed in range(6)]
        for tokens, kv in stored:
            cache.store(tokens, kv)
        assert cache.tiers[1].stats().entries >= 1
        tokens, kv = stored[0]  # evicted from the raw tier long ago
        out, n = cache.retrieve(tokens)
        assert n == CHUNK
        assert ((out.float() - kv.float()).norm() / kv.float().norm()).item() < 0.01


@pytest.mark.parametrize("codec", ["lossless", "int8", "cachegen"])
def test_disk_tier_with_a_codec_survives_a_restart(tmp_path, codec: str) -> None:
    """Sealed, compressed chunks on disk: written by one cache, read back by the next."""
    from kvtier.tiers.disk import DiskTierConfig

    config = CacheConfig(chunk_size=CHUNK, tiers=(DiskTierConfig(path=tmp_path, codec=codec, fsync=False),))
    tokens, kv = tokens_and_kv()
    with KVCache(SPEC, model="m", config=config) as cache:
        assert cache.store(tokens, kv) == len(tokens)
    with KVCache(SPEC, model="m", config=config) as cache:
        out, n = cache.retrieve(tokens)
    assert n == len(tokens)
    for start in range(0, len(tokens), CHUNK):
        assert torch.equal(out[:, :, start : start + CHUNK], cache_roundtrip(codec, kv[:, :, start : start + CHUNK]))
