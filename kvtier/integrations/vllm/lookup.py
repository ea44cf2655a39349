"""How the scheduler asks workers what kvtier holds: a tiny request/response protocol on a Unix socket.

vLLM runs its scheduler and its workers in different processes (on CPU always), and a worker's memory
tier lives in that worker. Each worker therefore serves lookups of its own KVCache on
``<socket_dir>/kvtier-<uid>/kvtier-<engine>-<rank>.sock``; the scheduler asks every TP rank and uses the
smallest answer.

Wire format (little-endian, no pickling): request ``u32 salt_len, u32 extras_len, u32 n_tokens, salt, extras,
u32 tokens`` (``extras``: the request's ExtraKeys encoding, kvtier.base.keys); response ``u64 cached_tokens``.
A request whose extras do not decode closes the connection. A lookup has no side effects on the cache. Any
failure (worker not up yet, socket gone) is a miss for that request, logged once per connection attempt.

The socket is only for this user's own vLLM processes, and the server treats whatever arrives on it as
untrusted all the same: the socket file is 0600 inside a 0700 folder owned by the user (a folder that is
anything else is refused, never used); a request may declare no more tokens than a real lookup can need
(``LookupLimits.max_tokens``), and its buffer grows only as its bytes arrive; a connection with no lookup
under way closes after ``idle_timeout_s``, a lookup must arrive whole within ``request_timeout_s`` of its
first byte, and at most ``max_connections`` are served at once (more are closed when accepted).
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.base.errors import ConfigError, InvalidArgument
from kvtier.base.keys import NO_EXTRAS, ExtraKeys, token_array
from kvtier.core.cache import KVCache
from kvtier.integrations.vllm.threads import name_os_thread

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<III")
_ANSWER = struct.Struct("<Q")
MAX_TOKENS = 1 << 24
MAX_SALT = 1 << 16
#: Longest extras encoding accepted: 64 bytes of span encoding per token covers one prompt-embeddings digest per
#: chunk of any size plus a multimodal span per position.
EXTRAS_PER_TOKEN = 64
_RECV_PIECE = 1 << 16  # a request's buffer grows by at most this much per read


@dataclass(frozen=True)
class LookupLimits:
    """What one worker's lookup server grants its clients (the scheduler keeps one connection per worker)."""

    max_tokens: int = MAX_TOKENS  #: longest lookup accepted; the worker passes vLLM's max_model_len
    max_connections: int = 8
    idle_timeout_s: float = 60.0  #: a connection with no lookup under way is closed after this
    request_timeout_s: float = 2.0  #: a lookup must arrive whole within this of its first byte


def socket_path(socket_dir: str, engine_id: str, rank: int) -> str:
    """Inside this user's private folder under ``socket_dir``; short enough for AF_UNIX (108 bytes) whatever
    the engine id looks like."""
    tag = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return os.path.join(socket_dir, f"kvtier-{os.getuid()}", f"kvtier-{tag}-{rank}.sock")


def private_folder(folder: str, create: bool) -> None:
    """Make sure ``folder`` is a real folder owned by this user and closed to everyone else (0700).

    ``socket_dir`` is often a shared /tmp, where another user could have planted the folder first (or a
    symlink in its place) to read lookups or answer them: such a folder raises ConfigError.
    """
    if create:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(f"{folder} is not a folder owned by this user: refusing it for kvtier's lookup socket")
    if stat.S_IMODE(info.st_mode) != 0o700:
        if not create:
            raise ConfigError(f"{folder} is open to other users: refusing it for kvtier's lookup socket")
        os.chmod(folder, 0o700)


def _recv_exact(conn: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes, read in bounded pieces (memory follows what arrived, not what was declared); by
    ``deadline`` (time.monotonic) if given, else within the socket's own timeout per read."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"lookup not received whole in time ({len(buf)} of {n} bytes)")
            conn.settimeout(left)
        piece = conn.recv(min(n - len(buf), _RECV_PIECE))
        if not piece:
            raise ConnectionError("peer closed the lookup socket")
        buf += piece
    return bytes(buf)


class LookupServer:
    """Answers lookups against ``cache`` on ``path``, one thread per connection, within ``limits``."""

    def __init__(self, cache: KVCache, path: str, limits: LookupLimits = LookupLimits()) -> None:
        self.cache, self.path, self.limits = cache, path, limits
        private_folder(os.path.dirname(path), create=True)
        if os.path.lexists(path):
            os.unlink(path)  # left over by a crashed engine with the same id
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)  # the folder is 0700 already, so no one else could connect in between
        self._sock.listen(8)
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._open: set[socket.socket] = set()  # guarded by _lock; shut down by close()
        self._lock = threading.Lock()
        self._refused = 0
        self._closed = False
        threading.Thread(target=self._accept, name="kvtier-lookup", daemon=True).start()

    def _accept(self) -> None:
        name_os_thread("kvtier-lookup")  # its connections' threads inherit the name
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(conn)
                continue
            with self._lock:
                self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn", daemon=True).start()

    def _refuse(self, conn: socket.socket) -> None:
        conn.close()
        self._refused += 1
        if self._refused & (self._refused - 1) == 0:  # 1st, 2nd, 4th, ...: a flood is logged, not echoed
            log.warning("kvtier lookup socket %s: %d connections refused, %d already open", self.path,
                        self._refused, self.limits.max_connections)

    def _serve(self, conn: socket.socket) -> None:
        try:
            while self._answer_one(conn):
                pass
        except (ConnectionError, TimeoutError) as exc:
            log.debug("kvtier lookup connection closed: %s", exc)
        except OSError as exc:
            log.warning("kvtier lookup connection failed: %s", exc)
        except Exception:  # a bug in one lookup: this connection ends (the client counts a miss), others go on
            log.exception("kvtier lookup failed")
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()
            self._slots.release()

    def _answer_one(self, conn: socket.socket) -> bool:
        """Read one lookup and answer it; False when the client closed the connection between lookups."""
        conn.settimeout(self.limits.idle_timeout_s)
        first = conn.recv(_HEAD.size)  # waits for the next lookup (TimeoutError when idle too long)
        if not first:
            return False
        deadline = time.monotonic() + self.limits.request_timeout_s
        head = first + _recv_exact(conn, _HEAD.size - len(first), deadline)
        salt_len, extras_len, n_tokens = _HEAD.unpack(head)
        if salt_len > MAX_SALT or n_tokens > self.limits.max_tokens or extras_len > 4 + EXTRAS_PER_TOKEN * n_tokens:
            raise ConnectionError(f"oversized lookup ({salt_len} salt bytes, {extras_len} extras bytes, "
                                  f"{n_tokens} tokens)")
        salt = _recv_exact(conn, salt_len, deadline)
        try:
            extras = ExtraKeys.decode(_recv_exact(conn, extras_len, deadline)) if extras_len else NO_EXTRAS
        except InvalidArgument as exc:
            raise ConnectionError(f"malformed lookup: {exc}") from None
        tokens = np.frombuffer(_recv_exact(conn, 4 * n_tokens, deadline), dtype="<u4")
        conn.settimeout(self.limits.request_timeout_s)
        conn.sendall(_ANSWER.pack(self.cache.lookup(tokens, salt=salt, extras=extras)))
        return True

    def close(self) -> None:
        """Stop accepting, end every open connection (their threads exit) and remove the socket file."""
        self._closed = True
        self._sock.close()
        with self._lock:
            for conn in self._open:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv; it closes the socket
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LookupClient:
    """The scheduler's side: one persistent connection per worker rank, reopened after failures."""

    def __init__(self, paths: Sequence[str], timeout_s: float = 5.0) -> None:
        self.paths = list(paths)
        self.timeout_s = timeout_s
        self._conns: list[socket.socket | None] = [None] * len(self.paths)

    def lookup(self, tokens: Sequence[int], salt: bytes = b"", extras: ExtraKeys = NO_EXTRAS) -> int:
        """Tokens every rank holds (a multiple of the chunk size); 0 when any rank cannot answer."""
        packed = extras.encode() if extras else b""
        payload = _HEAD.pack(len(salt), len(packed), len(tokens)) + salt + packed + token_array(tokens).tobytes()
        return min((self._ask(i, payload) for i in range(len(self.paths))), default=0)

    def _ask(self, i: int, payload: bytes) -> int:
        try:
            conn = self._connection(i)
            conn.sendall(payload)
            return _ANSWER.unpack(_recv_exact(conn, _ANSWER.size))[0]
        except (OSError, ConfigError) as exc:  # ConnectionError and timeouts included
            log.warning("kvtier lookup on %s failed (%s): treating as a miss", self.paths[i], exc)
            self._drop(i)
            return 0

    def _connection(self, i: int) -> socket.socket:
        conn = self._conns[i]
        if conn is not None and select.select([conn], [], [], 0)[0]:
            self._drop(i)  # readable between lookups: the worker closed it (idle timeout) or sent garbage
            conn = None
        if conn is None:
            private_folder(os.path.dirname(self.paths[i]), create=False)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.settimeout(self.timeout_s)
                conn.connect(self.paths[i])
            except OSError:
                conn.close()
                raise
            self._conns[i] = conn
        return conn

    def _drop(self, i: int) -> None:
        conn, self._conns[i] = self._conns[i], None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for i in range(len(self.paths)):
            self._drop(i)
