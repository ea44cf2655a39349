"""Replays through real caches: exact against the references where they must agree, bounded by them
everywhere, and tiers, shared tier and routing doing what a fleet of kvtier caches would."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from kvtier.apps.sim.fleet import FleetConfig, SimTier, TierKind
from kvtier.apps.sim.reference import belady_hits, ideal_hits
from kvtier.apps.sim.replay import replay
from kvtier.apps.sim.replica import Replica, chunk_slot_bytes
from kvtier.apps.sim.study import chunk_chains
from kvtier.apps.sim.trace import read_mooncake
from kvtier.fleet.scoring import Routing, RoutingConfig
from kvtier.tiers import WriteMode
from tests.apps.sim.conftest import BLOCK_TOKENS


@pytest.fixture(scope="module")
def requests(small_trace):
    return read_mooncake(small_trace, block_tokens=BLOCK_TOKENS)


@pytest.fixture(scope="module")
def chains(requests):
    return chunk_chains(requests, BLOCK_TOKENS)


def one_cache(chunks: int, policy: str = "lru", *more: SimTier) -> FleetConfig:
    return FleetConfig(tiers=(SimTier(chunks=chunks, policy=policy), *more))


def test_a_cache_that_never_fills_hits_exactly_the_ideal(requests, chains):
    result = replay(requests, one_cache(10**5), BLOCK_TOKENS)
    assert result.hit_chunks == ideal_hits(chains) > 0
    assert result.chunks == sum(len(c) for c in chains)
    assert belady_hits(chains, 10**5) == result.hit_chunks


def test_lru_replay_matches_a_plain_model_of_the_cache(requests, chains):
    """Every hit of the real cache, tier and policy, against twenty lines of OrderedDict: a retrieve reads the
    longest held prefix (reported deepest chunk first), a store adds what is missing (deepest first), and
    then the whole chain is ordered deepest first (``order_chain``)."""
    capacity, held, hits = 50, collections.OrderedDict(), 0
    for keys in chains:
        n = next((i for i, k in enumerate(keys) if k not in held), len(keys))
        hits += n
        for k in reversed(keys[:n]):
            held.move_to_end(k)
        for k in reversed([k for k in keys if k not in held]):
            if len(held) >= capacity:
                held.popitem(last=False)
            held[k] = None
        for k in reversed(keys):
            if k in held:
                held.move_to_end(k)
    assert replay(requests, one_cache(capacity), BLOCK_TOKENS).hit_chunks == hits > 0


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc", "arc-lfu", "tinylfu"])
def test_no_policy_beats_the_offline_optimum(requests, chains, policy):
    for capacity in (30, 120):
        hits = replay(requests, one_cache(capacity, policy), BLOCK_TOKENS).hit_chunks
        assert 0 < hits <= belady_hits(chains, capacity) <= ideal_hits(chains)


def test_tiers_are_named_by_kind():
    fleet = FleetConfig(tiers=(SimTier(chunks=4), SimTier(kind=TierKind.DISK, chunks=8), SimTier(chunks=2)))
    replica = Replica(fleet, BLOCK_TOKENS, 1, None)
    try:
        assert replica.labels == ["memory", "disk", "memory2"]
    finally:
        replica.close()


def test_a_tier_holds_exactly_its_capacity(requests):
    replica = Replica(one_cache(40), BLOCK_TOKENS, 1, None)
    try:
        for request in requests[:60]:
            replica.serve(request.prompt.tokens())
        stats = replica.cache.tiers[0].stats()
        assert stats.entries == 40
        assert stats.used_bytes == 40 * chunk_slot_bytes(BLOCK_TOKENS) <= stats.capacity_bytes
    finally:
        replica.close()


@pytest.mark.parametrize("write", [WriteMode.THROUGH, WriteMode.BACK])
def test_a_second_tier_adds_hits_of_its_own(requests, chains, write):
    alone = replay(requests, one_cache(30), BLOCK_TOKENS)
    disk = SimTier(kind=TierKind.DISK, chunks=300, write=write)
    both = replay(requests, one_cache(30, "lru", disk), BLOCK_TOKENS)
    assert both.hit_chunks_by_tier["disk"] > 0
    assert both.hit_chunks > alone.hit_chunks
    assert both.hit_chunks <= belady_hits(chains, 330)


def test_byte_capacities_follow_the_model_and_codec():
    tier = SimTier(capacity_bytes=64 * 2**30, codec_ratio=2.0)
    assert tier.capacity_chunks(512 * 131_072) == 2048  # 64 GiB of 64 MiB chunks, twice as many compressed


def test_a_shared_tier_serves_what_other_replicas_stored(requests):
    base = FleetConfig(replicas=3, tiers=(SimTier(chunks=10),), routing=RoutingConfig(Routing.ROUND_ROBIN))
    alone = replay(requests, base, BLOCK_TOKENS)
    shared = replay(requests, dataclasses.replace(base, shared=SimTier(chunks=400)), BLOCK_TOKENS)
    assert shared.hit_chunks_by_tier["shared"] > 0
    assert shared.hit_chunks > 2 * alone.hit_chunks


def test_cache_aware_routing_beats_round_robin(requests):
    def run(routing: Routing) -> float:
        fleet = FleetConfig(replicas=4, tiers=(SimTier(chunks=60),), routing=RoutingConfig(routing))
        result = replay(requests, fleet, BLOCK_TOKENS)
        assert sum(r.requests for r in result.replicas) == len(requests)
        return result.chunk_hit_ratio

    round_robin = run(Routing.ROUND_ROBIN)
    assert run(Routing.PREFIX) > 1.2 * round_robin
    assert run(Routing.LOAD_BOUNDED) > 1.2 * round_robin


def test_saved_and_computed_tokens_add_up(requests):
    result = replay(requests, FleetConfig(replicas=2, tiers=(SimTier(chunks=80),)), BLOCK_TOKENS)
    assert result.input_tokens == sum(r.input_tokens for r in requests)
    assert sum(r.saved_tokens + r.prefill_tokens for r in result.replicas) == result.input_tokens
    assert 0 < result.token_hit_ratio < 1


def test_the_simulator_runs_the_tiers_admission_policies(requests, chains):
    """second-hit writes only chunks sighted twice; a cap writes less; the counts add up to the offers."""
    def run(**admission) -> tuple:
        disk = SimTier(kind=TierKind.DISK, chunks=300, **admission)
        res = replay(requests, one_cache(30, "lru", disk), BLOCK_TOKENS)
        return res, res.written_chunks_by_tier["disk"], res.refused_chunks_by_tier["disk"]

    always, wrote_all, refused_none = run(admission="always")
    assert refused_none == 0 and wrote_all > 0
    second, wrote_second, refused_second = run(admission="second-hit")
    assert wrote_second < wrote_all and refused_second > 0
    assert wrote_second <= sum(n - 1 for n in collections.Counter(k for c in chains for k in c).values() if n > 1)
    assert run()[1] == wrote_second  # a disk below memory defaults to second-hit, as the real tier does
    rate = 512 * 131_072 * 2  # two chunks' worth of the served model's KV per second of the trace
    capped, wrote_capped, refused_capped = run(admission="always", admission_max_bytes_per_s=rate)
    assert wrote_capped < wrote_all and refused_capped > 0
    assert always.written_chunks_by_tier["memory"] > 0
