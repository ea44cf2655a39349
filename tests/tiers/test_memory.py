import pytest

from kvtier.tiers import MemoryTier, MemoryTierConfig
from tests.conformance.tier_suite import (
    EvictingTierConformance,
    EvictionListenerConformance,
    RemovalListenerConformance,
    tier_context,
)


def memory_tier(capacity_bytes: int) -> MemoryTier:
    return MemoryTier(MemoryTierConfig(capacity_bytes=capacity_bytes), tier_context("memory"))


class TestMemoryTierConformance(EvictingTierConformance, EvictionListenerConformance, RemovalListenerConformance):
    def make_tier(self, capacity_bytes: int) -> MemoryTier:
        return memory_tier(capacity_bytes)


def test_views_point_into_one_preallocated_buffer():
    from tests.conformance.tier_suite import BytesPayload, blob, key

    tier = memory_tier(1 << 20)
    tier.put([(key(i), BytesPayload(blob(i, seal=False))) for i in range(3)])
    with tier.get([key(0), key(2)]) as (a, b):
        base = tier._buffer.data_ptr()
        for view in (a, b):
            addr = view.obj.__array_interface__["data"][0] if hasattr(view.obj, "__array_interface__") else None
            assert addr == base  # every view is a slice of the one buffer, not a fresh allocation


def test_close_gives_the_buffer_back_while_earlier_views_stay_valid():
    import gc
    import weakref

    from tests.conformance.tier_suite import BytesPayload, blob, key

    tier = memory_tier(1 << 20)
    data = blob(1, seal=False)
    tier.put([(key(1), BytesPayload(data))])
    slab = weakref.ref(tier._slab)  # owns the buffer; readers' views hold the memory, not the slab
    with tier.get([key(1)]) as (view,):
        tier.close()
        gc.collect()
        assert slab() is None  # the tier let go of its buffer though the tier object lives on ...
        assert bytes(view) == data  # ... and a view handed out before close still reads its bytes
    assert tier.put([(key(2), BytesPayload(blob(2, seal=False)))]) == [False]
    with tier.get([key(1), key(2)]) as views:
        assert views == [None, None]


def test_zero_capacity_tier_stores_nothing():
    from tests.conformance.tier_suite import BytesPayload, blob, key

    tier = memory_tier(0)
    assert tier.put([(key(1), BytesPayload(blob(1)))]) == [False]
    assert tier.contains([key(1)]) == [False]


@pytest.mark.parametrize("align", [256])
def test_allocator_coalesces(align):
    from kvtier.tiers.allocator import Allocator

    a = Allocator(10 * align, align)
    offs = [a.alloc(align) for _ in range(10)]
    assert a.alloc(1) is None
    for off in offs[::2]:
        a.free(off, align)
    assert a.largest_free() == align
    for off in offs[1::2]:
        a.free(off, align)
    assert a.largest_free() == 10 * align and a.used == 0
    with pytest.raises(ValueError):
        a.free(0, align)
