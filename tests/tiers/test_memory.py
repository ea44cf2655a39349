import gc
import os
import weakref

import pytest

from kvtier.tiers import MemoryTier, MemoryTierConfig
from tests.conformance.control_suite import ControlConformance
from tests.conformance.tier_suite import (
    EvictingTierConformance,
    EvictionListenerConformance,
    RemovalListenerConformance,
    tier_context,
)


def memory_tier(capacity_bytes: int, **config) -> MemoryTier:
    return MemoryTier(MemoryTierConfig(capacity_bytes=capacity_bytes, **config), tier_context("memory"))


class TestMemoryTierConformance(EvictingTierConformance, EvictionListenerConformance, RemovalListenerConformance,
                                ControlConformance):
    def make_tier(self, capacity_bytes: int) -> MemoryTier:
        return memory_tier(capacity_bytes)

    def make_controlled(self, capacity_bytes: int, clock, **config) -> MemoryTier:
        return MemoryTier(MemoryTierConfig(capacity_bytes=capacity_bytes, prefault=False, **config),
                          tier_context("memory", clock))


def test_views_point_into_one_preallocated_buffer():
    from tests.conformance.tier_suite import BytesPayload, blob, key

    tier = memory_tier(1 << 20)
    tier.put([(key(i), BytesPayload(blob(i, seal=False))) for i in range(3)])
    with tier.get([key(0), key(2)]) as (a, b):
        base = tier._buffer.data_ptr()
        for view in (a, b):
            addr = view.obj.__array_interface__["data"][0] if hasattr(view.obj, "__array_interface__") else None
            assert addr == base  # every view is a slice of the one buffer, not a fresh allocation


@pytest.mark.parametrize("capacity", [1 << 20, 5 << 20], ids=["plain-pages", "huge-pages"])
def test_close_gives_the_buffer_back_while_earlier_views_stay_valid(capacity):
    from tests.conformance.tier_suite import BytesPayload, blob, key

    tier = memory_tier(capacity)
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


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping in /proc/self/smaps that holds ``address``."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="needs Linux with THP")
@pytest.mark.parametrize("prefault", [True, False])
def test_a_host_buffer_of_2_mib_or_more_is_advised_huge_pages_unless_told_not_to(prefault):
    from tests.conformance.tier_suite import BytesPayload, blob, key

    huge = memory_tier(5 << 20, prefault=prefault)
    plain = memory_tier(5 << 20, prefault=prefault, huge_pages=False)
    small = memory_tier(1 << 20, prefault=prefault)
    assert "hg" in _vm_flags(huge._buffer.data_ptr())  # madvise(MADV_HUGEPAGE) on the slab's mapping
    # The others come from torch's allocator. Their pages may be advised by the process's own malloc (glibc
    # tunables, torch's THP_MEM_ALLOC_ENABLE: one run of the whole suite saw "hg" there), so what is checked
    # is that the tier made no mapping of its own for them.
    assert plain._slab._map is None and small._slab._map is None  # off, and smaller than one huge page
    assert huge.stats().capacity_bytes == plain.stats().capacity_bytes  # rounding the mapping up adds no room
    data = [blob(i, seal=False, shape=(2, 2, 64, 8, 64)) for i in range(40)]  # 20 MiB: evictions reuse slots
    for i, d in enumerate(data):
        huge.put([(key(i), BytesPayload(d))])
    stored = [i for i, hit in enumerate(huge.contains([key(i) for i in range(40)])) if hit]
    assert 0 < len(stored) < 40
    with huge.get([key(i) for i in stored]) as views:
        assert [bytes(v) for v in views] == [data[i] for i in stored]


def test_zero_capacity_tier_stores_nothing():
    from tests.conformance.tier_suite import BytesPayload, blob, key

    tier = memory_tier(0)
    assert tier.put([(key(1), BytesPayload(blob(1)))]) == [False]
    assert tier.contains([key(1)]) == [False]


@pytest.mark.parametrize("align", [256])
def test_allocator_coalesces(align):
    from kvtier.native.allocator import Allocator

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


class _FailingPayload:
    """A payload whose write fails, as a broken codec or source would."""

    nbytes = 4096

    def write_into(self, out: memoryview) -> None:
        raise RuntimeError("source gone")


def test_a_batch_whose_write_fails_frees_every_slot_it_reserved():
    from tests.conformance.tier_suite import BytesPayload, blob, key

    tier = memory_tier(1 << 20)
    tier.put([(key(0), BytesPayload(blob(0, seal=False)))])
    used = tier.stats().used_bytes
    with pytest.raises(RuntimeError, match="source gone"):
        tier.put([(key(1), BytesPayload(blob(1, seal=False))), (key(2), _FailingPayload())])
    assert tier.stats().used_bytes == used and tier.contains([key(0), key(1), key(2)]) == [True, False, False]


def test_a_batch_larger_than_the_tier_keeps_its_shallowest_chunks_as_one_by_one_puts_do():
    """Slots are reserved for a batch before anything is written; when the batch itself fills the tier, what
    it reserved so far is written and published, so its later (shallower) chunks can evict its deeper ones."""
    import torch

    from kvtier.codecs import get_codec
    from kvtier.codecs.blob import blob_bytes, encode_blob
    from tests.conformance.tier_suite import key

    chunks = [torch.full((1, 2, 4, 1, 1024), float(i), dtype=torch.bfloat16) for i in range(6)]
    raw = get_codec("raw")
    blobs = [encode_blob(key(i), torch.arange(4).numpy(), raw, c, seal=False) for i, c in enumerate(chunks)]
    batched, one_by_one = memory_tier(3 * 17 << 10), memory_tier(3 * 17 << 10)
    assert all(batched.put([(key(i), b) for i, b in enumerate(blobs)]))
    for i in reversed(range(6)):  # what put promises: deepest first
        one_by_one.put([(key(i), blobs[i])])
    keys = [key(i) for i in range(6)]
    assert batched.contains(keys) == one_by_one.contains(keys) == [True, True, True, False, False, False]
    with batched.get(keys[:3]) as views:
        assert [bytes(v) for v in views] == [bytes(blob_bytes(b)) for b in blobs[:3]]
