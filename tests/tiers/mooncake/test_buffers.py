"""The transfer buffer's allocator alone (no pool): a batch that fits the arena waits for room until its deadline;
past it, or for a batch larger than the arena, it gets what fits now."""

from __future__ import annotations

import threading
from time import monotonic

from kvtier.tiers.mooncake.buffers import RegisteredBuffers
from harness.process import wait_for

ARENA = 4096
HANG_GUARD_S = 60.0  # far past every deadline below: only stops a broken take from hanging the suite


def buffers() -> RegisteredBuffers:
    return RegisteredBuffers(ARENA, lambda address, nbytes, owner, deadline: 0)  # registering always succeeds


def placed(lease) -> list[bool]:
    return [slot is not None for slot in lease.slots]


def test_a_batch_that_fits_the_arena_waits_for_other_leases_and_gets_every_slot():
    bufs = buffers()
    held = bufs.take([ARENA // 2, ARENA // 2], monotonic() + HANG_GUARD_S)
    assert placed(held) == [True, True]
    got = []
    waiter = threading.Thread(target=lambda: got.append(bufs.take([ARENA // 4] * 3, monotonic() + HANG_GUARD_S)))
    waiter.start()
    assert wait_for(lambda: bufs.waited == 1)
    assert not got  # still waiting: nothing was released
    held.release()
    waiter.join(HANG_GUARD_S)
    assert placed(got[0]) == [True, True, True]
    got[0].release()
    assert bufs.largest_free == ARENA


def test_past_its_deadline_a_waiting_batch_gets_what_fits_then():
    bufs = buffers()
    held = bufs.take([ARENA - 1024], monotonic() + HANG_GUARD_S)
    late = bufs.take([1024, 1024], monotonic() + 0.05)  # only one fits until the holder releases
    assert placed(late) == [True, False] and bufs.waited == 1
    late.release()
    held.release()
    assert bufs.largest_free == ARENA


def test_a_batch_larger_than_the_arena_never_waits():
    bufs = buffers()
    held = bufs.take([1024], monotonic() + HANG_GUARD_S)
    too_big = bufs.take([2048, ARENA], monotonic() + HANG_GUARD_S)  # could never fit whole
    assert placed(too_big) == [True, False] and bufs.waited == 0
    too_big.release()
    held.release()
    assert placed(bufs.take([ARENA + 64], monotonic() + HANG_GUARD_S)) == [False] and bufs.waited == 0
