"""How the scheduler asks workers what kvtier holds: a tiny request/response protocol on a Unix socket.

vLLM runs its scheduler and its workers in different processes (on CPU always), and a worker's memory
tier lives in that worker. Each worker therefore serves lookups of its own KVCache on
``<socket_dir>/kvtier-<engine>-<rank>.sock``; the scheduler asks every TP rank and uses the smallest answer.

Wire format (little-endian, no pickling): request ``u32 salt_len, u32 n_tokens, salt, u32 tokens``;
response ``u64 cached_tokens``. A lookup has no side effects on the cache. Any failure (worker not up yet,
socket gone) is a miss for that request, logged once per connection attempt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Sequence

import numpy as np

from kvtier.cache import KVCache
from kvtier.keys import token_array

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")
_ANSWER = struct.Struct("<Q")
MAX_TOKENS = 1 << 24
MAX_SALT = 1 << 16


def socket_path(socket_dir: str, engine_id: str, rank: int) -> str:
    """Short enough for AF_UNIX (108 bytes) whatever the engine id looks like."""
    tag = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return os.path.join(socket_dir, f"kvtier-{tag}-{rank}.sock")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the lookup socket")
        got += k
    return bytes(buf)


class LookupServer:
    """Answers lookups against ``cache`` on ``path``, one thread per connection (the scheduler keeps one)."""

    def __init__(self, cache: KVCache, path: str) -> None:
        self.cache, self.path = cache, path
        if os.path.exists(path):
            os.unlink(path)  # left over by a crashed engine with the same id
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, name="kvtier-lookup", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    salt_len, n_tokens = _HEAD.unpack(_recv_exact(conn, _HEAD.size))
                    if salt_len > MAX_SALT or n_tokens > MAX_TOKENS:
                        raise ConnectionError(f"oversized lookup ({salt_len}, {n_tokens})")
                    salt = _recv_exact(conn, salt_len)
                    tokens = np.frombuffer(_recv_exact(conn, 4 * n_tokens), dtype="<u4")
                    conn.sendall(_ANSWER.pack(self.cache.lookup(tokens, salt=salt)))
            except ConnectionError:
                return
            except OSError as exc:
                log.warning("kvtier lookup connection failed: %s", exc)

    def close(self) -> None:
        self._closed = True
        self._sock.close()
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

    def lookup(self, tokens: Sequence[int], salt: bytes = b"") -> int:
        """Tokens every rank holds (a multiple of the chunk size); 0 when any rank cannot answer."""
        payload = _HEAD.pack(len(salt), len(tokens)) + salt + token_array(tokens).tobytes()
        return min((self._ask(i, payload) for i in range(len(self.paths))), default=0)

    def _ask(self, i: int, payload: bytes) -> int:
        try:
            conn = self._conns[i]
            if conn is None:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(self.timeout_s)
                conn.connect(self.paths[i])
                self._conns[i] = conn
            conn.sendall(payload)
            return _ANSWER.unpack(_recv_exact(conn, _ANSWER.size))[0]
        except OSError as exc:  # ConnectionError and timeouts included
            log.warning("kvtier lookup on %s failed (%s): treating as a miss", self.paths[i], exc)
            self._drop(i)
            return 0

    def _drop(self, i: int) -> None:
        conn, self._conns[i] = self._conns[i], None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for i in range(len(self.paths)):
            self._drop(i)
