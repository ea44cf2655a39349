"""Fixtures that run real redis-server processes (see tests/redis_server.py)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from tests.redis_server import RedisCluster, RedisServer, have_redis_server


def _require_redis() -> None:
    missing = []
    if not have_redis_server():
        missing.append("redis-server (apt-get install redis-server, or scripts/setup.sh test)")
    if importlib.util.find_spec("redis") is None:
        missing.append("redis-py (pip install 'kvtier[redis]')")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the redis tests; missing: {', '.join(missing)}")
        pytest.skip(f"missing {', '.join(missing)}")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server shared by the tests that only read and write (they use distinct keys or flush)."""
    _require_redis()
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of the test's own, on a unix socket and a loopback port, free to be killed or frozen."""
    _require_redis()
    from kvtier.net.ports import free_port

    server = RedisServer(port=free_port())
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    _require_redis()
    with RedisCluster() as cluster:
        yield cluster
