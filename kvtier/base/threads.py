"""Which of this process's long-lived threads have died: what a server's ``/health`` reports.

Every long-lived kvtier thread (a server's engine, an event publisher, a connector's save, load and lookup
threads) catches what one request's work raises, fails only that request and goes on. Should one die anyway (a
bug in its own loop), nothing else would notice: its requests would wait for ever while ``/health`` said ok. So
such a thread is ``watch``-ed from its start until its owner closes it (``unwatch`` first, so a deliberate stop is
not a death), and ``dead()`` names every watched thread that is no longer alive; a server answers ``/health`` with
503 and those names.

One watch list per process (``WATCHED``): a server's health covers every thread of the caches it runs, whichever
object started them. Threads are held weakly: a thread whose owner was dropped without ``close`` is forgotten
with it, never reported.
"""

from __future__ import annotations

import threading
import weakref


class ThreadWatch:
    """Thread-safe set of watched threads."""

    def __init__(self) -> None:
        self._threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._lock = threading.Lock()

    def watch(self, thread: threading.Thread) -> threading.Thread:
        """Watch ``thread`` (started or about to be) until ``unwatch``; returns it."""
        with self._lock:
            self._threads.add(thread)
        return thread

    def unwatch(self, thread: threading.Thread) -> None:
        """Stop watching ``thread`` (its owner is stopping it); a thread not watched is ignored."""
        with self._lock:
            self._threads.discard(thread)

    def dead(self) -> list[str]:
        """Names of the watched threads that were started and have ended, sorted."""
        with self._lock:
            threads = list(self._threads)
        return sorted(t.name for t in threads if t.ident is not None and not t.is_alive())


#: The process's watch list (see the module docstring).
WATCHED = ThreadWatch()
