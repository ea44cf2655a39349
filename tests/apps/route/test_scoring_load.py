"""Scoring as the router uses it: load in the cost, decisions with reasons, sticky breaks, replicas by name."""

from __future__ import annotations

from kvtier.fleet.scoring import (
    Decision,
    LoadBoundedAffinity,
    PrefixAffinity,
    Reason,
    ReplicaView,
    RoundRobin,
    RouteRequest,
    Routing,
    RoutingConfig,
    StickySessions,
    prefill_cost,
)

REQ = RouteRequest(prompt_tokens=4096, first_key=b"k" * 32)


def test_cost_counts_what_is_left_to_compute_plus_queued_prefill_and_decode_streams():
    view = ReplicaView({"memory": 2048, "disk": 1024}, load=3, prefill_tokens=500, decode_streams=2)
    assert prefill_cost(REQ, view, {"disk": 0.5}) == 4096 - 2048 - 512 + 500
    assert prefill_cost(REQ, view, {"disk": 0.5}, decode_stream_tokens=100) == 4096 - 2048 - 512 + 500 + 200
    assert prefill_cost(RouteRequest(100), ReplicaView({"memory": 4096}), {}) == 0  # never below zero


def test_a_holder_busy_prefilling_loses_to_an_idle_replica_when_its_queue_costs_more_than_the_hit():
    holder = ReplicaView({"memory": 1024}, load=1, prefill_tokens=3000)
    idle = ReplicaView({}, load=1)
    assert PrefixAffinity().decide(REQ, [holder, idle]).replica == 1
    light = ReplicaView({"memory": 1024}, load=1, prefill_tokens=500)
    decision = PrefixAffinity().decide(REQ, [light, idle])
    assert decision.replica == 0 and decision.reason is Reason.CACHED


def test_reasons_say_cached_spread_or_bound():
    idle = [ReplicaView(), ReplicaView()]
    assert LoadBoundedAffinity().decide(REQ, idle).reason is Reason.SPREAD
    held = [ReplicaView({"memory": 2048}, load=6), ReplicaView({}, load=0), ReplicaView({}, load=0)]
    decision = LoadBoundedAffinity(0.25).decide(REQ, held)
    assert decision.replica != 0 and decision.reason is Reason.BOUND
    assert RoundRobin().decide(REQ, idle).reason is Reason.ROUND_ROBIN


def test_sticky_sessions_count_breaks_and_follow_replicas_by_name():
    sticky = StickySessions(RoundRobin(), epsilon=0.25)
    req = RouteRequest(100, b"x" * 32, session="alice")
    fleet = [ReplicaView(name="a"), ReplicaView(name="b"), ReplicaView(name="c")]
    home = sticky.decide(req, fleet)
    assert sticky.decide(req, fleet) == home.__class__(home.replica, Reason.STICKY)
    home_name = fleet[home.replica].name
    without_home = [v for v in fleet if v.name != home_name]  # ejected: the list shrinks, indices shift
    moved = sticky.decide(req, without_home)
    assert moved.reason is Reason.STICKY_BREAK and sticky.breaks == 1
    back = [ReplicaView(name=v.name, load=0) for v in fleet]
    assert back[sticky.decide(req, back).replica].name == without_home[moved.replica].name  # its last replica
    busy = [ReplicaView(name=v.name, load=9 if v.name == without_home[moved.replica].name else 0) for v in fleet]
    assert sticky.decide(req, busy).reason is Reason.STICKY_BREAK and sticky.breaks == 2


def test_sticky_remember_moves_a_session_to_the_replica_that_served_it():
    sticky = StickySessions(RoundRobin())
    fleet = [ReplicaView(name="a"), ReplicaView(name="b")]
    sticky.decide(RouteRequest(1, session="s"), fleet)
    sticky.remember("s", "b")
    assert sticky.decide(RouteRequest(1, session="s"), fleet).replica == 1


def test_rendezvous_homes_follow_names_not_positions():
    policy = PrefixAffinity()
    fleet = [ReplicaView(name=n) for n in "abcd"]
    homes = {}
    for i in range(32):
        req = RouteRequest(10, bytes([i]) * 32)
        homes[i] = fleet[policy.choose(req, fleet)].name
    survivors = [v for v in fleet if v.name != "a"]
    for i, home in homes.items():
        if home != "a":  # a prefix whose home is still up keeps it after another replica left
            assert survivors[policy.choose(RouteRequest(10, bytes([i]) * 32), survivors)].name == home


def test_config_passes_the_decode_cost_on():
    policy = RoutingConfig(Routing.LOAD_BOUNDED, decode_stream_tokens=64.0).build()
    assert isinstance(policy, LoadBoundedAffinity) and policy.cost.decode_stream_tokens == 64.0


def test_the_load_floor_lets_a_replica_busy_with_one_request_keep_its_prefix_and_never_three():
    holder = ReplicaView({"memory": 2048}, load=1, name="a")
    idle = [holder, ReplicaView(name="b"), ReplicaView(name="c")]
    # one request in flight of three replicas: ceil(1.25 x 2 / 3) is 1, so without the floor the holder is full
    assert LoadBoundedAffinity(0.25, load_floor=1).decide(REQ, idle).reason is Reason.BOUND
    # the default floor of 2: the request waits behind one and loads its prefix
    assert LoadBoundedAffinity(0.25).decide(REQ, idle) == Decision(0, Reason.CACHED)
    two = [ReplicaView({"memory": 2048}, load=2, name="a"), ReplicaView(name="b"), ReplicaView(name="c")]
    assert LoadBoundedAffinity(0.25).decide(REQ, two).replica != 0  # the floor is 2, not more
    sticky = StickySessions(RoundRobin(), 0.25)
    req = RouteRequest(100, b"x" * 32, session="s")
    home = sticky.decide(req, [ReplicaView(name=n) for n in "abc"]).replica
    busy_one = [ReplicaView(name=n, load=1 if i == home else 0) for i, n in enumerate("abc")]
    assert sticky.decide(req, busy_one).reason is Reason.STICKY and sticky.breaks == 0
    strict = StickySessions(RoundRobin(), 0.25, load_floor=1)
    home = strict.decide(req, [ReplicaView(name=n) for n in "abc"]).replica
    assert strict.decide(req, [ReplicaView(name=n, load=1 if i == home else 0) for i, n in enumerate("abc")]
                         ).reason is Reason.STICKY_BREAK


def test_a_load_floor_below_one_request_is_refused():
    import pytest

    from kvtier.base.errors import ConfigError

    for build in (lambda: LoadBoundedAffinity(load_floor=0), lambda: StickySessions(RoundRobin(), load_floor=0),
                  lambda: RoutingConfig(Routing.LOAD_BOUNDED, load_floor=0).build()):
        with pytest.raises(ConfigError, match="load floor"):
            build()
