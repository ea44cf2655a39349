"""The memory tier with its buffer in a GPU's spare memory (``device: cuda:N``).

The conformance suite and the placement check need CUDA: without a GPU they are reported as skipped, with that
reason. What a machine without one can check runs everywhere: the device is validated, and asking for a GPU
where there is none is a clear ConfigError, not a crash on the first store.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import ConfigError
from kvtier.tiers import MemoryTier, MemoryTierConfig
from tests.conformance.tier_suite import (
    BytesPayload,
    EvictingTierConformance,
    EvictionListenerConformance,
    blob,
    key,
    tier_context,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine")


def gpu_tier(capacity_bytes: int) -> MemoryTier:
    return MemoryTier(MemoryTierConfig(capacity_bytes=capacity_bytes, device="cuda:0"), tier_context("memory"))


@needs_cuda
class TestGpuMemoryTierConformance(EvictingTierConformance, EvictionListenerConformance):
    def make_tier(self, capacity_bytes: int) -> MemoryTier:
        return gpu_tier(capacity_bytes)


@needs_cuda
def test_buffer_lives_in_gpu_memory():
    free_before = torch.cuda.mem_get_info(0)[0]
    tier = gpu_tier(256 << 20)
    assert tier._buffer.device == torch.device("cuda:0")
    assert free_before - torch.cuda.mem_get_info(0)[0] >= 256 << 20
    tier.put([(key(1), BytesPayload(blob(1, seal=False)))])
    with tier.get([key(1)]) as (view,):
        assert bytes(view) == blob(1, seal=False)  # read back through a host copy


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:x", "CPU"])
def test_bad_device_is_rejected(device):
    with pytest.raises(ConfigError):
        MemoryTierConfig(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_gpu_device_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="CUDA is not available"):
        gpu_tier(1 << 20)
