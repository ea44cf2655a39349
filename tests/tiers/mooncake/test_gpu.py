"""A replica contributing spare GPU memory to the pool (``segment_device: cuda:N``).

Mooncake allocates a segment on the GPU only when built with VRAM segments (USE_VRAM_SEGMENT=ON, not in the
PyPI wheels as of 0.3.13): the tier checks that the device's free memory really dropped and otherwise refuses
with a ConfigError that says so, rather than quietly contributing host RAM. The CUDA tests are reported as
skipped on machines without a GPU; the check that asking for a GPU without CUDA is a ConfigError runs anywhere.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import ConfigError
from tests.tiers.mooncake.helpers import MiB, make_cache, prompt

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine")


@needs_cuda
def test_segment_in_gpu_memory_or_a_clear_refusal(own_master, record_property):
    """Which of the two happened, and what the free-memory check saw, go to the JUnit report."""
    free_before = torch.cuda.mem_get_info(0)[0]
    try:
        cache = make_cache(own_master, segment_bytes=64 * MiB, segment_device="cuda:0")
    except ConfigError as exc:
        record_property("outcome", f"refused: {exc}")
        assert "USE_VRAM_SEGMENT" in str(exc)
        assert own_master.metrics()["master_total_capacity_bytes"] == 0  # nothing was left in the pool
        return
    with cache:
        taken = free_before - torch.cuda.mem_get_info(0)[0]
        record_property("outcome", f"segment on the GPU: free GPU memory fell by {taken >> 20} MiB")
        assert taken >= 64 * MiB
        tokens, kv = prompt(4)
        assert cache.store(tokens, kv) == len(tokens)
        out, n = cache.retrieve(tokens)
        assert n == len(tokens) and torch.equal(out, kv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_gpu_segment_without_cuda_is_a_config_error(mooncake_master):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        make_cache(mooncake_master, segment_device="cuda:0")
