"""The forwarding client of one replica: one aiohttp session (a bounded keep-alive pool) for every request.

The router's generation requests go through here, not through httpx: aiohttp parses responses in C and its pool
costs a fraction of httpcore's per request, which under load was a tenth of the router's CPU. Bodies go out as
the client's bytes and answers come back as the replica's bytes (no decompression: ``accept-encoding`` is
``identity`` upstream, and anything else passes through untouched). Health checks, admin calls and
``/v1/models`` keep the replica's httpx client (kvtier.apps.route.replicas): they are rare and want its API.

aiohttp writes header values as UTF-8, so a request whose header bytes are not UTF-8 (rare, and legal: R-1 of
the hostile rounds) goes through the replica's httpx client instead, which sends bytes as they are.

``Upstream.send`` returns an ``UpstreamAnswer`` once the head has arrived; its ``chunks()`` are the body's bytes
as they arrive, and ``close(reuse)`` returns the connection to the pool (``reuse``: the body was read whole)
or drops it, which is how an abandoned request is cancelled on its replica. Every failure is an
``UpstreamError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import ClassVar

import aiohttp
import httpx
from multidict import CIMultiDict

from kvtier.web.http_limits import CLIENT_KEEPALIVE_S


class UpstreamError(Exception):
    """The replica could not be reached, timed out, or broke the connection; the message names the kind only
    (an exception's text may quote headers)."""


class UpstreamAnswer:
    """A replica's answer whose head has arrived: ``status``, ``headers`` and the body still to read."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(type(exc).__name__) from None

    def close(self, reuse: bool) -> None:
        if reuse:
            self._response.release()
        else:
            self._response.close()


class _HttpxAnswer(UpstreamAnswer):
    """The same over httpx (header bytes that are not UTF-8)."""

    _closing: ClassVar[set[asyncio.Task]] = set()  # close tasks, held until done (the loop keeps only weak references)

    def __init__(self, response: httpx.Response) -> None:
        self._httpx = response
        self.status = response.status_code
        self.headers = response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._httpx.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from None

    def close(self, reuse: bool) -> None:
        task = asyncio.ensure_future(self._httpx.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


class Upstream:
    """One replica's pool: at most ``max_connections`` connections, idle ones dropped after
    CLIENT_KEEPALIVE_S (before any server we talk to closes them), ``connect_timeout_s`` to connect and
    ``read_timeout_s`` between reads. The session is made on first use, inside the running loop."""

    def __init__(self, url: str, max_connections: int, connect_timeout_s: float, read_timeout_s: float,
                 fallback: httpx.AsyncClient) -> None:
        self.url = url.rstrip("/")
        self._fallback = fallback
        self._limits = (max_connections, connect_timeout_s, read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            limit, connect, read = self._limits
            connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=CLIENT_KEEPALIVE_S,
                                             enable_cleanup_closed=False)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None, connect=connect, sock_read=read))
        return self._session

    async def send(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamAnswer:
        """POST ``body`` to ``path`` with ``headers`` (raw bytes, sent as they are); the answer once its head
        arrived, or UpstreamError."""
        try:
            head = CIMultiDict((k.decode("ascii"), v.decode("utf-8")) for k, v in headers)
        except UnicodeDecodeError:
            return await self._send_bytes(path, body, headers)
        try:
            response = await self._client().post(self.url + path, data=body, headers=head, allow_redirects=False,
                                                 compress=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise UpstreamError(type(exc).__name__) from None
        return UpstreamAnswer(response)

    async def _send_bytes(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamAnswer:
        request = self._fallback.build_request("POST", path, content=body, headers=headers)
        try:
            return _HttpxAnswer(await self._fallback.send(request, stream=True))
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
