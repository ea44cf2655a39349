"""The vLLM connector's lookup socket under abuse (issue 17): a real LookupServer on a real Unix socket.

A neighbour process (or a bug) on the socket must not make the worker allocate what it never sent, hold
threads forever, or read and answer other users' lookups.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
import tracemalloc

import pytest

from kvtier import CacheConfig, KVCache
from kvtier.base.errors import ConfigError
from kvtier.integrations.vllm.lookup import LookupClient, LookupLimits, LookupServer, socket_path
from kvtier.integrations.vllm.paged import PagedKV, PagedSource
from tests.integrations.test_vllm_parts import cpu_layers

TOKENS = list(range(200))


@pytest.fixture
def cache() -> KVCache:
    paged = PagedKV(cpu_layers(), 32, rows_split=True)
    cache = KVCache(paged.spec, "m@1", CacheConfig(chunk_size=64))
    cache.store(TOKENS, PagedSource(paged, list(range(7))))
    yield cache
    cache.close()


def serve(cache: KVCache, folder, limits: LookupLimits | None = None) -> tuple[LookupServer, str]:
    path = socket_path(str(folder), "engine-id", 0)
    return (LookupServer(cache, path) if limits is None else LookupServer(cache, path, limits)), path


def rogue(path: str, data: bytes = b"") -> socket.socket:
    conn = socket.socket(socket.AF_UNIX)
    conn.settimeout(20)
    while True:
        try:
            conn.connect(path)
            break
        except BlockingIOError:  # the listen backlog is full until the server accepts: knock again
            time.sleep(0.01)
    try:
        conn.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused already: the server closed it at accept
    return conn


def closed_by_server(conn: socket.socket) -> bool:
    """True once the server has closed ``conn`` (it never answers a partial lookup)."""
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def lookup_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kvtier-lookup-conn")


def test_declared_sizes_cost_memory_only_as_bytes_arrive(cache, tmp_path):
    server, path = serve(cache, tmp_path)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        declared = [rogue(path, struct.pack("<II", 0, 1 << 22)) for _ in range(6)]  # 16 MiB each, never sent
        time.sleep(0.5)  # ample time for the server to have read every header
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    try:
        assert grown < 2 << 20, f"{grown} bytes held for lookups that sent nothing"
        client = LookupClient([path])
        assert client.lookup(TOKENS) == 192  # the worker still answers its scheduler
        client.close()
    finally:
        for conn in declared:
            conn.close()
        server.close()


def test_a_lookup_longer_than_any_request_is_refused_at_its_header(cache, tmp_path):
    server, path = serve(cache, tmp_path, LookupLimits(max_tokens=4096))
    try:
        conn = rogue(path, struct.pack("<II", 0, 1 << 24))
        assert closed_by_server(conn)
        conn.close()
        client = LookupClient([path])
        assert client.lookup(TOKENS) == 192
        client.close()
    finally:
        server.close()


def test_idle_and_slow_connections_time_out_but_the_scheduler_reconnects(cache, tmp_path):
    server, path = serve(cache, tmp_path, LookupLimits(idle_timeout_s=0.3, request_timeout_s=0.3))
    client = LookupClient([path])
    try:
        assert client.lookup(TOKENS) == 192
        idle, two_bytes = rogue(path), rogue(path, b"\x00\x00")
        dripping = rogue(path, struct.pack("<II", 0, 100))
        for _ in range(20):  # 400 bytes due, one every 0.05 s: it would take 20 s
            try:
                dripping.sendall(b"\x01")
            except OSError:
                break
            time.sleep(0.05)
        for conn in (idle, two_bytes, dripping):
            assert closed_by_server(conn)
            conn.close()
        assert wait_until(lambda: lookup_threads() == 0)  # the client's own connection idled out too
        assert client.lookup(TOKENS) == 192  # ... and it noticed, and reconnected, rather than missing
    finally:
        client.close()
        server.close()


def test_connections_beyond_the_limit_are_closed_at_once(cache, tmp_path):
    server, path = serve(cache, tmp_path)
    conns = [rogue(path, b"\x00\x00") for _ in range(100)]
    try:
        assert wait_until(lambda: lookup_threads() <= LookupLimits().max_connections and sum(
            1 for c in conns if _closed_now(c)) >= len(conns) - LookupLimits().max_connections)
    finally:
        for conn in conns:
            conn.close()
    client = LookupClient([path])
    try:
        assert wait_until(lambda: client.lookup(TOKENS) == 192)  # slots come back once the flood is gone
    finally:
        client.close()
        server.close()


def _closed_now(conn: socket.socket) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        conn.settimeout(20)


def test_the_socket_and_its_folder_are_private_to_the_user(cache, tmp_path):
    server, path = serve(cache, tmp_path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        folder = os.lstat(os.path.dirname(path))
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
    finally:
        server.close()
    planted = tmp_path / "planted"
    elsewhere = tmp_path / "open-to-all"
    elsewhere.mkdir(mode=0o777)
    planted.mkdir()
    os.symlink(elsewhere, planted / f"kvtier-{os.getuid()}")  # someone got to the folder's name first
    with pytest.raises(ConfigError, match="not a folder owned by this user"):
        serve(cache, planted)
    assert not any(elsewhere.iterdir())
    assert LookupClient([socket_path(str(planted), "engine-id", 0)], timeout_s=0.5).lookup(TOKENS) == 0


def test_closing_the_server_ends_its_open_connections(cache, tmp_path):
    server, path = serve(cache, tmp_path)
    idle, partial = rogue(path), rogue(path, struct.pack("<II", 0, 100) + b"\x01")
    gone = rogue(path)
    gone.close()  # a connection whose client already left
    assert wait_until(lambda: lookup_threads() == 2)
    server.close()
    assert closed_by_server(idle) and closed_by_server(partial)
    assert wait_until(lambda: lookup_threads() == 0)
    assert not os.path.exists(path)
    idle.close()
    partial.close()


def test_a_lookup_that_raises_is_a_miss_and_the_next_lookup_is_answered(cache, tmp_path, monkeypatch):
    """One lookup's work raising (injected into the cache's lookup): that connection ends, the scheduler's client
    counts a miss and reconnects, and the server answers the next lookup."""
    server, path = serve(cache, tmp_path)
    lookup, calls = cache.lookup, []

    def raises_once(tokens, salt=b""):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("injected: a bug in one lookup")
        return lookup(tokens, salt=salt)

    monkeypatch.setattr(cache, "lookup", raises_once)
    client = LookupClient([path])
    try:
        assert client.lookup(TOKENS) == 0
        assert client.lookup(TOKENS) == 192
    finally:
        client.close()
        server.close()
