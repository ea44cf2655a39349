"""A request's chunks leave a tier deepest first, however they reached it (kvtier/policy/base.py, ``on_chain``).

A chunk whose predecessor is gone can never hit, so at every moment the chunks of a prompt that a tier holds
must be a prefix of the prompt. Each test makes a prompt's chunks reach the tier in several batches (the
pipeline's windows, or a retrieve's prefix then a store's rest), then evicts one chunk at a time by storing
unrelated chunks and checks that the prompt's held chunks stay a prefix throughout.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.core.jobs import PipelineTuning
from kvtier.policy import POLICIES
from kvtier.tiers import DiskTierConfig, Flushable, MemoryTierConfig

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
CHUNK = 16
CHUNK_BYTES = SPEC.bytes_per_token * CHUNK
SLOTS = 10  #: chunks the tier holds
TWO_CHUNK_WINDOWS = PipelineTuning(window_bytes=2 * CHUNK_BYTES)


def kv_for(n_tokens: int) -> torch.Tensor:
    return torch.randn(SPEC.chunk_shape(n_tokens), generator=torch.Generator().manual_seed(n_tokens)).to(SPEC.dtype)


@pytest.fixture(params=["memory", "disk"])
def make_cache(request, tmp_path):

    def make(policy: str) -> KVCache:
        room = SLOTS * (CHUNK_BYTES + 320)  # payload and header of each chunk
        if request.param == "memory":
            tier = MemoryTierConfig(capacity_bytes=room, policy=policy)
        else:
            tier = DiskTierConfig(path=tmp_path, capacity_bytes=room, policy=policy, fsync=False, o_direct=False)
        cache = KVCache(SPEC, "chain-order@1", CacheConfig(chunk_size=CHUNK, tiers=(tier,)), tuning=TWO_CHUNK_WINDOWS)
        assert cache._pipeline.per_window == 2  # two chunks a window
        return cache

    return make


def settle(cache: KVCache) -> None:
    tier = cache.tiers[0]
    if isinstance(tier, Flushable):
        tier.flush()


def held(cache: KVCache, tokens: list[int]) -> list[bool]:
    settle(cache)
    return cache.tiers[0].contains(cache.keys(tokens))


def evict_checking_prefix(cache: KVCache, tokens: list[int], unused_tail: int) -> None:
    """Store unrelated one-chunk prompts, one at a time; after each, the chunks of ``tokens`` held must be a
    prefix of it. The ``unused_tail`` chunks that were never read must all go (a frequency policy may keep
    the rest for good against one-time chunks, which is right)."""
    n = len(tokens) // CHUNK
    for filler in range(1, 3 * SLOTS):
        now = held(cache, tokens)
        count = sum(now)
        assert now == [True] * count + [False] * (n - count), f"after {filler - 1} fillers: {now}"
        cache.store([10_000 * filler + t for t in range(CHUNK)], kv_for(CHUNK))
    assert sum(held(cache, tokens)) <= n - unused_tail


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_prompt_stored_in_windows_is_evicted_from_its_end(make_cache, policy):
    cache = make_cache(policy)
    prompt = list(range(6 * CHUNK))  # three windows, written root side first
    assert cache.store(prompt, kv_for(len(prompt))) == len(prompt)
    evict_checking_prefix(cache, prompt, unused_tail=6)
    cache.close()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_prefix_read_then_a_longer_prompt_stored_is_evicted_from_its_end(make_cache, policy):
    """The retrieve touches the prefix (its windows loaded in parallel), the store then adds the rest: without
    ordering the whole chain afterwards, the new tail would be younger than the root."""
    cache = make_cache(policy)
    prefix = list(range(4 * CHUNK))
    cache.store(prefix, kv_for(len(prefix)))
    settle(cache)
    prompt = prefix + list(range(500, 500 + 3 * CHUNK))
    out, n = cache.retrieve(prompt)
    assert n == len(prefix) and torch.equal(out[:, :, :n], kv_for(len(prefix)))
    assert cache.store(prompt, kv_for(len(prompt))) == 3 * CHUNK
    evict_checking_prefix(cache, prompt, unused_tail=3)
    cache.close()


@pytest.mark.parametrize("policy", ["lru", "arc-lfu"])
def test_a_restarted_disk_tier_still_evicts_a_prompt_from_its_end(tmp_path, policy):
    """The prompt's windows are written and read as separate batches, each stamped on its own; ``order_chain``
    stamps the chain again, so the order a restart rebuilds from the files' mtimes keeps it whole."""
    tier = DiskTierConfig(path=tmp_path, capacity_bytes=SLOTS * (CHUNK_BYTES + 320), policy=policy, fsync=False,
                          o_direct=False)
    config = CacheConfig(chunk_size=CHUNK, tiers=(tier,))
    prompt = list(range(6 * CHUNK))
    with KVCache(SPEC, "chain-order@1", config, tuning=TWO_CHUNK_WINDOWS) as cache:
        cache.store(prompt, kv_for(len(prompt)))
        settle(cache)
        assert cache.retrieve(prompt)[1] == len(prompt)  # three windows read in parallel, then re-stamped
    with KVCache(SPEC, "chain-order@1", config, tuning=TWO_CHUNK_WINDOWS) as cache:
        assert held(cache, prompt) == [True] * 6
        evict_checking_prefix(cache, prompt, unused_tail=6)
