"""Free loopback ports, for the servers that tests and benchmarks start (kvtier serve, redis-server, vLLM).

Ports come from below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), not from it: a port the
kernel hands out for ``bind(0)`` is one it may hand out next to an outgoing connection as its local port, and a
server binding it a moment later (vLLM's event publisher binds ``tcp://*:PORT``) then failed with "Address
already in use" (a fresh-clone run lost a fleet test that way).
"""

from __future__ import annotations

import random
import socket

_FALLBACK_EPHEMERAL_LOW = 32768
_LOWEST = 10000
_RANDOM = random.SystemRandom()


def _bindable(port: int) -> bool:
    """Whether ``port`` can be bound now, on loopback and on every interface (servers bind either)."""
    for host in ("127.0.0.1", "0.0.0.0"):  # noqa: S104 - a probe, closed at once
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_port(*, plus: int = 0) -> int:
    """A port that is free now on loopback and every interface, below the ephemeral range where it can be; with
    ``plus``, one whose ``port + plus`` is free too (Redis Cluster nodes also listen on their port + 10000).
    Another process may still take it before it is used, but no outgoing connection is given it by the kernel."""
    high = min(_ephemeral_low(), 65536 - plus) - 1
    for _ in range(1000):
        if high > _LOWEST:
            port = _RANDOM.randint(_LOWEST, high)
        else:  # no room below the ephemeral range on this machine: let the kernel pick
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        if _bindable(port) and (not plus or (port + plus < 65536 and _bindable(port + plus))):
            return port
    raise RuntimeError(f"no free port p with p + {plus} free too")
