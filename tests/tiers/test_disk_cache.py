"""The disk tier behind KVCache: write-through, write-back, promotion, corruption as counted misses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.codecs.blob import parse_blob
from kvtier.tiers import DiskTierConfig, MemoryTierConfig, WriteMode

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
CHUNK = 16
CHUNK_BYTES = SPEC.bytes_per_token * CHUNK  # 8 KiB of payload per chunk
MODEL = "test-model@1"


def tokens(n_chunks: int, seed: int = 0) -> list[int]:
    return [(seed * 1000 + i) % 32000 for i in range(n_chunks * CHUNK)]


def kv(n_chunks: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(SPEC.chunk_shape(n_chunks * CHUNK), generator=torch.Generator().manual_seed(seed))


def cache(path, *, memory_chunks: int | None = None, write: WriteMode = WriteMode.THROUGH) -> KVCache:
    tiers = []
    if memory_chunks is not None:
        tiers.append(MemoryTierConfig(capacity_bytes=memory_chunks * (CHUNK_BYTES + 256), prefault=False))
    tiers.append(DiskTierConfig(path=path, capacity_bytes=64 << 20, write=write, fsync=False,
                               admission="always"))  # these tests are about the write paths, not admission
    return KVCache(SPEC, MODEL, CacheConfig(chunk_size=CHUNK, tiers=tuple(tiers)))


def flush(c: KVCache) -> None:
    c.tiers[-1].flush()


def test_write_through_stores_in_both_and_a_restart_promotes(tmp_path):
    toks, data = tokens(4), kv(4)
    with cache(tmp_path, memory_chunks=8) as c:
        assert c.store(toks, data) == 4 * CHUNK
        flush(c)
        keys = c.keys(toks)
        assert c.tiers[0].contains(keys) == [True] * 4 and c.tiers[1].contains(keys) == [True] * 4
        out, n = c.retrieve(toks)
        assert n == 4 * CHUNK and torch.equal(out, data)
        assert c.metrics.get("kvtier_hit_tokens_total", tier="memory") == 4 * CHUNK
    with cache(tmp_path, memory_chunks=8) as c:  # a restart: memory is empty, disk is not
        assert c.lookup(toks) == 4 * CHUNK
        out, n = c.retrieve(toks)
        assert n == 4 * CHUNK and torch.equal(out, data)
        assert c.metrics.get("kvtier_hit_tokens_total", tier="disk") == 4 * CHUNK
        assert c.metrics.get("kvtier_promotions_total", tier="memory") == 4
        assert c.tiers[0].contains(c.keys(toks)) == [True] * 4  # promoted
        out, n = c.retrieve(toks)
        assert n == 4 * CHUNK and torch.equal(out, data)
        assert c.metrics.get("kvtier_hit_tokens_total", tier="memory") == 4 * CHUNK


def test_write_back_demotes_on_eviction_and_prefix_spans_tiers(tmp_path):
    toks, data = tokens(6, seed=1), kv(6, seed=1)
    with cache(tmp_path, memory_chunks=3, write=WriteMode.BACK) as c:
        keys = c.keys(toks)
        c.store(toks[: 2 * CHUNK], data[:, :, : 2 * CHUNK])
        flush(c)
        assert c.tiers[1].contains(keys[:2]) == [False, False]  # write-back: nothing on disk yet
        c.store(toks, data)  # the four new chunks go to memory deepest first, pushing out the older two
        flush(c)
        assert c.metrics.get("kvtier_demotions_total", tier="disk") == 3
        assert c.tiers[1].contains(keys) == [True, True, False, False, False, True]
        assert c.tiers[0].contains(keys) == [False, False, True, True, True, False]
        assert c.lookup(toks) == 6 * CHUNK  # the longest prefix across both tiers
        out, n = c.retrieve(toks)
        assert n == 6 * CHUNK and torch.equal(out, data)


def _swap_payloads(a: str, b: str, key_a: bytes) -> None:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        da, db = bytearray(fa.read()), bytearray(fb.read())
    header, _ = parse_blob(da, key_a, verify=False)
    hl = header.header_len
    da[hl:], db[hl:] = db[hl:], da[hl:]
    for path, data in ((a, da), (b, db)):
        with open(path, "wb") as fh:
            fh.write(data)


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 1000)


def _flip(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) - 5)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("damage", ["truncate", "bit_flip", "swap_payloads", "swap_files"])
def test_corrupt_chunks_are_counted_misses_and_removed(tmp_path, damage):
    toks, data = tokens(4, seed=2), kv(4, seed=2)
    with cache(tmp_path) as c:
        c.store(toks, data)
        flush(c)
        disk = c.tiers[0]
        keys = c.keys(toks)
        p1, p2 = disk.paths.path(keys[1]), disk.paths.path(keys[2])
        if damage == "truncate":
            _truncate(p1)
        elif damage == "bit_flip":
            _flip(p1)
        elif damage == "swap_payloads":
            _swap_payloads(p1, p2, keys[1])
        else:
            b1, b2 = Path(p1).read_bytes(), Path(p2).read_bytes()
            Path(p1).write_bytes(b2), Path(p2).write_bytes(b1)
        out, n = c.retrieve(toks)
        assert n == CHUNK  # the prefix ends at the first bad chunk
        assert torch.equal(out[:, :, :CHUNK], data[:, :, :CHUNK])
        both = damage.startswith("swap")  # a swap damages chunks 1 and 2; both are read and checked
        assert c.metrics.get("kvtier_corrupt_chunks_total", tier="disk") == (2 if both else 1)
        flush(c)
        assert not os.path.exists(p1) and os.path.exists(p2) != both  # removed
        assert disk.contains(keys) == [True, False, not both, True]
        assert c.lookup(toks) == CHUNK


def test_tensor_parallel_ranks_get_their_own_directories(tmp_path):
    config = CacheConfig(chunk_size=CHUNK, tiers=(DiskTierConfig(path=tmp_path, capacity_bytes=1 << 20),))
    ranks = [KVCache(SPEC, MODEL, config, tp_rank=r, tp_size=2) for r in range(2)]  # one process per rank
    try:
        assert [c.tiers[0].paths.dir for c in ranks] == [str(tmp_path / f"rank{r}" / "raw") for r in range(2)]
    finally:
        for c in ranks:
            c.close()


def test_a_second_cache_on_one_directory_is_refused(tmp_path):
    from kvtier.base.errors import ConfigError

    with cache(tmp_path), pytest.raises(ConfigError, match="give each process its own path"):
        cache(tmp_path)
