"""Cache control on real Redis and Valkey servers (kvtier/tiers/redis/control.py): the control conformance
suite, and pins, TTL, clears and tenants through a KVCache."""

from __future__ import annotations

import math
import time

import pytest

from kvtier import CacheConfig, KVCache
from kvtier.base.errors import NotSupported, PinBudgetExceeded
from kvtier.codecs import BytesPayload
from kvtier.tiers import MemoryTierConfig, RedisTier, RedisTierConfig
from kvtier.tiers.control import MAX_TTL_S, Feature, Tags
from tests.conformance.control_suite import ControlConformance
from tests.conformance.tier_suite import blob, key, tier_context
from tests.tiers.test_redis import CHUNK, CHUNK_BYTES, SPEC, make_cache, prompt, redis_key


def wait_until(predicate, limit_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``limit_s`` passed (the server expires keys on its own clock)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class TestRedisControlConformance(ControlConformance):
    enforces_shares = False  # the server evicts
    evicts = False
    expires_after_unpin = False  # PERSIST drops the expiry for good

    @pytest.fixture(autouse=True)
    def _server(self, redis_server):
        redis_server.flush()
        self.server = redis_server

    def make_controlled(self, capacity_bytes: int, clock, **config) -> RedisTier:
        budget = config.pop("pin_budget_bytes", None)
        config = RedisTierConfig(url=self.server.url, max_value_bytes=capacity_bytes, pin_budget_bytes=budget)
        return RedisTier(config, tier_context("redis", clock))

    def test_expired_entries_are_misses_and_reclaimed(self, controlled):
        """The server's own expiry (PX), so real time: a short TTL and a bounded wait."""
        tier = controlled(clock=time.time)
        assert tier.put_tagged([(key(1), BytesPayload(blob(1)))], Tags(expires_at=time.time() + 0.3)) == [True]
        tier.put([(key(2), BytesPayload(blob(2)))])
        assert tier.contains([key(1), key(2)]) == [True, True]
        assert wait_until(lambda: tier.contains([key(1)]) == [False])
        assert tier.contains([key(2)]) == [True]
        assert int(self.server.cli("DBSIZE")) == 1  # reclaimed by the server


    @pytest.mark.parametrize("when", [1e308, math.inf, math.nan])
    def test_an_expiry_beyond_any_ttl_never_raises(self, controlled, when):
        """A tier never raises into the engine: an expiry past MAX_TTL_S (callers refuse such TTLs) is held for
        MAX_TTL_S, not an OverflowError from the milliseconds Redis takes; NaN is already expired (not stored)."""
        tier = controlled(clock=time.time)
        assert tier.put_tagged([(key(1), BytesPayload(blob(1)))], Tags(expires_at=when)) == [not math.isnan(when)]
        if not math.isnan(when):
            assert 0 < int(self.server.cli("PTTL", self.server.cli("KEYS", "*").split()[0])) <= MAX_TTL_S * 1000


def test_a_store_ttl_expires_on_the_server(redis_server):
    redis_server.flush()
    tokens, kv = prompt(2)
    with make_cache(redis_server.url) as cache:
        assert cache.store(tokens, kv, ttl_s=0.3) == len(tokens)
        assert 0 < int(redis_server.cli("PTTL", redis_key(cache, tokens, 0))) <= 300
        assert cache.lookup(tokens) == len(tokens)
        assert wait_until(lambda: cache.lookup(tokens) == 0)
        assert cache.retrieve(tokens)[1] == 0


def test_a_pin_removes_the_expiry_and_counts_against_the_shared_budget(redis_server):
    redis_server.flush()
    tokens, kv = prompt(2)
    with make_cache(redis_server.url, ttl_s=60, refresh_ttl=False, pin_budget_bytes=3 * CHUNK_BYTES + 1024) as cache, \
            make_cache(redis_server.url, ttl_s=60, refresh_ttl=False, pin_budget_bytes=3 * CHUNK_BYTES + 1024) as other:
        cache.store(tokens, kv)
        assert int(redis_server.cli("PTTL", redis_key(cache, tokens, 0))) > 0
        assert cache.control.pin(tokens) == {"redis": len(tokens)}
        assert [redis_server.cli("PTTL", redis_key(cache, tokens, i)) for i in (0, 1)] == ["-1", "-1"]
        assert other.control.stats()["redis"].pinned_bytes > 0  # another replica sees the pins
        more, more_kv = prompt(2, seed=1)
        other.store(more, more_kv)
        with pytest.raises(PinBudgetExceeded):
            other.control.pin(more)  # over the budget, every replica's pins together
        assert int(redis_server.cli("PTTL", redis_key(other, more, 0))) > 0  # nothing changed
        assert cache.control.unpin(tokens)["redis"] > 0
        assert other.control.stats()["redis"].pinned_bytes == 0


def test_a_tier_whose_reads_rearm_its_ttl_cannot_pin_or_expire_per_store(redis_server):
    redis_server.flush()
    tokens, kv = prompt(2)
    with make_cache(redis_server.url, ttl_s=60) as cache:  # refresh_ttl is on by default
        assert Feature.PIN not in cache.tiers[0].supports
        cache.store(tokens, kv)
        with pytest.raises(NotSupported):
            cache.control.pin(tokens, tiers=["redis"])
        assert cache.control.pin(tokens) == {}  # no tier can pin: nothing to do
        other, other_kv = prompt(2, seed=3)
        assert cache.store(other, other_kv, ttl_s=5) == 0  # skipped, not kept past its retention


def test_clear_by_namespace_tenant_and_all(redis_server):
    redis_server.flush()
    tokens, kv = prompt(2)
    with make_cache(redis_server.url) as a, make_cache(redis_server.url, model="m@2") as b:
        a.store(tokens, kv, salt=b"alice")
        a.store(tokens, kv, salt=b"bob")
        a.store(tokens, kv)
        b.store(tokens, kv)
        redis_server.cli("SET", "kvtier:raw:{0123}", "an entry of the layout before namespaces")
        assert a.control.clear(tenant=b"alice") == {"redis": 2}
        assert a.lookup(tokens, salt=b"alice") == 0 and a.lookup(tokens, salt=b"bob") == len(tokens)
        assert a.control.clear(tenant=b"") == {"redis": None}  # the default tenant is not indexed
        assert a.lookup(tokens) == len(tokens)
        assert a.control.clear() == {"redis": 4}  # this model's: bob's and the default tenant's
        assert a.lookup(tokens, salt=b"bob") == a.lookup(tokens) == 0
        assert b.lookup(tokens) == len(tokens)  # another model's entries stay
        assert b.control.clear(all=True) == {"redis": 3}  # the other model's two and the old-layout key
        assert int(redis_server.cli("DBSIZE")) == 0


def test_clears_walk_the_key_space_in_many_scan_steps(redis_server, monkeypatch):
    import kvtier.tiers.redis.control as redis_control

    monkeypatch.setattr(redis_control, "SCAN_COUNT", 7)  # many cursor steps, as a large key space takes
    redis_server.flush()
    with make_cache(redis_server.url) as cache:
        for seed in range(30):
            tokens, kv = prompt(3, seed=seed)
            cache.store(tokens, kv, salt=b"t")
            cache.store(tokens, kv)
        assert cache.control.clear(tenant=b"t") == {"redis": 90}
        assert cache.control.clear() == {"redis": 90}
        assert int(redis_server.cli("DBSIZE")) == 0


def test_lookup_tiers_and_promotion_over_memory_and_redis(redis_server):
    redis_server.flush()
    tokens, kv = prompt(3)
    config = CacheConfig(chunk_size=CHUNK, tiers=(MemoryTierConfig(capacity_bytes=1 << 20, prefault=False),
                                                  RedisTierConfig(url=redis_server.url)))
    with KVCache(SPEC, "m@1", config) as cache:
        cache.store(tokens, kv, salt=b"alice")
        cache.tiers[0].clear()
        assert cache.control.lookup_tiers(tokens, salt=b"alice") == {"memory": 0, "redis": len(tokens)}
        assert cache.retrieve(tokens, salt=b"alice")[1] == len(tokens)
        assert cache.control.lookup_tiers(tokens, salt=b"alice") == {"memory": len(tokens), "redis": len(tokens)}
        assert cache.control.clear(tenant=b"alice") == {"memory": 3, "redis": 3}


def test_pins_and_clears_on_a_cluster_reach_every_shard(redis_cluster):
    redis_cluster.flush()
    with make_cache(redis_cluster.url, cluster=True, max_part_bytes=4096) as cache:
        prompts = [prompt(4, seed=seed) for seed in range(6)]
        for tokens, kv in prompts:
            cache.store(tokens, kv, salt=b"alice")
        cache.store(*prompts[0])
        assert all(n > 0 for n in redis_cluster.dbsizes())  # values (split in parts) on every primary
        assert cache.control.pin(prompts[0][0]) == {"redis": 4 * CHUNK}
        assert cache.control.clear(tenant=b"alice") == {"redis": 24}
        assert cache.lookup(prompts[0][0]) == 4 * CHUNK and cache.lookup(prompts[1][0], salt=b"alice") == 0
        assert cache.control.clear() == {"redis": 4}
        assert sum(redis_cluster.dbsizes()) == 0
