"""Give the C heap back after large requests: glibc keeps what a request freed.

An 8 MB prompt is decoded, tokenized and forwarded on worker threads; glibc serves those threads from arenas of
their own and returns a freed arena's pages to the system only from its top, so after a few rounds of large
requests a process holds hundreds of MB it no longer uses (the router: +200 MB in five rounds of three 8 MB
prompts, still rising). ``malloc_trim(0)`` returns the free pages of every arena.

``HeapTrimmer.large_request_done()`` after a request whose body reached ``LARGE_BODY_BYTES``: one trim runs on a
worker thread ``DELAY_S`` later, however many large requests ended meanwhile (a burst costs one trim). A libc
without ``malloc_trim`` (musl, macOS) makes it a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

LARGE_BODY_BYTES = 1 << 20  #: a request body from this size on is followed by a trim
DELAY_S = 0.5  #: a trim waits this long after the large request that asked for it, so a burst costs one


def _load_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _load_trim()


def trim_heap() -> bool:
    """Return the C heap's free pages to the system now; whether this libc can (blocking: call off the loop)."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class HeapTrimmer:
    """At most one pending trim per event loop; ``trims`` counts those run. A large request that ends while a
    trim runs gets one more after it (that trim may have passed the pages it freed); one that ends while a trim
    waits to run is covered by it."""

    def __init__(self, delay_s: float = DELAY_S) -> None:
        self.delay_s = delay_s
        self.trims = 0
        self.trimming = False  #: a trim is running now (on a worker thread)
        self._pending: asyncio.Task[None] | None = None
        self._again = False

    def large_request_done(self, body_bytes: int) -> None:
        """Call on the event loop when a request ends; schedules a trim when its body was large."""
        if body_bytes < LARGE_BODY_BYTES or _TRIM is None:
            return
        if self._pending is not None and not self._pending.done():
            self._again = self._again or self.trimming
            return
        self._pending = asyncio.get_running_loop().create_task(self._trim_later())

    async def _trim_later(self) -> None:
        while True:
            await asyncio.sleep(self.delay_s)
            self.trimming = True
            try:
                await asyncio.to_thread(trim_heap)
                self.trims += 1
            except Exception:
                log.warning("malloc_trim failed", exc_info=True)
            finally:
                self.trimming = False
            if not self._again:
                return
            self._again = False
