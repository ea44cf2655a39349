"""free_port gives ports the kernel will not hand to an outgoing connection meanwhile."""

from __future__ import annotations

import socket

from kvtier.net.ports import _ephemeral_low, free_port


def test_ports_come_from_below_the_ephemeral_range_and_bind_on_every_interface():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # drawn at random, not one port again and again
    for port in ports:
        assert port < low  # bind(0) would draw from [low, high], as the kernel does for outgoing connections
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # noqa: S104 - what vLLM's event publisher binds


def test_plus_gives_a_pair_both_free():
    port = free_port(plus=10000)
    for p in (port, port + 10000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
