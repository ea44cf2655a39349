"""kvtier sim's model of a vLLM device cache (kvtier.apps.sim.device) against vLLM's own KV cache manager.

The same requests arrive and end, in the same order, in vLLM v1's ``KVCacheManager`` (its real block pool, free
queue and prefix-cache hashing) and in the simulator's ``FleetDevices``. A request vLLM cannot hold waits, first
come first served, as vLLM's scheduler keeps it, and is admitted when enough blocks come back. Every arriving
request must find the same prefix hit in both, and both must admit the same requests at the same moments.
Conversations grow turn by turn behind a shared system prompt, several run at once, and the pool is small, so
blocks are evicted and requests wait all along.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvtier.apps.sim.device import FleetDevices  # noqa: E402

BLOCK = 32


def vllm_manager(blocks: int) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    return KVCacheManager(config, max_model_len=8192, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True)


def admit(manager: KVCacheManager, request: Request) -> bool:
    """vLLM's scheduler admitting a waiting request: its prefix hit now, then blocks for the rest, or no room."""
    computed, hit = manager.get_computed_blocks(request)[:2]
    return manager.allocate_slots(request, request.num_tokens - hit, hit, computed) is not None


@pytest.mark.parametrize("seed", range(4))
def test_every_request_finds_and_waits_in_the_model_as_in_vllm(seed):
    rng = random.Random(seed)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    blocks = rng.choice([24, 40, 64])
    manager = vllm_manager(blocks)
    model = FleetDevices(1, blocks, BLOCK)
    system = [7] * rng.choice([40, 64, 100])
    conversations = [[rng.randrange(5000) for _ in range(rng.randrange(20, 120))] for _ in range(6)]
    running, waiting = [], deque()
    hits = waits = 0
    for step in range(300):
        now = float(step)
        if running and (len(running) + len(waiting) >= 4 or rng.random() < 0.4):
            request, mine = running.pop(rng.randrange(len(running)))
            manager.free(request)
            model.end_at(mine, now)
            model.settle(now)  # gives the blocks back and admits what now fits, in order
            while waiting and admit(manager, waiting[0][0]):
                running.append(waiting.popleft())
                assert running[-1][1].held is not None, f"step {step}: vLLM admitted a request the model holds back"
            assert all(mine.held is None for _, mine in waiting), f"step {step}: the model admitted one vLLM did not"
            continue
        turn = rng.randrange(len(conversations))
        if len(conversations[turn]) > 500:  # a conversation outgrows the pool: a new one in its place
            conversations[turn] = [rng.randrange(5000) for _ in range(rng.randrange(20, 120))]
        conversations[turn] += [rng.randrange(5000) for _ in range(rng.randrange(3, 70))]
        prompt = system + conversations[turn]
        request = Request(f"r{step}", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        hit = manager.get_computed_blocks(request)[1]
        keys = model.keys(prompt)
        assert model.cached_tokens(keys, len(prompt)) == [hit], f"step {step}"
        found, mine = model.start(0, keys, len(prompt))
        assert found == hit
        admitted = not waiting and admit(manager, request)
        assert admitted == (mine.held is not None), f"step {step}: vLLM and the model disagree on room"
        (running if admitted else waiting).append((request, mine))
        hits += hit > len(system) // BLOCK * BLOCK
        waits += not admitted
    assert hits > 20  # conversations found their earlier turns, not only the system prompt
    assert waits > 5, waits  # and requests waited for room
