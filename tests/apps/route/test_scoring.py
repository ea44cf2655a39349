"""Routing decisions over the router's view: affinity, load bound, ties, sessions."""

from __future__ import annotations

import collections

import pytest

from kvtier.base.errors import ConfigError
from kvtier.fleet.scoring import (
    LoadBoundedAffinity,
    PrefixAffinity,
    RandomChoice,
    ReplicaView,
    RoundRobin,
    RouteRequest,
    Routing,
    RoutingConfig,
    StickySessions,
    TieBreak,
    load_bound,
)

REQ = RouteRequest(prompt_tokens=4096, first_key=b"k" * 32)


def views(*specs: tuple[dict[str, int], float]) -> list[ReplicaView]:
    return [ReplicaView(cached, load) for cached, load in specs]


def test_round_robin_cycles():
    rr = RoundRobin()
    fleet = views(({}, 0), ({}, 0), ({}, 0))
    assert [rr.choose(REQ, fleet) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded_and_spreads():
    picks = [RandomChoice(seed=3).choose(REQ, views(({}, 0), ({}, 0))) for _ in range(5)]
    assert len(set(picks)) == 1  # a fresh chooser with the same seed repeats itself
    chooser = RandomChoice(seed=3)
    counts = collections.Counter(chooser.choose(REQ, views(({}, 0),) * 4) for _ in range(400))
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 60


def test_prefix_affinity_prefers_the_longest_cached_prefix_weighted_by_tier():
    fleet = views(({"memory": 512}, 0), ({"memory": 1024}, 5), ({"disk": 1536}, 0))
    assert PrefixAffinity().choose(REQ, fleet) == 2
    assert PrefixAffinity({"disk": 0.5}).choose(REQ, fleet) == 1


def test_ties_go_to_the_least_loaded_then_to_a_stable_rendezvous_winner():
    assert PrefixAffinity().choose(REQ, views(({}, 3), ({}, 1), ({}, 2))) == 1
    idle = views(({}, 0), ({}, 0), ({}, 0), ({}, 0))
    homes = {PrefixAffinity().choose(RouteRequest(1, bytes([i]) * 32), idle) for i in range(64)}
    assert homes == {0, 1, 2, 3}  # new prefixes spread over the fleet
    assert all(PrefixAffinity().choose(REQ, idle) == PrefixAffinity().choose(REQ, idle) for _ in range(3))


def test_a_random_tie_break_spreads_one_prefix_and_keeps_every_other_rule():
    """llm-d's max-score picker shuffles equal candidates: with ``TieBreak.RANDOM`` one prompt's ties spread
    over the fleet (seeded, so a run repeats), while cost and load still decide before the draw."""
    idle = views(({}, 0), ({}, 0), ({}, 0))
    policy = RoutingConfig(Routing.LOAD_BOUNDED, epsilon=10.0, tie_break=TieBreak.RANDOM, seed=5).build()
    picks = collections.Counter(policy.choose(REQ, idle) for _ in range(300))
    assert set(picks) == {0, 1, 2} and min(picks.values()) > 60

    def draws(seed: int) -> list[int]:
        chooser = RoutingConfig(Routing.LOAD_BOUNDED, epsilon=10.0, tie_break=TieBreak.RANDOM, seed=seed).build()
        return [chooser.choose(REQ, idle) for _ in range(20)]

    assert draws(5) == draws(5) and draws(5) != draws(6)
    home = RoutingConfig(Routing.LOAD_BOUNDED, epsilon=10.0).build()
    assert len({home.choose(REQ, idle) for _ in range(50)}) == 1  # the default keeps one home
    cached = views(({}, 0), ({"GPU": 2048}, 0), ({}, 0))
    assert all(policy.choose(REQ, cached) == 1 for _ in range(50))  # a cached prefix is no tie
    loaded = views(({}, 2), ({}, 0), ({}, 2))
    assert all(policy.choose(REQ, loaded) == 1 for _ in range(50))  # nor is load


def test_load_bound_follows_bounded_load_hashing():
    assert load_bound(views(({}, 0), ({}, 0), ({}, 0), ({}, 0)), 0.25) == 1
    assert load_bound(views(({}, 6), ({}, 2), ({}, 2), ({}, 1)), 0.25) == 4


def test_load_bounded_affinity_skips_an_overloaded_holder():
    fleet = views(({"memory": 8192}, 6), ({"memory": 512}, 2), ({}, 2), ({}, 1))
    assert PrefixAffinity().choose(REQ, fleet) == 0
    assert LoadBoundedAffinity(0.25).choose(REQ, fleet) == 1
    assert LoadBoundedAffinity(10.0).choose(REQ, fleet) == 0  # a loose bound keeps affinity


def test_negative_epsilon_is_rejected():
    with pytest.raises(ConfigError):
        LoadBoundedAffinity(-0.1)


def test_sticky_sessions_keep_a_session_home_until_it_is_overloaded():
    sticky = StickySessions(RoundRobin(), epsilon=0.25)
    req = RouteRequest(100, b"x" * 32, session="alice")
    idle = views(({}, 0), ({}, 0), ({}, 0))
    first = sticky.choose(req, idle)
    assert all(sticky.choose(req, idle) == first for _ in range(5))
    busy = [ReplicaView({}, 9 if i == first else 0) for i in range(3)]
    assert sticky.choose(req, busy) != first
    assert sticky.choose(RouteRequest(100, b"y" * 32), idle) is not None  # no session: the inner policy


def test_sticky_sessions_forget_the_oldest_beyond_their_bound():
    sticky = StickySessions(RoundRobin(), max_sessions=2)
    idle = views(({}, 0), ({}, 0))
    homes = {name: sticky.choose(RouteRequest(1, session=name), idle) for name in ("a", "b", "c")}
    assert homes == {"a": 0, "b": 1, "c": 0}
    assert sticky.choose(RouteRequest(1, session="c"), idle) == 0  # remembered
    assert sticky.choose(RouteRequest(1, session="a"), idle) == 1  # forgotten: round-robin's next turn


def test_routing_config_builds_each_policy():
    assert isinstance(RoutingConfig(Routing.ROUND_ROBIN).build(), RoundRobin)
    assert isinstance(RoutingConfig(Routing.PREFIX).build(), PrefixAffinity)
    built = RoutingConfig(Routing.LOAD_BOUNDED, epsilon=0.5, sticky=True).build()
    assert isinstance(built, StickySessions) and isinstance(built.inner, LoadBoundedAffinity)
