"""The Redis tier on a local three-primary Redis Cluster: per-shard pipelines, slot routing, one dead shard."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.tiers import RedisTier, RedisTierConfig
from tests.conformance.tier_suite import TierConformance, tier_context
from tests.tiers.test_redis import CHUNK, make_cache, prompt


class TestRedisClusterConformance(TierConformance):
    exact_usage = False

    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster):
        redis_cluster.flush()
        self.cluster = redis_cluster

    def make_tier(self, capacity_bytes: int) -> RedisTier:
        config = RedisTierConfig(url=self.cluster.url, cluster=True, max_value_bytes=capacity_bytes)
        return RedisTier(config, tier_context("redis"))


def test_chunks_spread_over_every_shard_and_come_back(redis_cluster):
    redis_cluster.flush()
    tokens, kv = prompt(24)
    with make_cache(redis_cluster.url, cluster=True, max_part_bytes=4096) as cache:
        assert cache.store(tokens, kv) == len(tokens)
        assert all(n > 0 for n in redis_cluster.dbsizes())  # every primary holds some chunks
        assert cache.lookup(tokens) == len(tokens)
        out, n = cache.retrieve(tokens)
        assert n == len(tokens) and torch.equal(out, kv)
        assert cache.tiers[0].stats().entries == sum(redis_cluster.dbsizes())
        assert len(cache.tiers[0]._servers.primaries()) == 3


def test_any_node_is_a_seed(redis_cluster):
    redis_cluster.flush()
    tokens, kv = prompt(6)
    url = f"redis://127.0.0.1:{redis_cluster.ports[2]}/0"
    with make_cache(url, cluster=True) as a, make_cache(redis_cluster.url, cluster=True) as b:
        a.store(tokens, kv)
        assert b.retrieve(tokens)[1] == len(tokens)


def test_cluster_off_against_a_cluster_gives_misses_not_errors(redis_cluster):
    redis_cluster.flush()
    tokens, kv = prompt(12)
    with make_cache(redis_cluster.url, cluster=True) as writer:
        writer.store(tokens, kv)
    with make_cache(redis_cluster.url) as plain:  # MOVED replies for other shards' keys: misses
        assert plain.lookup(tokens) < len(tokens)
        _, n = plain.retrieve(tokens)
        assert n < len(tokens)


def test_one_dead_shard_costs_only_its_keys(redis_cluster):
    """Runs last in this module: it kills a primary, then brings it back."""
    redis_cluster.flush()
    prompts = [prompt(1, seed=s) for s in range(30)]  # one chunk each, spread over the shards
    with make_cache(redis_cluster.url, cluster=True, timeout_s=0.3, breaker_failures=1,
                    breaker_cooldown_s=0.3) as cache:
        for tokens, kv in prompts:
            cache.store(tokens, kv)
        victim = redis_cluster.servers[1]
        victim.kill()
        try:
            start = time.monotonic()
            hits = [cache.retrieve(tokens)[1] for tokens, _ in prompts]
            assert time.monotonic() - start < 15.0  # a hang guard: one timeout, then the breaker (counted below)
            assert cache.metrics.total("kvtier_breaker_opens_total") >= 1
            assert 0 < hits.count(CHUNK) < len(prompts)  # the other shards still serve
        finally:
            victim.start()
            redis_cluster.wait_ok()
        # the restarted (empty) shard takes stores and serves hits again, same clients
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for tokens, kv in prompts:
                cache.store(tokens, kv)
            if all(cache.retrieve(tokens)[1] == CHUNK for tokens, _ in prompts):
                break
            time.sleep(0.2)
        assert all(cache.retrieve(tokens)[1] == CHUNK for tokens, _ in prompts)
