"""The Redis tier against a real redis-server: conformance, keys and namespaces, value safety, split values and
TTL (configuration, ACL and TLS: test_redis_config.py)."""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.codecs import BytesPayload, get_codec
from kvtier.codecs.blob import blob_bytes, encode_blob
from kvtier.tiers import RedisTier, RedisTierConfig
from tests.conformance.tier_suite import BLOB_BYTES, TierConformance, blob, key, tier_context

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 16
CHUNK_BYTES = SPEC.bytes_per_token * CHUNK  # 4 KiB of payload per chunk


def make_cache(url: str, *, model: str = "m@1", chunk_size: int = CHUNK, spec: KVSpec = SPEC, **tier) -> KVCache:
    config = CacheConfig(chunk_size=chunk_size, tiers=(RedisTierConfig(url=url, **tier),))
    return KVCache(spec, model, config)


def redis_key(cache: KVCache, tokens: list[int], i: int, prefix: str = "kvtier:") -> str:
    """The Redis key of chunk ``i`` of ``tokens`` in ``cache``: prefix, codec, namespace tag, hash tag."""
    return f"{prefix}raw:{cache.namespace.root.hex()[:16]}:{{{cache.keys(tokens)[i].hex()}}}"


def prompt(n_chunks: int, seed: int = 0, chunk_size: int = CHUNK) -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n_chunks * chunk_size,), generator=gen).tolist()
    kv = torch.randn(SPEC.chunk_shape(len(tokens)), generator=gen).to(SPEC.dtype)
    return tokens, kv


# -- conformance -----------------------------------------------------------------------------------------------
class TestRedisTierConformance(TierConformance):
    exact_usage = False  # used_bytes is the server's used_memory
    tier_options: ClassVar[dict] = {}

    @pytest.fixture(autouse=True)
    def _server(self, redis_server):
        redis_server.flush()
        self.server = redis_server

    def make_tier(self, capacity_bytes: int) -> RedisTier:
        config = RedisTierConfig(url=self.server.url, max_value_bytes=capacity_bytes, **self.tier_options)
        return RedisTier(config, tier_context("redis"))


class TestRedisTierConformanceSplitValues(TestRedisTierConformance):
    """Every conformance blob (16 KiB and a header) is split into 8 KiB parts."""

    tier_options: ClassVar[dict] = {"max_part_bytes": 8192}

    def test_delete(self, new_tier):
        # as inherited, except that stats().entries counts keys: a split value is its head plus its other parts
        keys_per_value = -(-BLOB_BYTES // 8192)
        tier = new_tier()
        self._put(tier, [1, 2])
        assert tier.stats().entries == 2 * keys_per_value
        tier.delete([key(1), key(42)])
        assert tier.contains([key(1), key(2)]) == [False, True]
        assert tier.stats().entries == keys_per_value


# -- keys and namespaces ---------------------------------------------------------------------------------------
def test_keys_are_prefix_codec_namespace_and_chunk_hash(redis_server):
    redis_server.flush()
    with make_cache(redis_server.url, key_prefix="team-a:") as cache:
        tokens, kv = prompt(2)
        cache.store(tokens, kv)
        namespace = cache.namespace.root.hex()[:16]  # the model's namespace tag: clear finds a model's keys by it
        expected = sorted(f"team-a:raw:{namespace}:{{{h.hex()}}}" for h in cache.keys(tokens))
    assert sorted(redis_server.cli("KEYS", "*").split()) == expected


@pytest.mark.parametrize("other", [
    {"model": "m@2"},
    {"chunk_size": 2 * CHUNK},
    {"spec": KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)},
])
def test_namespaces_never_read_each_other(redis_server, other):
    redis_server.flush()
    tokens, kv = prompt(4)
    with make_cache(redis_server.url) as a, make_cache(redis_server.url, **other) as b:
        assert a.store(tokens, kv) == len(tokens)
        assert b.lookup(tokens) == 0
        assert b.retrieve(tokens)[1] == 0
        assert a.lookup(tokens) == len(tokens)


def test_tenants_never_read_each_other(redis_server):
    redis_server.flush()
    tokens, kv = prompt(3)
    with make_cache(redis_server.url) as a, make_cache(redis_server.url) as b:
        a.store(tokens, kv, salt=b"tenant-1")
        assert b.lookup(tokens, salt=b"tenant-2") == 0
        assert b.lookup(tokens) == 0
        assert b.lookup(tokens, salt=b"tenant-1") == len(tokens)


# -- value safety ----------------------------------------------------------------------------------------------
def _planted(cache: KVCache, tokens: list[int], kv: torch.Tensor, kind: str) -> bytes:
    keys = cache.keys(tokens)
    good = bytes(blob_bytes(encode_blob(keys[1], np.array(tokens[CHUNK : 2 * CHUNK], dtype="<u4"),
                                        get_codec("raw"), kv[:, :, CHUNK : 2 * CHUNK])))
    if kind == "garbage":
        return b"not a kvtier value at all" * 10
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "older_format":
        return good[:4] + (0).to_bytes(2, "little") + good[6:]
    if kind == "other_key":  # a valid blob of chunk 0 stored under chunk 1's key
        return bytes(blob_bytes(encode_blob(keys[0], np.array(tokens[:CHUNK], dtype="<u4"), get_codec("raw"),
                                            kv[:, :, :CHUNK])))
    if kind == "flipped_bit":
        return good[:-1] + bytes([good[-1] ^ 1])
    if kind == "fake_split_header":  # part count disagrees with the sizes
        import struct

        return struct.pack("<4sHH8sQII", b"KVTS", 1, 0, b"n" * 8, 1 << 20, 4096, 3) + b"x" * 4096
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["garbage", "truncated", "older_format", "other_key", "flipped_bit",
                                  "fake_split_header"])
def test_planted_or_damaged_value_is_a_miss(redis_server, kind):
    redis_server.flush()
    tokens, kv = prompt(3)
    with make_cache(redis_server.url) as cache:
        cache.store(tokens, kv)
        head = redis_key(cache, tokens, 1)
        redis_server.set_bytes(head, _planted(cache, tokens, kv, kind))
        out, n = cache.retrieve(tokens)
        assert n == CHUNK  # the prefix ends at the bad chunk
        assert torch.equal(out[:, :, :CHUNK], kv[:, :, :CHUNK])
        assert cache.metrics.total("kvtier_corrupt_chunks_total") == 1
        assert cache.lookup(tokens) == CHUNK  # deleted
        # stored again, it is whole again
        cache.store(tokens, kv)
        assert cache.retrieve(tokens)[1] == len(tokens)


def test_value_larger_than_this_replica_accepts_is_a_miss_left_in_place(redis_server):
    """A header declaring 16 MiB (4,096 parts, the most a head may have) to a replica that takes at most 1 MiB:
    nothing of that size is allocated, and the replica does not delete what others may use."""
    import struct

    redis_server.flush()
    tokens, kv = prompt(1)
    with make_cache(redis_server.url, max_value_bytes=1 << 20) as cache:
        head = redis_key(cache, tokens, 0)
        redis_server.set_bytes(head, struct.pack("<4sHH8sQII", b"KVTS", 1, 0, b"n" * 8, 16 << 20, 4096, 4096)
                               + b"x" * 4096)
        assert cache.retrieve(tokens)[1] == 0
        assert redis_server.cli("EXISTS", head) == "1"
    tokens, kv = prompt(1, seed=3)
    with make_cache(redis_server.url) as writer, \
            make_cache(redis_server.url, max_value_bytes=CHUNK_BYTES // 2) as small:
        writer.store(tokens, kv)
        assert small.retrieve(tokens)[1] == 0  # too big for this replica: a miss ...
        assert writer.retrieve(tokens)[1] == CHUNK  # ... that it did not delete


def test_value_of_another_type_is_a_miss(redis_server):
    redis_server.flush()
    tokens, kv = prompt(2)
    with make_cache(redis_server.url) as cache:
        redis_server.cli("HSET", redis_key(cache, tokens, 0), "f", "v")
        assert cache.lookup(tokens) == CHUNK  # lookup only sees that the key exists ...
        assert cache.retrieve(tokens)[1] == 0  # ... retrieve reads it: a miss
        assert cache.metrics.total("kvtier_corrupt_chunks_total") == 1
        assert cache.store(tokens, kv) == len(tokens)  # the foreign key was removed on read
        assert cache.retrieve(tokens)[1] == len(tokens)


def test_memory_tier_in_front_takes_promoted_hits(redis_server):
    """The recommended set-up: each replica's RAM first, the shared store behind it."""
    from kvtier.tiers import MemoryTierConfig

    redis_server.flush()
    tokens, kv = prompt(4)

    def replica() -> KVCache:
        tiers = (MemoryTierConfig(capacity_bytes=1 << 20, prefault=False), RedisTierConfig(url=redis_server.url))
        return KVCache(SPEC, "m@1", CacheConfig(chunk_size=CHUNK, tiers=tiers))

    with replica() as a, replica() as b:
        assert a.store(tokens, kv) == len(tokens)  # written through to both tiers
        out, n = b.retrieve(tokens)  # b's RAM is empty: served by Redis, promoted
        assert n == len(tokens) and torch.equal(out, kv)
        assert b.metrics.get("kvtier_hit_tokens_total", tier="redis") == len(tokens)
        assert b.metrics.get("kvtier_promotions_total", tier="memory") == 4
        _, n = b.retrieve(tokens)
        assert n == len(tokens) and b.metrics.get("kvtier_hit_tokens_total", tier="memory") == len(tokens)


# -- split values ----------------------------------------------------------------------------------------------
def test_split_values_round_trip_and_parts_share_a_slot(redis_server):
    redis_server.flush()
    tokens, kv = prompt(3)
    with make_cache(redis_server.url, max_part_bytes=4096) as cache:
        cache.store(tokens, kv)
        keys = redis_server.cli("KEYS", "*").split()
        assert len(keys) == 3 * 2  # each ~4.2 KiB blob: head (part 0) + one more part
        from redis.crc import key_slot

        assert len({key_slot(k.encode()) for k in keys}) == 3  # parts live in their head's slot
        out, n = cache.retrieve(tokens)
        assert n == len(tokens) and torch.equal(out, kv)


def test_missing_part_is_a_miss_and_is_cleaned_up(redis_server):
    redis_server.flush()
    tokens, kv = prompt(2)
    with make_cache(redis_server.url, max_part_bytes=4096) as cache:
        cache.store(tokens, kv)
        head = redis_key(cache, tokens, 1)
        part = [k for k in redis_server.cli("KEYS", "*").split() if k.startswith(head + ":")]
        redis_server.cli("DEL", *part)  # as if evicted
        assert cache.retrieve(tokens)[1] == CHUNK
        assert cache.metrics.total("kvtier_incomplete_values_total") == 1
        assert redis_server.cli("EXISTS", head) == "0"


def test_concurrent_writers_of_one_split_value(redis_server):
    redis_server.flush()
    tier = RedisTier(RedisTierConfig(url=redis_server.url, max_part_bytes=4096), tier_context("redis"))
    data = blob(1)
    barrier = threading.Barrier(4)

    def writer() -> None:
        barrier.wait()
        for _ in range(20):
            tier.put([(key(1), BytesPayload(data))])
            with tier.get([key(1)]) as (value,):
                assert value is None or bytes(value) == data

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with tier.get([key(1)]) as (value,):
        assert bytes(value) == data
    assert int(redis_server.cli("DBSIZE")) == -(-len(data) // 4096)  # losers removed their orphan parts
    tier.close()


def test_value_larger_than_max_value_is_skipped(redis_server):
    redis_server.flush()
    with make_cache(redis_server.url, max_value_bytes=CHUNK_BYTES // 2) as cache:
        tokens, kv = prompt(2)
        assert cache.store(tokens, kv) == 0
        assert cache.metrics.get("kvtier_skipped_stores_total", tier="redis", reason="too_large") == 2


def test_big_split_values_with_buffer_reuse(redis_server):
    """A few MiB per chunk, split into 1 MiB parts; receive buffers are reused across calls."""
    redis_server.flush()
    spec = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float16)  # 4 KiB per token
    tokens = list(range(4 * 512))
    kv = torch.randn(spec.chunk_shape(len(tokens))).to(torch.float16)
    # a generous deadline: this test is about split values and buffer reuse, and on a loaded machine sealing
    # 8 MiB can outlast the default 0.5 s
    config = CacheConfig(chunk_size=512, tiers=(RedisTierConfig(url=redis_server.url, max_part_bytes=1 << 20,
                                                                timeout_s=10.0),))
    with KVCache(spec, "big", config) as cache:
        assert cache.store(tokens, kv) == len(tokens)
        out = spec.empty(len(tokens))
        for _ in range(3):
            out.zero_()
            _, n = cache.retrieve(tokens, out)
            assert n == len(tokens) and torch.equal(out, kv)
        assert cache.tiers[0]._buffers.idle_bytes >= 4 * 2 * (1 << 20)


# -- TTL -------------------------------------------------------------------------------------------------------
def test_ttl_set_on_write_and_refreshed_on_read(redis_server):
    redis_server.flush()
    tokens, kv = prompt(1)
    with make_cache(redis_server.url, ttl_s=100, max_part_bytes=4096) as cache:
        cache.store(tokens, kv)
        head = redis_key(cache, tokens, 0)
        part = next(k for k in redis_server.cli("KEYS", "*").split() if k != head)
        assert 90_000 < int(redis_server.cli("PTTL", head)) <= 100_000
        assert int(redis_server.cli("PTTL", part)) > 100_000  # parts outlive their head
        redis_server.cli("PEXPIRE", head, "5000")
        assert cache.retrieve(tokens)[1] == CHUNK
        assert int(redis_server.cli("PTTL", head)) > 90_000


def test_no_ttl_by_default(redis_server):
    redis_server.flush()
    tokens, kv = prompt(1)
    with make_cache(redis_server.url) as cache:
        cache.store(tokens, kv)
        assert redis_server.cli("PTTL", redis_key(cache, tokens, 0)) == "-1"
