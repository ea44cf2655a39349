"""Loads ahead of saves, for transfer turns and for room in the transfer buffer (no pool needed): a save queued
before a load still waits for it, and a save with nothing ahead of it is not held up."""

from __future__ import annotations

import threading
from time import monotonic

from kvtier.tiers.mooncake.buffers import RegisteredBuffers
from kvtier.tiers.mooncake.turns import Turns
from harness.process import wait_for

HANG_GUARD_S = 60.0  # far past every wait below: only stops a broken turn from hanging the suite


def _waiter(fn, order: list, name: str) -> threading.Thread:
    def run():
        if fn():
            order.append(name)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_load_takes_the_next_turn_before_a_save_that_queued_first():
    turns = Turns(1)
    assert turns.acquire(False, HANG_GUARD_S)  # a transfer under way
    order: list[str] = []
    save = _waiter(lambda: turns.acquire(False, HANG_GUARD_S), order, "save")
    load = _waiter(lambda: turns.acquire(True, HANG_GUARD_S), order, "load")
    assert wait_for(lambda: turns.loads_waiting == 1)
    turns.release()
    load.join(HANG_GUARD_S)
    assert order == ["load"]  # the save, waiting since before the load came, is still waiting
    turns.release()
    save.join(HANG_GUARD_S)
    assert order == ["load", "save"]


def test_saves_alone_take_free_turns_and_give_up_at_their_deadline():
    turns = Turns(2)
    assert turns.acquire(False, 0) and turns.acquire(False, 0)
    started = monotonic()
    assert not turns.acquire(False, 0.05) and monotonic() - started >= 0.05
    assert not turns.acquire(True, 0.05) and turns.loads_waiting == 0  # a load that gave up is not counted
    turns.release()
    assert turns.acquire(False, 0)  # nothing waits: a save takes the turn at once


def test_a_load_gets_buffer_room_before_a_save_that_asked_first():
    bufs = RegisteredBuffers(4096, lambda address, nbytes, owner, deadline: 0)
    held = bufs.take([4096], monotonic() + HANG_GUARD_S)
    got: dict[str, object] = {}
    order: list[str] = []

    def take(name: str, load: bool):
        got[name] = bufs.take([3072], monotonic() + HANG_GUARD_S, load=load)
        return True

    save = _waiter(lambda: take("save", False), order, "save")
    assert wait_for(lambda: bufs.waited == 1)
    load = _waiter(lambda: take("load", True), order, "load")
    assert wait_for(lambda: bufs.waited == 2)
    held.release()  # room for one of them
    load.join(HANG_GUARD_S)
    assert order == ["load"] and got["load"].slots[0] is not None
    got["load"].release()
    save.join(HANG_GUARD_S)
    assert order == ["load", "save"] and got["save"].slots[0] is not None
    got["save"].release()
    assert bufs.largest_free == 4096
