"""The tier contract's optional capabilities and the cache's argument errors."""

from __future__ import annotations

import pytest
import torch

from kvtier import CacheConfig, ConfigError, InvalidArgument, KVCache, KVSpec
from kvtier.base.keys import token_array
from kvtier.tiers import DiskTierConfig, EvictionReporter, Flushable, MemoryTier, MemoryTierConfig, WriteMode
from kvtier.tiers.control import Controlled, EvictionTags, Feature
from tests.conformance.tier_suite import tier_context
from tests.tiers.disk_helpers import disk_tier

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 16


def test_capabilities_are_named_protocols(tmp_path):
    memory = MemoryTier(MemoryTierConfig(capacity_bytes=1 << 20, prefault=False), tier_context("memory"))
    disk = disk_tier(tmp_path, 1 << 20)
    try:
        assert isinstance(memory, EvictionReporter) and not isinstance(memory, Flushable)
        assert isinstance(disk, Flushable) and not isinstance(disk, EvictionReporter)
        assert isinstance(memory, Controlled) and isinstance(disk, Controlled)
        assert memory.supports == disk.supports == frozenset(Feature)
        assert isinstance(memory, EvictionTags) and not isinstance(disk, EvictionTags)
    finally:
        memory.close()
        disk.close()


def test_write_back_needs_a_tier_above_that_reports_evictions(tmp_path):
    tiers = (DiskTierConfig(path=tmp_path), MemoryTierConfig(capacity_bytes=1 << 20, prefault=False,
                                                              write=WriteMode.BACK))
    with pytest.raises(ConfigError, match="reports no evictions"):
        KVCache(SPEC, "m@1", CacheConfig(chunk_size=CHUNK, tiers=tiers))


def test_configs_build_tiers_of_the_one_shape(tmp_path):
    tier = DiskTierConfig(path=tmp_path, capacity_bytes=1 << 20).build(tier_context("d"))
    try:
        assert tier.name == "d" and tier.stats().capacity_bytes == 1 << 20
    finally:
        tier.close()


def test_bad_arguments_raise_invalid_argument():
    cache = KVCache(SPEC, "m@1", CacheConfig(chunk_size=CHUNK, tiers=(MemoryTierConfig(capacity_bytes=1 << 20,
                                                                                        prefault=False),)))
    tokens = list(range(2 * CHUNK))
    kv = torch.randn(SPEC.chunk_shape(2 * CHUNK)).to(SPEC.dtype)
    with pytest.raises(InvalidArgument, match="does not cover"):
        cache.store(tokens, kv[:, :, :CHUNK])
    with pytest.raises(InvalidArgument, match="expected KV"):
        cache.store(tokens, kv.float())
    cache.store(tokens, kv)
    with pytest.raises(InvalidArgument, match="no room"):
        cache.retrieve(tokens, SPEC.empty(CHUNK))
    with pytest.raises(InvalidArgument):
        token_array([-1])
    assert issubclass(InvalidArgument, ConfigError)  # callers that caught ConfigError for these still do
    cache.close()
