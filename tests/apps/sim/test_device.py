"""The replay's vLLM device caches: hits counted as the device's, the router seeing them, other runs' requests
taking room beside the replayed ones, and tiers the router does not index left out of its view. (The block
pool itself is checked against vLLM's own in tests/integrations/test_vllm_device_model.py.)"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvtier.apps.sim.bench_replay import read_background
from kvtier.apps.sim.device import DevicePool, FleetDevices
from kvtier.apps.sim.fleet import FleetConfig, SimTier
from kvtier.apps.sim.replay import _cached_view, replay
from kvtier.apps.sim.trace import TokenPrompt, TraceRequest
from kvtier.base.errors import ConfigError
from kvtier.fleet.scoring import Routing, RoutingConfig
from kvtier.fleet.vllm_index import vllm_namespace

CHUNK, BLOCK = 128, 32


def block_keys(tokens: np.ndarray) -> list:
    return vllm_namespace(BLOCK).chunk_hashes(tokens)


def prompt(seed: int, tokens: int = 640) -> np.ndarray:
    return np.random.default_rng(seed).integers(1000, 2**31, tokens, dtype="<u4")


def request(ids: np.ndarray, arrival: float, *, e2e_s: float = 1.0, session: str = "s", replica: str | None = None,
            ) -> TraceRequest:
    return TraceRequest(arrival, TokenPrompt(ids), len(ids), 4, CHUNK, session, measured_ttft_s=e2e_s / 2,
                        measured_e2e_s=e2e_s, measured_replica=replica)


def device_fleet(replicas: int = 1, device_blocks: int = 64, tier_chunks: int = 0, **routing) -> FleetConfig:
    names = tuple(f"10.0.0.{i}:8000" for i in range(replicas))
    return FleetConfig(replicas=replicas, replica_names=names, tiers=(SimTier(chunks=tier_chunks, policy="lru"),),
                       vllm_block_size=BLOCK, vllm_device_blocks=device_blocks,
                       routing=RoutingConfig(Routing.LOAD_BOUNDED, **routing))


def test_a_freed_prompt_loses_its_tail_before_its_head():
    pool = DevicePool(5)
    keys = block_keys(prompt(1, 4 * BLOCK))
    assert pool.admit(keys, 4) == (0, [0, 1, 2, 3])
    pool.release([0, 1, 2, 3])
    hit, held = pool.admit(block_keys(prompt(2, 3 * BLOCK)), 3)  # one never-used block, then two evicted
    assert hit == 0 and len(held) == 3
    assert pool.cached_blocks(keys) == 2  # its first two blocks are still there


def test_a_request_the_pool_cannot_hold_whole_takes_nothing():
    pool = DevicePool(4)
    first = block_keys(prompt(1, 3 * BLOCK))
    pool.admit(first, 3)
    assert pool.admit(block_keys(prompt(2, 2 * BLOCK)), 2) == (0, [])
    assert pool.cached_blocks(first) == 3


def test_a_repeated_prompt_hits_the_device_and_is_counted_as_its_hit():
    ids = prompt(1)
    result = replay([request(ids, 0.0), request(ids, 5.0)], device_fleet(), CHUNK)
    # the second finds 19 of its 20 blocks (never the block with the last token); kvtier's tier holds nothing
    assert result.hit_chunks_by_tier["device"] == 19 * BLOCK // CHUNK
    assert result.saved_tokens == 19 * BLOCK


def test_other_runs_requests_take_the_device_room_the_replayed_one_needed():
    ids = prompt(1)
    mine = [request(ids, 0.0), request(ids, 10.0)]
    fleet = device_fleet(device_blocks=32)
    assert replay(mine, fleet, CHUNK).saved_tokens == 19 * BLOCK
    others = [request(prompt(100 + i), 2.0 + i, replica=fleet.replica_names[0]) for i in range(3)]
    assert replay(mine, fleet, CHUNK, background=others).saved_tokens == 0
    elsewhere = [dataclasses.replace(r, measured_replica="10.9.9.9:8000") for r in others]  # not this fleet's
    assert replay(mine, fleet, CHUNK, background=elsewhere).saved_tokens == 19 * BLOCK


@pytest.mark.parametrize("runner_blocks, saved", [(30, 0), (8, 19 * BLOCK)])
def test_a_request_that_does_not_fit_waits_for_room_and_then_takes_it(runner_blocks, saved):
    ids = prompt(1)
    fleet = device_fleet(device_blocks=32)
    mine = [request(ids, 0.0, e2e_s=1.0), request(ids, 10.0)]
    runner = request(prompt(50, runner_blocks * BLOCK), 0.5, replica=fleet.replica_names[0])
    # 31 blocks of room, the first request holds 21 until 1.0 s: a runner of 31 waits until then and takes the
    # first's blocks (the repeat finds nothing); one of 9 fits beside it and evicts nothing
    assert replay(mine, fleet, CHUNK, background=[runner]).saved_tokens == saved


def test_requests_that_hold_nothing_or_never_fit_do_not_hold_up_the_queue():
    devices = FleetDevices(1, 8, BLOCK)  # 7 blocks of room
    for tokens in (0, 20 * BLOCK):
        _, request = devices.start(0, block_keys(prompt(tokens + 1, tokens)), tokens)
        assert request.held == []
    keys = block_keys(prompt(2, 4 * BLOCK))
    _, after = devices.start(0, keys, 4 * BLOCK)
    assert after.held is not None and len(after.held) == 4


def test_the_router_follows_the_device_it_sees():
    ids = prompt(1)
    fleet = device_fleet(replicas=3, tier_weights=(("memory", 0.0),))
    first, again = request(ids, 0.0, session="a"), request(ids, 5.0, session="b")
    result = replay([first, again], fleet, CHUNK)
    assert result.hit_chunks_by_tier["device"] == 19 * BLOCK // CHUNK
    assert max(r.requests for r in result.replicas) == 2


def test_tiers_the_router_does_not_index_are_not_in_its_view():
    # chunk 0 under the device's 160 tokens, chunk 1 partly (96 tokens beyond), chunk 2 in an unseen tier
    assert _cached_view(["memory", "memory", "disk"], 160, CHUNK, frozenset({"disk"})) == {"device": 160,
                                                                                              "memory": 96}
    assert _cached_view(["memory"], 0, CHUNK, frozenset()) == {"memory": CHUNK}
    assert _cached_view(["memory"], 64, CHUNK, frozenset({"device"})) == {"memory": 64}


def test_device_blocks_need_a_block_size_and_background_needs_names():
    with pytest.raises(ConfigError, match="vllm_device_blocks"):
        FleetConfig(vllm_device_blocks=10)
    with pytest.raises(ConfigError, match="vllm_device_blocks"):
        FleetConfig(vllm_device_blocks=-1, vllm_block_size=BLOCK)
    unnamed = dataclasses.replace(device_fleet(), replica_names=())
    with pytest.raises(ConfigError, match="replica_names"):
        replay([request(prompt(1), 0.0)], unnamed, CHUNK, background=[request(prompt(2), 0.0, replica="x")])


def test_background_files_leave_out_the_run_being_replayed(tmp_path):
    def run(target: str, replica: str) -> dict:
        return {"target": target, "requests": [{"round": 0, "user": 0, "status": 200, "sent_at": 1.0, "e2e_s": 1.0,
                                                "completion_tokens": 4, "text": "ok", "replica": replica}]}

    spec = {"users": 1, "rounds": 1, "system_words": 5, "context_words": 40, "turn_words": 5, "max_tokens": 4}
    doc = {"config": {"workload": "multiround", "spec": spec}, "runs": [run("a", "r0"), run("b", "r1")]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    assert [r.measured_replica for r in read_background([path], chunk_tokens=CHUNK)] == ["r0", "r1"]
    assert [r.measured_replica for r in read_background([path], chunk_tokens=CHUNK, but=(path, "a"))] == ["r1"]
    assert [r.measured_replica for r in read_background([path], chunk_tokens=CHUNK, but=(path, None))] == ["r1"]
