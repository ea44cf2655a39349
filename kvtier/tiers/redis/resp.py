"""RESP2 over a plain (or TLS) socket, for the hot paths of the Redis tier.

client.py sets connections up (URL parsed by redis-py, TLS, AUTH, SELECT); the tier speaks RESP itself, because
redis-py's value path copies every value several times: hiredis packs a command into fresh bytes (after a
``bytes(memoryview)`` copy), and replies go socket -> read buffer -> hiredis buffer -> a fresh bytes object.
Here a large argument goes to ``sendall`` as the caller's memoryview (no copy) and a bulk reply is received
straight into a buffer the caller chose (``recv_into``, one copy from the kernel), with one deadline over
the whole exchange instead of a per-read socket timeout.

Nothing here imports redis-py. Errors are ``WireError`` (a TierError): the connection is then unusable.
Error *replies* (``-ERR ...``) are returned as ``RespError`` values, not raised, so one failed command does
not fail the rest of its pipeline.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from time import monotonic
from typing import Any

from kvtier.base.errors import TierError

CRLF = b"\r\n"
#: Arguments at least this long are sent as their own piece (zero copy) instead of being joined.
BIG_ARG = 16 * 1024
#: Bulk replies at least this long extend the read deadline by their transfer allowance.
BIG_REPLY = 64 * 1024
_MAX_LINE = 64 * 1024  # a status/error/length line longer than this is a protocol violation

Into = Callable[[int, "RespReader"], Any]
"""Receives a bulk reply: called with its length and the reader; must consume exactly that many bytes."""


class WireError(TierError):
    """The connection failed (closed, reset, timed out, spoke garbage); it must be discarded."""


class WireTimeout(WireError):
    """The call's deadline passed."""


class WireClosed(WireError):
    """The peer closed or reset the connection, or a socket call failed."""


class WireProtocolError(WireError):
    """The peer sent something that is not RESP2."""


class RespError:
    """An error reply. ``code`` is its first word (ERR, MOVED, OOM, LOADING, NOPERM, ...)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    @property
    def code(self) -> str:
        return self.message.split(" ", 1)[0]

    def __repr__(self) -> str:
        return f"RespError({self.message!r})"


class Packer:
    """Commands packed for one connection. Small pieces are joined; big arguments stay separate views."""

    __slots__ = ("_small", "count", "nbytes", "pieces")

    def __init__(self) -> None:
        self.pieces: list[bytes | bytearray | memoryview] = []
        self.count = 0  #: commands packed
        self.nbytes = 0  #: bytes of big arguments (what a put moves)
        self._small = bytearray()

    def add(self, *args: bytes | bytearray | memoryview | tuple[bytes | memoryview, ...]) -> None:
        """One command. An argument given as a tuple of pieces is sent as their concatenation, unjoined."""
        small = self._small
        small += b"*%d\r\n" % len(args)
        for arg in args:
            pieces = arg if isinstance(arg, tuple) else (arg,)
            small += b"$%d\r\n" % sum(_len(p) for p in pieces)
            for piece in pieces:
                n = _len(piece)
                if n >= BIG_ARG:
                    self.pieces.append(small)
                    self.pieces.append(piece)
                    self.nbytes += n
                    small = self._small = bytearray()
                else:
                    small += piece
            small += CRLF
        self.count += 1

    def add_packed(self, data: bytes, count: int) -> None:
        """``count`` small commands already in wire form (the fast path for many tiny commands)."""
        self._small += data
        self.count += count

    def finish(self) -> list[bytes | bytearray | memoryview]:
        if self._small:
            self.pieces.append(self._small)
            self._small = bytearray()
        return self.pieces


def _len(piece: bytes | bytearray | memoryview) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


def _settimeout(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - monotonic()
    if remaining <= 0:
        raise WireTimeout("deadline passed")
    sock.settimeout(remaining)


def send_all(sock: socket.socket, pieces: list[bytes | bytearray | memoryview], deadline: float) -> None:
    """Send every piece before ``deadline`` (Python's sendall timeout covers the whole call)."""
    try:
        for piece in pieces:
            _settimeout(sock, deadline)
            sock.sendall(piece)
    except TimeoutError as exc:  # socket.timeout is TimeoutError
        raise WireTimeout(f"send timed out: {exc}") from None
    except OSError as exc:
        raise WireClosed(f"send failed: {exc}") from None


class RespReader:
    """Buffered RESP2 reader over one socket; bulk strings can land directly in caller-owned memory.

    ``deadline`` (time.monotonic) bounds every receive; a bulk reply of ``n`` bytes extends it by
    ``n / rate`` seconds (the transfer allowance), so a large but steadily arriving reply is not cut off while
    a stalled one is.
    """

    __slots__ = ("buf", "deadline", "end", "rate", "received", "sock", "start", "view")

    def __init__(self, sock: socket.socket, size: int = 256 * 1024) -> None:
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.deadline = 0.0
        self.rate = 0.0  #: bytes per second of allowance for big replies; 0 = none
        self.received = False  #: whether any byte arrived since the last ``arm``

    def arm(self, deadline: float, rate: float) -> None:
        self.deadline, self.rate, self.received = deadline, rate, False

    @property
    def pending(self) -> int:
        """Bytes received but not consumed (nonzero between calls means the stream is out of step)."""
        return self.end - self.start

    # -- raw input -----------------------------------------------------------------------------------------
    def _recv_into(self, target: memoryview) -> int:
        sock = self.sock
        try:
            _settimeout(sock, self.deadline)
            n = sock.recv_into(target)
        except TimeoutError:
            raise WireTimeout("read timed out") from None
        except OSError as exc:
            raise WireClosed(f"read failed: {exc}") from None
        if n == 0:
            raise WireClosed("connection closed by the server")
        self.received = True
        return n

    def _fill(self) -> None:
        """Receive more bytes into the buffer (compacting it first when the tail is full)."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            if self.start == 0:
                raise WireProtocolError("reply line too long")
            self._compact()
        self.end += self._recv_into(self.view[self.end :])

    def _line(self) -> bytes:
        buf = self.buf
        while True:
            i = buf.find(CRLF, self.start, self.end)
            if i >= 0:
                line = bytes(self.view[self.start : i])
                self.start = i + 2
                return line
            if self.end - self.start > _MAX_LINE:
                raise WireProtocolError("reply line too long")
            self._fill()

    def _crlf(self) -> None:
        while self.end - self.start < 2:
            self._fill()
        if self.buf[self.start : self.start + 2] != CRLF:
            raise WireProtocolError("bulk reply not terminated by CRLF")
        self.start += 2

    # -- bulk payload helpers, for ``Into`` callbacks ------------------------------------------------------
    def peek(self, n: int) -> bytes:
        """The next ``n`` bytes (n <= 4 KiB), without consuming them."""
        while self.end - self.start < n:
            self._fill()
        return bytes(self.view[self.start : self.start + n])

    def read_into(self, target: memoryview) -> None:
        """Consume exactly ``target.nbytes`` bytes into ``target``: buffered bytes first, the rest straight
        from the socket."""
        n = target.nbytes
        have = min(self.end - self.start, n)
        if have:
            target[:have] = self.view[self.start : self.start + have]
            self.start += have
        done = have
        while done < n:
            if n - done < 4096:  # a small tail: go through the buffer so the next reply line comes with it
                self._fill()
                take = min(self.end - self.start, n - done)
                target[done : done + take] = self.view[self.start : self.start + take]
                self.start += take
                done += take
            else:
                done += self._recv_into(target[done:])

    def skip(self, n: int) -> None:
        """Consume and drop ``n`` bytes."""
        while n:
            if self.start == self.end:
                self._fill()
            take = min(self.end - self.start, n)
            self.start += take
            n -= take

    def read_bytes(self, n: int) -> bytes:
        if self.end - self.start >= n:
            out = bytes(self.view[self.start : self.start + n])
            self.start += n
            return out
        out_buf = bytearray(n)
        self.read_into(memoryview(out_buf))
        return bytes(out_buf)

    # -- replies -------------------------------------------------------------------------------------------
    def read_reply(self, into: Into | None = None) -> Any:
        """One reply: bytes (status or bulk, or what ``into`` returned for a bulk), int, None, list or
        RespError."""
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            n = self._int(line)
            if n < 0:
                return None
            if n >= BIG_REPLY and self.rate:
                self.deadline += n / self.rate
            value = into(n, self) if into is not None else self.read_bytes(n)
            self._crlf()
            return value
        if kind == b":":
            return self._int(line)
        if kind == b"+":
            return line[1:]
        if kind == b"-":
            return RespError(line[1:].decode("utf-8", "replace"))
        if kind == b"*":
            n = self._int(line)
            if n < 0:
                return None
            return [self.read_reply() for _ in range(n)]
        raise WireProtocolError(f"unexpected reply type {kind!r}")

    def read_ints(self, n: int) -> list[Any]:
        """``n`` replies expected to be ``:0`` / ``:1`` (EXISTS): parsed in bulk when they are, else one by one."""
        size = 4 * n
        while self.end - self.start < size:
            if self.end - self.start >= 4 and self.buf[self.start] != 58:  # not ':': parse generically
                break
            if size > len(self.buf) - self.start and self.start:
                self._compact()
            if size > len(self.buf):
                break
            self._fill()
        if self.end - self.start >= size:
            data = bytes(self.view[self.start : self.start + size])
            if data[0::4] == b":" * n and data[2::4] == b"\r" * n and data[3::4] == b"\n" * n:
                digits = data[1::4]
                if digits.strip(b"01") == b"":
                    self.start += size
                    return [d - 48 for d in digits]
        return [self.read_reply() for _ in range(n)]

    def _compact(self) -> None:
        n = self.end - self.start
        self.view[:n] = self.view[self.start : self.end]
        self.start, self.end = 0, n

    @staticmethod
    def _int(line: bytes) -> int:
        try:
            return int(line[1:])
        except ValueError:
            raise WireProtocolError(f"bad integer line {line[:32]!r}") from None
