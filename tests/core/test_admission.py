"""Admission through a real KVCache over a memory tier and a real disk tier (kvtier.policy.admission's rules)."""

from __future__ import annotations

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.core.metrics import ADMISSION_REFUSED, PROMOTIONS
from kvtier.tiers import DiskTierConfig, MemoryTierConfig, WriteMode

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
CHUNK = 16
CHUNK_BYTES = SPEC.bytes_per_token * CHUNK + 320  # payload plus a generous header


def kv_for(n_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(SPEC.chunk_shape(n_tokens), generator=torch.Generator().manual_seed(seed)).to(SPEC.dtype)


def prompt(n: int, chunks: int = 4) -> list[int]:
    return list(range(n * 10_000, n * 10_000 + chunks * CHUNK))


def cache_with(tmp_path, *, memory_chunks: int = 64, disk: dict | None = None, clock=None) -> KVCache:
    tiers = (MemoryTierConfig(capacity_bytes=memory_chunks * CHUNK_BYTES, prefault=False, policy="lru"),
             DiskTierConfig(path=tmp_path, capacity_bytes=256 * CHUNK_BYTES, o_direct=False, fsync=False,
                            **{"admission": "second-hit", **(disk or {})}))
    extra = {"clock": clock} if clock is not None else {}
    return KVCache(SPEC, "admission-test", CacheConfig(chunk_size=CHUNK, tiers=tiers), **extra)


def on_disk(cache: KVCache, tokens: list[int]) -> int:
    cache.tiers[1].flush()
    return sum(cache.tiers[1].contains(cache.keys(tokens)))


def refused(cache: KVCache, reason: str) -> float:
    return cache.metrics.get(ADMISSION_REFUSED, tier="disk", reason=reason)


def test_second_hit_stores_nothing_for_one_shot_prompts(tmp_path):
    cache = cache_with(tmp_path)
    for n in range(20):
        tokens = prompt(n)
        assert cache.retrieve(tokens)[1] == 0
        assert cache.store(tokens, kv_for(len(tokens), n)) == len(tokens)  # the memory tier (always) took them
    assert all(on_disk(cache, prompt(n)) == 0 for n in range(20))
    assert cache.tiers[1].stats().entries == 0
    assert refused(cache, "unseen") == 20 * 4
    cache.close()


def test_the_second_sighting_stores(tmp_path):
    """Offered again (the memory tier still holds it: the store offers it to the disk again), or hit."""
    cache = cache_with(tmp_path)
    tokens, kv = prompt(1), kv_for(4 * CHUNK, 1)
    cache.store(tokens, kv)
    assert on_disk(cache, tokens) == 0
    cache.store(tokens, kv)  # a second request with the same prompt
    assert on_disk(cache, tokens) == 4
    other = prompt(2)
    cache.store(other, kv)
    assert cache.retrieve(other)[1] == 4 * CHUNK  # a hit is a sighting ...
    cache.store(other, kv)  # ... so the engine's store after it reaches the disk
    assert on_disk(cache, other) == 4
    cache.close()


def test_a_shared_prefix_is_admitted_and_the_one_shot_tails_are_not(tmp_path):
    cache = cache_with(tmp_path)
    system = prompt(0, chunks=2)
    for n in range(1, 6):
        tokens = system + prompt(n, chunks=2)
        cache.store(tokens, kv_for(len(tokens), n))
    assert on_disk(cache, system) == 2
    assert cache.tiers[1].stats().entries == 2  # the tails were each seen once
    cache.close()


def test_write_back_demotes_only_what_was_reused_while_cached_above(tmp_path):
    cache = cache_with(tmp_path, memory_chunks=4, disk={"write": WriteMode.BACK})
    reused, once = prompt(1, chunks=2), prompt(2, chunks=2)
    cache.store(reused, kv_for(2 * CHUNK, 1))
    cache.store(once, kv_for(2 * CHUNK, 2))
    assert cache.retrieve(reused)[1] == 2 * CHUNK  # reused while in memory
    for n in range(3, 8):  # a flood evicts both from memory
        cache.store(prompt(n, chunks=2), kv_for(2 * CHUNK, n))
    assert sum(cache.tiers[0].contains(cache.keys(reused + once))) == 0  # both evicted from memory
    assert on_disk(cache, reused) == 2
    assert on_disk(cache, once) == 0
    cache.close()


def test_promotions_into_a_second_hit_tier_are_admitted(tmp_path):
    """A hit in a slower tier is a reuse: the memory tier above a second-hit disk, gated too, still takes it."""
    tiers = (MemoryTierConfig(capacity_bytes=4 * CHUNK_BYTES, prefault=False, admission="second-hit"),
             DiskTierConfig(path=tmp_path, capacity_bytes=256 * CHUNK_BYTES, o_direct=False, fsync=False,
                            admission="always"))
    cache = KVCache(SPEC, "admission-test", CacheConfig(chunk_size=CHUNK, tiers=tiers))
    tokens = prompt(1, chunks=2)
    cache.store(tokens, kv_for(2 * CHUNK, 1))  # the disk (always) takes it, memory refuses a first sighting
    cache.tiers[1].flush()
    assert sum(cache.tiers[0].contains(cache.keys(tokens))) == 0
    assert cache.retrieve(tokens)[1] == 2 * CHUNK
    assert sum(cache.tiers[0].contains(cache.keys(tokens))) == 2
    assert cache.metrics.get(PROMOTIONS, tier="memory") == 2
    cache.close()


def test_a_byte_rate_cap_refuses_over_the_rate(tmp_path):
    now = [0.0]
    chunk_kv = SPEC.bytes_per_token * CHUNK
    cache = cache_with(tmp_path, disk={"admission": "always", "admission_max_bytes_per_s": 4 * chunk_kv,
                                       "admission_burst_bytes": 4 * chunk_kv}, clock=lambda: now[0])
    for n in range(3):  # 12 chunks offered at once: the burst lets 4 through
        cache.store(prompt(n), kv_for(4 * CHUNK, n))
    assert cache.tiers[1].stats().entries == 4 and on_disk(cache, prompt(0)) == 4
    assert refused(cache, "rate") == 8
    now[0] += 1.0  # one second: 4 chunks more
    for n in range(3, 6):
        cache.store(prompt(n), kv_for(4 * CHUNK, n))
    assert on_disk(cache, prompt(3)) == 4 and cache.tiers[1].stats().entries == 8
    assert refused(cache, "rate") == 16
    cache.close()


@pytest.mark.parametrize("spec", [{"admission": "second-hit", "admission_max_bytes_per_s": "200MiB"}])
def test_yaml_and_environment_set_admission(tmp_path, spec):
    config = CacheConfig.from_dict({"tiers": [{"kind": "memory"}, {"kind": "disk", "path": str(tmp_path), **spec}]})
    assert config.tiers[1].admission == "second-hit" and config.tiers[1].admission_max_bytes_per_s == 200 * 2**20
    env = CacheConfig.from_env({"KVTIER_TIERS": "memory,disk", "KVTIER_DISK_PATH": str(tmp_path),
                                "KVTIER_DISK_ADMISSION": "second-hit", "KVTIER_DISK_ADMISSION_MAX_BYTES_PER_S": "1GiB"})
    assert env.tiers[1].admission == "second-hit" and env.tiers[1].admission_max_bytes_per_s == 2**30
