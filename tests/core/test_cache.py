from contextlib import contextmanager

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.errors import ConfigError, TierError
from kvtier.tiers import MemoryTierConfig, TierConfig, TierStats, WriteMode, register_tier

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
CHUNK = 16
CHUNK_BYTES = SPEC.bytes_per_token * CHUNK + 320  # payload plus a generous header


def kv_for(n_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(SPEC.chunk_shape(n_tokens), generator=torch.Generator().manual_seed(seed)).to(SPEC.dtype)


def make_cache(*tiers: TierConfig | dict) -> KVCache:
    tiers = tiers or (MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES),)
    return KVCache(SPEC, "test-model@1", CacheConfig(chunk_size=CHUNK, tiers=tiers))


def test_store_lookup_retrieve_exact():
    cache = make_cache()
    tokens, kv = list(range(100)), kv_for(100)
    assert cache.lookup(tokens) == 0
    assert cache.store(tokens, kv) == 96
    assert cache.store(tokens, kv) == 0  # already there
    assert cache.lookup(tokens) == 96
    out, n = cache.retrieve(tokens)
    assert n == 96 and torch.equal(out[:, :, :n], kv[:, :, :96])


def test_shared_prefix_hits_every_full_chunk():
    cache = make_cache()
    base = list(range(1000, 1100))
    cache.store(base, kv_for(100))
    other = base[:70] + [1, 2, 3, 4, 5] * 10
    assert cache.lookup(other) == 64  # 70 shared tokens hold 4 full chunks
    out, n = cache.retrieve(other)
    assert n == 64 and torch.equal(out[:, :, :64], kv_for(100)[:, :, :64])


def test_salts_isolate_tenants():
    cache = make_cache()
    tokens = list(range(64))
    cache.store(tokens, kv_for(64), salt=b"alice")
    assert cache.lookup(tokens, salt=b"alice") == 64
    assert cache.lookup(tokens, salt=b"bob") == 0
    assert cache.lookup(tokens) == 0
    assert cache.retrieve(tokens, salt=b"bob")[1] == 0


def test_max_tokens_and_caller_buffers():
    cache = make_cache()
    tokens, kv = list(range(64)), kv_for(64)
    cache.store(tokens, kv)
    out = SPEC.empty(64)
    got, n = cache.retrieve(tokens, out, max_tokens=63)
    assert got is out and n == 48 and torch.equal(out[:, :, :48], kv[:, :, :48])

    class Collect:
        def __init__(self):
            self.parts = {}

        def write(self, start, end, chunk):
            self.parts[(start, end)] = chunk.clone()

    sink = Collect()
    got, n = cache.retrieve(tokens, sink)
    assert got is None and n == 64
    assert sorted(sink.parts) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert torch.equal(sink.parts[(32, 48)], kv[:, :, 32:48])


def test_retrieve_rejects_an_out_tensor_that_does_not_fit():
    cache = make_cache()
    tokens = list(range(64))
    cache.store(tokens, kv_for(64))
    with pytest.raises(ConfigError, match="room"):
        cache.retrieve(tokens, SPEC.empty(32))
    with pytest.raises(ConfigError):
        cache.retrieve(tokens, torch.empty(SPEC.chunk_shape(64), dtype=torch.float32))


def test_store_rejects_kv_that_does_not_match():
    cache = make_cache()
    with pytest.raises(ConfigError):
        cache.store(list(range(64)), kv_for(32))
    with pytest.raises(ConfigError):
        cache.store(list(range(32)), kv_for(32).float())


def test_tampered_chunk_is_a_counted_miss_and_is_dropped():
    cache = make_cache()
    tokens, kv = list(range(64)), kv_for(64)
    cache.store(tokens, kv)
    tier = cache.tiers[0]
    third = cache.keys(tokens)[2]
    with tier.get([third]) as (view,):
        view[40 + 4 * 5] ^= 0xFF  # a token id inside the stored header
    out, n = cache.retrieve(tokens)
    assert n == 32  # the prefix ends before the bad chunk
    assert torch.equal(out[:, :, :32], kv[:, :, :32])
    assert cache.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 1
    assert tier.contains([third]) == [False]
    assert cache.lookup(tokens) == 32


def test_chunks_may_sit_in_different_tiers_and_are_promoted():
    fast = MemoryTierConfig(capacity_bytes=2 * CHUNK_BYTES)
    slow = MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES)
    cache = make_cache(fast, slow)
    assert [t.name for t in cache.tiers] == ["memory", "memory2"]
    tokens, kv = list(range(96)), kv_for(96)
    cache.store(tokens, kv)  # write-through: all six in the slow tier, the first two in the fast one
    assert cache.tiers[0].contains(cache.keys(tokens)) == [True] * 2 + [False] * 4
    cache.store(list(range(500, 532)), kv_for(32))  # another prompt takes the fast tier's room
    assert cache.tiers[0].contains(cache.keys(tokens)) == [False] * 6
    assert cache.lookup(tokens) == 96
    out, n = cache.retrieve(tokens[:32] + [0] * 10)
    assert n == 32 and torch.equal(out[:, :, :32], kv[:, :, :32])
    assert cache.metrics.get("kvtier_hit_tokens_total", tier="memory2") == 32
    assert cache.metrics.get("kvtier_promotions_total", tier="memory") == 2
    assert cache.tiers[0].contains(cache.keys(tokens)[:2]) == [True, True]


def test_write_back_demotes_on_eviction():
    fast = MemoryTierConfig(capacity_bytes=2 * CHUNK_BYTES)
    slow = MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES, write=WriteMode.BACK)
    cache = make_cache(fast, slow)
    tokens, kv = list(range(96)), kv_for(96)
    cache.store(tokens[:32], kv[:, :, :32])
    assert cache.tiers[1].stats().entries == 0  # write-back: nothing yet
    cache.store(tokens, kv)  # evicts the first chunks from the fast tier into the slow one
    assert cache.metrics.total("kvtier_demotions_total") == 4
    assert cache.tiers[1].stats().entries == 4
    out, n = cache.retrieve(tokens)
    assert n == 96 and torch.equal(out[:, :, :96], kv)


@register_tier
class BrokenTierConfig(TierConfig):
    """A tier whose backend fails on every call, as a dead store does."""

    kind = "broken-for-tests"

    def build(self, ctx):
        return BrokenTier(ctx.name)


class BrokenTier:
    """Every call fails, as an unreachable network tier's do."""

    verifies = True

    def __init__(self, name="broken"):
        from kvtier.codecs import get_codec

        self.name, self.codec = name, get_codec("raw")

    def contains(self, keys):
        raise TierError("store unreachable")

    @contextmanager
    def get(self, keys):
        raise TierError("store unreachable")
        yield

    def put(self, items):
        raise TierError("store unreachable")

    def delete(self, keys):
        raise TierError("store unreachable")

    def stats(self):
        return TierStats(0, 0, 0)

    def close(self):
        pass


def test_a_failing_tier_degrades_to_misses():
    cache = make_cache(MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES), BrokenTierConfig())
    tokens, kv = list(range(64)), kv_for(64)
    assert cache.store(tokens, kv) == 64
    assert cache.lookup(tokens) == 64  # served by the memory tier alone: the dead one is not asked
    assert cache.lookup(tokens + list(range(500, 532))) == 64  # asks the dead tier for the rest
    assert cache.retrieve(tokens)[1] == 64
    assert cache.metrics.get("kvtier_tier_errors_total", tier="broken-for-tests", op="put") == 1
    assert cache.metrics.get("kvtier_tier_errors_total", tier="broken-for-tests", op="contains") == 1

    alone = make_cache(BrokenTierConfig())
    assert alone.store(tokens, kv) == 0
    assert alone.lookup(tokens) == 0
    assert alone.retrieve(tokens) == (None, 0)


def test_metrics_move_and_render():
    cache = make_cache()
    tokens = list(range(64))
    cache.store(tokens, kv_for(64))
    cache.lookup(tokens)
    cache.retrieve(tokens + [1] * 32)
    m = cache.metrics
    assert m.get("kvtier_hit_tokens_total", tier="memory") == 64
    assert m.get("kvtier_miss_tokens_total") == 32
    assert m.get("kvtier_stored_tokens_total", tier="memory") == 64
    assert m.get("kvtier_lookup_seconds") == 1
    text = m.render_prometheus()
    assert 'kvtier_hit_tokens_total{tier="memory"} 64.0' in text
    assert "# TYPE kvtier_retrieve_seconds histogram" in text
    assert 'kvtier_retrieve_seconds_bucket{le="+Inf"} 1.0' in text
    assert 'kvtier_tier_entries{tier="memory"} 4.0' in text
