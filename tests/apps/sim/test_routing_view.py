"""The simulator routes as ``kvtier route`` does: a new prefix's tie-break key is the router's key of a vLLM
replica's first block, and the load bound sees a recorded request in flight for as long as it was measured."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvtier.apps.sim.fleet import FleetConfig, SimTier
from kvtier.apps.sim.replay import first_key, replay
from kvtier.apps.sim.trace import TokenPrompt, TraceRequest
from kvtier.fleet.scoring import ReplicaView, RouteRequest, Routing, RoutingConfig, TieBreak
from kvtier.fleet.vllm_index import vllm_namespace

CHUNK, BLOCK = 128, 32
SYSTEM = np.arange(1, 61, dtype="<u4")  # a system prompt every conversation starts with: two vLLM blocks, no chunk


def conversation(n: int, arrival: float, e2e_s: float | None = None, context: int = 400) -> TraceRequest:
    own = np.random.default_rng(n).integers(1000, 2**31, context, dtype="<u4")
    ids = np.concatenate([SYSTEM, own])
    return TraceRequest(arrival, TokenPrompt(ids), len(ids), 4, CHUNK, f"c{n}", measured_ttft_s=e2e_s,
                        measured_e2e_s=e2e_s)


def fleet(*, sticky: bool = False, block: int | None = BLOCK, load_floor: int = 2) -> FleetConfig:
    return FleetConfig(replicas=3, tiers=(SimTier(chunks=1000, policy="lru"),), vllm_block_size=block,
                       routing=RoutingConfig(Routing.LOAD_BOUNDED, sticky=sticky, load_floor=load_floor))


def test_new_conversations_sharing_a_system_prompt_go_where_the_routers_tie_break_sends_them():
    # one at a time, each done before the next: no load to spread them, nothing cached of a new one's prompt
    requests = [conversation(n, 10.0 * n, e2e_s=1.0) for n in range(6)]
    router_key = bytes(vllm_namespace(BLOCK).chunk_hashes(requests[0].prompt.tokens())[0])
    assert all(first_key(r.prompt.tokens(), [], vllm_namespace(BLOCK)) == router_key for r in requests)
    home = RoutingConfig(Routing.LOAD_BOUNDED).build().choose(RouteRequest(460, router_key), [ReplicaView()] * 3)
    result = replay(requests, fleet(), CHUNK)
    assert [r.requests for r in result.replicas] == [6 if i == home else 0 for i in range(3)]
    # keyed by their first 128-token chunk (each conversation's own context), they would have spread
    assert max(r.requests for r in replay(requests, fleet(block=None), CHUNK).replicas) < 6


def test_a_second_request_while_the_first_is_measured_in_flight_breaks_stickiness():
    # the load bound at its strictest (no floor): one request in flight fills a replica of three
    first = conversation(1, 0.0, e2e_s=30.0)
    again = TraceRequest(5.0, TokenPrompt(np.concatenate([first.prompt.tokens(), SYSTEM])), 520, 4, CHUNK, "c1",
                         measured_ttft_s=1.0, measured_e2e_s=1.0)
    result = replay([first, again], fleet(sticky=True, load_floor=1), CHUNK)
    assert result.sticky_breaks == 1
    assert sorted(r.requests for r in result.replicas) == [0, 1, 1]
    assert result.hit_chunks == 0  # private caches: the break is a full miss
    # the same two requests unmeasured: the load model has the first done in time, the session stays and hits
    unmeasured = [TraceRequest(r.arrival_s, r.prompt, r.input_tokens, 4, CHUNK, "c1") for r in (first, again)]
    result = replay(unmeasured, fleet(sticky=True, load_floor=1), CHUNK)
    assert result.sticky_breaks == 0 and result.hit_chunks == 3


def test_the_load_floor_keeps_a_session_on_a_replica_busy_with_one_request_and_breaks_at_two():
    first = conversation(1, 0.0, e2e_s=30.0)
    second, third = (TraceRequest(t, TokenPrompt(np.concatenate([first.prompt.tokens(), SYSTEM[:n]])), 460 + n, 4,
                                  CHUNK, "c1", measured_ttft_s=30.0, measured_e2e_s=30.0)
                     for t, n in ((5.0, 20), (6.0, 40)))
    result = replay([first, second], fleet(sticky=True), CHUNK)  # the default floor: 2 in flight
    assert result.sticky_breaks == 0 and sorted(r.requests for r in result.replicas) == [0, 0, 2]
    assert result.hit_chunks == 3  # the second waits for its replica and loads the first's chunks
    result = replay([first, second, third], fleet(sticky=True), CHUNK)
    assert result.sticky_breaks == 1 and sorted(r.requests for r in result.replicas) == [0, 1, 2]


def test_named_replicas_draw_what_the_router_drew_and_the_replay_counts_its_matches():
    # random ties keyed by each prompt's digest: which replica wins hashes its name, so only the router's names
    # reproduce its draws (one request at a time: nothing in flight, nothing cached of a new prompt's own part)
    names = ("127.0.0.1:41001", "127.0.0.1:41002", "127.0.0.1:41003")
    random_ties = RoutingConfig(Routing.LOAD_BOUNDED, tie_break=TieBreak.RANDOM)
    router = random_ties.build()
    views = [ReplicaView(name=name) for name in names]
    requests = []
    for n in range(12):
        request = conversation(n, 10.0 * n, e2e_s=1.0)
        draw = n.to_bytes(4, "little")
        chosen = router.choose(RouteRequest(request.input_tokens, b"", request.session, draw), views)
        requests.append(dataclasses.replace(request, draw_key=draw, measured_replica=names[chosen]))
    assert len({r.measured_replica for r in requests}) == 3  # the draws spread them
    named = dataclasses.replace(fleet(block=None), routing=random_ties, replica_names=names)
    result = replay(requests, named, CHUNK)
    assert result.placements_compared == result.placements_matched == 12
    # the same replicas under other names (as a replay without the run's names would have them): other draws
    others = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
    renamed = [dataclasses.replace(r, measured_replica=others[names.index(r.measured_replica)]) for r in requests]
    assert replay(renamed, dataclasses.replace(named, replica_names=others), CHUNK).placements_matched < 10
    assert replay(requests, dataclasses.replace(named, replica_names=()), CHUNK).placements_compared == 0


def test_a_decoding_stream_costs_its_replica_decode_stream_tokens():
    # A decodes a long answer on its replica X; B (60 uncached tokens) prefills on Y, C (460) on Z. D then costs
    # X 128 (A's stream) against Y's 60: it goes to Y; with decoding free X costs 0 and takes it
    def one(n: int, at: float, ttft: float, context: int) -> TraceRequest:
        return dataclasses.replace(conversation(n, at, context=context), measured_ttft_s=ttft, measured_e2e_s=100.0)

    requests = [one(0, 0.0, 0.5, 400), one(1, 1.0, 100.0, 0), one(2, 1.5, 100.0, 400), one(3, 1.6, 100.0, 400)]
    placed = {}
    for tokens in (128.0, 0.0):
        routing = RoutingConfig(Routing.LOAD_BOUNDED, decode_stream_tokens=tokens, load_floor=3)
        placed[tokens] = [r.requests for r in replay(requests, dataclasses.replace(fleet(block=None),
                                                                                  routing=routing), CHUNK).replicas]
    assert sorted(placed[128.0]) == sorted(placed[0.0]) == [1, 1, 2]
    assert placed[128.0] != placed[0.0]  # D went to Y, not to X
