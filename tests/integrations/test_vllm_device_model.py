"""kvtier sim's model of a vLLM device cache (kvtier.apps.sim.device) against vLLM's own KV cache manager.

The same requests start and end, in the same order, in vLLM v1's ``KVCacheManager`` (its real block pool, free
queue and prefix-cache hashing) and in the simulator's ``FleetDevices``; every request must find the same
prefix hit in both, and both must refuse the same requests for want of room. Conversations grow turn by turn
behind a shared system prompt, several run at once, and the pool is small, so blocks are evicted all along.
"""

from __future__ import annotations

import random

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


@pytest.mark.parametrize("seed", range(4))
def test_every_request_finds_in_the_model_what_it_finds_in_vllm(seed):
    rng = random.Random(seed)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    blocks = rng.choice([24, 40, 64])
    manager = vllm_manager(blocks)
    model = FleetDevices(1, blocks, BLOCK)
    system = [7] * rng.choice([40, 64, 100])
    conversations = [[rng.randrange(5000) for _ in range(rng.randrange(20, 120))] for _ in range(6)]
    running: list[tuple[Request, list[int]]] = []
    hits = refusals = 0
    for step in range(300):
        if running and (len(running) >= 3 or rng.random() < 0.45):
            request, held = running.pop(rng.randrange(len(running)))
            manager.free(request)
            model.end_at(0, held, float(step))
            model.settle(float(step))
            continue
        turn = rng.randrange(len(conversations))
        if len(conversations[turn]) > 500:  # a conversation outgrows the pool: a new one in its place
            conversations[turn] = [rng.randrange(5000) for _ in range(rng.randrange(20, 120))]
        conversations[turn] += [rng.randrange(5000) for _ in range(rng.randrange(3, 70))]
        prompt = system + conversations[turn]
        request = Request(f"r{step}", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        computed, hit = manager.get_computed_blocks(request)[:2]
        keys = model.keys(prompt)
        assert model.cached_tokens(keys, len(prompt)) == [hit], f"step {step}"
        allocated = manager.allocate_slots(request, len(prompt) - hit, hit, computed)
        found, held = model.start(0, keys, len(prompt))
        assert found == hit
        assert (allocated is None) == (not held), f"step {step}: vLLM and the model disagree on room"
        if allocated is None:
            refusals += 1
            continue
        hits += hit > len(system) // BLOCK * BLOCK
        running.append((request, held))
    assert hits > 20  # conversations found their earlier turns, not only the system prompt
    assert refusals < 100
