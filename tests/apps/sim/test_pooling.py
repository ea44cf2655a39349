"""Pooled against private memory at equal total capacity (kvtier.apps.sim.pooling): what the Mooncake benchmark's
fleet figures rest on."""

from __future__ import annotations

import pytest

from kvtier.apps.sim.fleet import FleetConfig, SimTier
from kvtier.apps.sim.pooling import ARMS, compare, fleets
from kvtier.apps.sim.replay import replay
from kvtier.apps.sim.trace import read_mooncake
from kvtier.base.errors import ConfigError
from kvtier.fleet.scoring import Routing
from tests.apps.sim.conftest import BLOCK_TOKENS

TOTAL = 240


@pytest.fixture(scope="module")
def requests(small_trace):
    return read_mooncake(small_trace, block_tokens=BLOCK_TOKENS)


@pytest.mark.parametrize("share", [0.0, 0.125, 0.5, 1.0])
def test_every_arm_holds_the_same_total(share):
    for fleet in fleets(1_003, 4, Routing.ROUND_ROBIN, share).values():
        shared = fleet.shared.chunks if fleet.shared is not None else 0
        assert fleet.replicas * fleet.tiers[0].chunks + shared <= 1_003
        assert fleet.replicas * fleet.tiers[0].chunks + shared > 1_003 - 4


def test_bad_arms_are_config_errors():
    with pytest.raises(ConfigError):
        fleets(3, 4, Routing.ROUND_ROBIN, 0.1)
    with pytest.raises(ConfigError):
        fleets(100, 4, Routing.ROUND_ROBIN, 1.5)


def test_a_pool_hits_more_than_private_tiers_of_the_same_total(requests):
    rr, lb = compare(requests, BLOCK_TOKENS, totals=[TOTAL], routings=[Routing.ROUND_ROBIN, Routing.LOAD_BOUNDED])
    assert set(rr.hit) == set(ARMS)
    assert rr.hit["pooled"] > 1.5 * rr.hit["private"] > 0  # round-robin scatters prefixes over private tiers
    assert rr.hit["pooled"] >= rr.hit["mixed"] > rr.hit["private"]
    assert lb.hit["pooled"] >= lb.hit["private"]  # affinity routing recovers most of it, never more
    assert rr.hit["pooled"] == lb.hit["pooled"]  # every replica sees the same pool: routing cannot matter


def test_a_pool_hits_exactly_what_one_cache_of_its_size_does(requests):
    one = replay(requests, FleetConfig(tiers=(SimTier(chunks=TOTAL, policy="lru"),)), BLOCK_TOKENS)
    pooled = replay(requests, fleets(TOTAL, 4, Routing.ROUND_ROBIN, 0.0)["pooled"], BLOCK_TOKENS)
    assert pooled.hit_chunks == one.hit_chunks > 0
    assert pooled.hit_chunks_by_tier["shared"] == pooled.hit_chunks
