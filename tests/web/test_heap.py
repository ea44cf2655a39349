"""kvtier.web.heap: which requests are followed by a trim, and that a burst costs one trim but no freed page is
left behind (a request that ends while a trim runs gets another after it)."""

from __future__ import annotations

import asyncio
import ctypes
import time

import pytest

from kvtier.web import heap
from kvtier.web.heap import LARGE_BODY_BYTES, HeapTrimmer, trim_heap

pytestmark = pytest.mark.skipif(heap._TRIM is None, reason="this libc has no malloc_trim (not glibc)")


def test_trim_heap_calls_glibc() -> None:
    buffers = [ctypes.create_string_buffer(1 << 20) for _ in range(32)]
    del buffers
    assert trim_heap() is True


def _count_trims(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.0) -> list[int]:
    """Replaces the trim with one that counts its calls and takes ``seconds``."""
    calls: list[int] = []

    def counted() -> bool:
        time.sleep(seconds)
        calls.append(1)
        return True

    monkeypatch.setattr(heap, "trim_heap", counted)
    return calls


def test_small_requests_are_not_followed_by_a_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_trims(monkeypatch)

    async def run() -> None:
        trimmer = HeapTrimmer(delay_s=0.01)
        trimmer.large_request_done(LARGE_BODY_BYTES - 1)
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert calls == []


def test_a_burst_costs_one_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_trims(monkeypatch)

    async def run() -> int:
        trimmer = HeapTrimmer(delay_s=0.05)
        trimmer.large_request_done(LARGE_BODY_BYTES)
        await asyncio.sleep(0.2)
        return trimmer.trims

    assert asyncio.run(run()) == 1 and len(calls) == 1


def test_requests_ending_before_a_trim_runs_share_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_trims(monkeypatch)

    async def run() -> int:
        trimmer = HeapTrimmer(delay_s=0.05)
        for _ in range(3):
            trimmer.large_request_done(LARGE_BODY_BYTES)
        await trimmer._pending
        return trimmer.trims

    assert asyncio.run(run()) == 1 and len(calls) == 1


def test_a_request_ending_while_a_trim_runs_gets_another_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_trims(monkeypatch, seconds=0.2)

    async def run() -> int:
        trimmer = HeapTrimmer(delay_s=0.01)
        trimmer.large_request_done(LARGE_BODY_BYTES)
        while not trimmer.trimming:
            await asyncio.sleep(0.005)
        trimmer.large_request_done(LARGE_BODY_BYTES)  # its pages may be past the running trim
        trimmer.large_request_done(LARGE_BODY_BYTES)
        await trimmer._pending
        return trimmer.trims

    assert asyncio.run(run()) == 2 and len(calls) == 2
