"""Free loopback ports, for the servers that tests and benchmarks start (kvtier serve, redis-server)."""

from __future__ import annotations

import socket


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, plus: int = 0) -> int:
    """A loopback port that is free now; with ``plus``, one whose ``port + plus`` is free too (Redis Cluster
    nodes also listen on their port + 10000). Another process may still take it before it is used."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not plus:
            return port
        if port + plus < 65536 and _bindable(port + plus):
            return port
    raise RuntimeError(f"no free port p with p + {plus} free too")
