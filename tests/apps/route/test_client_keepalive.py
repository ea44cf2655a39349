"""kvtier's HTTP clients drop an idle connection before a server closes it (CLIENT_KEEPALIVE_S): a request sent
on a connection the server is closing at that moment fails with no response. The server here keeps connections
open for ever and counts them; a client that reused an idle connection past CLIENT_KEEPALIVE_S would open one."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.apps.bench.runner import bench_client
from kvtier.apps.route.config import ProxyConfig
from kvtier.apps.route.replicas import Replica
from kvtier.web.http_limits import CLIENT_KEEPALIVE_S, HttpLimits

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


async def _connections_after_idle(make_client, idle_s: float) -> int:
    opened = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        opened += 1
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(RESPONSE)
            await writer.drain()

    async def handle(reader, writer):
        try:
            await serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = make_client(f"http://127.0.0.1:{port}")
    try:
        for _ in range(2):
            assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
            await asyncio.sleep(idle_s)
    finally:
        await client.aclose()
        server.close()
    return opened


def test_the_keepalive_is_below_every_server_we_talk_to():
    vllm_envs = pytest.importorskip("vllm.envs")
    assert CLIENT_KEEPALIVE_S < HttpLimits().keep_alive_s
    assert CLIENT_KEEPALIVE_S < vllm_envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE


@pytest.mark.parametrize("client", ["bench", "route"])
def test_an_idle_connection_is_not_reused_past_the_keepalive(client):
    make = {"bench": lambda url: bench_client(1, 10.0),
            "route": lambda url: Replica(url, ProxyConfig()).client}[client]
    assert asyncio.run(_connections_after_idle(make, 0.1)) == 1  # reused while fresh
    assert asyncio.run(_connections_after_idle(make, CLIENT_KEEPALIVE_S + 0.5)) == 2  # dropped once idle
