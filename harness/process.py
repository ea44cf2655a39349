"""Small helpers the tests and benchmarks share: polling for a condition, timing a call, and freezing, resuming
or crashing a server process."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Self


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds passed (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return False


def timed(fn: Callable[..., object], *args: object, **kwargs: object) -> tuple[object, float]:
    """``fn(*args, **kwargs)`` and the seconds it took."""
    start = time.monotonic()
    result = fn(*args, **kwargs)
    return result, time.monotonic() - start


class ServerProcess:
    """Base of a test server whose process is ``self.proc`` (None when not running): subclasses start it in
    ``start`` (returning self) and clean up in ``stop``; ``with`` does both."""

    proc: subprocess.Popen[bytes] | None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pause(self) -> None:
        """Freeze the server (it accepts connections but never answers): a hung store."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """Crash it (SIGKILL), frozen or not."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None
