"""``kvtier route``'s HTTP side (Starlette on uvicorn): the OpenAI routes, health and metrics.

* ``POST /v1/completions``, ``POST /v1/chat/completions``: routed (kvtier.apps.route.service). A body larger than
  ``max_body_bytes`` (a replica's 8 MiB by default) is a 413, read no further; a malformed one a 400, decided
  by kvtier serve's own decoder (kvtier.web.body) on a worker thread, never on the event loop; a malformed
  Authorization header a 401, a header value with a control character a 400 (none of them reaches a replica),
  a full queue a 429 with ``Retry-After``, no replica up a 503. A client that disconnects before the answer
  starts cancels the request on its replica. Headers reach the replica as the client's bytes, never
  re-encoded (less the whitespace around values, which is no part of them).
* Every answer is counted in ``kvtier_router_requests_total`` by endpoint and status, errors included: a bug
  is a counted 500 with OpenAI's error envelope, never an uncounted crash.
* ``GET /v1/models``: the first replica that is up answers. ``GET /health``: 200 while a replica is up (503
  otherwise), with each replica's state and load. ``GET /metrics``: Prometheus text.
* ``/admin/v1/...``: the admin API, fanned out to every replica and merged (kvtier.apps.route.admin).

Every answer from a replica carries ``x-kvtier-replica`` naming it, and a generation's answer
``x-kvtier-decision``: the number of the routing decision that placed it (1, 2, ...: the order in which this
router placed requests, which a client's send times do not always give; ``kvtier sim`` replays in it).
``server_config`` serves the app with the router's HTTP limits: heads too large or with too many headers are a
431, heads and bodies that do not arrive in time a 408, connections beyond the cap a 503, each counted
(``endpoint="http"``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvtier.api.errors import RequestError, error_body
from kvtier.apps.route.admin import admin_routes
from kvtier.apps.route.admission import Overloaded
from kvtier.apps.route.metrics import CANCELLED, REJECTED, REQUESTS
from kvtier.apps.route.proxy import sendable
from kvtier.apps.route.requests import parse_request
from kvtier.apps.route.service import Router
from kvtier.web.body import read_body
from kvtier.web.heap import HeapTrimmer
from kvtier.web.http_limits import guarded_protocol

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer (never sent to anyone)


def create_app(router: Router) -> Starlette:
    """The router's ASGI app; starting it starts the router (health checks, event subscriptions)."""
    heap = HeapTrimmer()  # large bodies are tokenized and forwarded on worker threads: their arenas keep the pages

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    async def completions(request: Request) -> Response:
        return await _generate(router, request, "/v1/completions", heap, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(router, request, "/v1/chat/completions", heap, chat=True)

    async def models(request: Request) -> Response:
        return await _models(router)

    async def health(request: Request) -> Response:
        replicas = [{"name": r.name, "url": r.url, "state": r.state.value, "in_flight": r.in_flight,
                     "prefill_tokens": r.prefill_tokens, "decode_streams": r.decode_streams,
                     "events": r.info is not None and r.info.events is not None} for r in router.replicas]
        up = any(r.up for r in router.replicas)
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas": replicas},
                            status_code=200 if up else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(router.metrics.render_prometheus(), media_type="text/plain; version=0.0.4")

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]), *admin_routes(router)]
    return Starlette(routes=routes, lifespan=lifespan)


def server_config(router: Router, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's configuration for the router's app, with the router's HTTP limits (kvtier.web.http_limits)
    enforced and every refusal counted like any other error answer."""
    limits = router.config.http

    def refused(status: int, reason: str) -> None:
        router.metrics.inc(REQUESTS, endpoint="http", status=str(status))
        router.metrics.inc(REJECTED, reason=reason)

    return uvicorn.Config(create_app(router), host=host, port=port, log_level=log_level,
                          access_log=log_level == "debug", http=guarded_protocol(limits, refused),
                          timeout_keep_alive=limits.keep_alive_s)


def _error(router: Router, endpoint: str, exc: RequestError, headers: dict[str, str] | None = None) -> Response:
    router.metrics.inc(REQUESTS, endpoint=endpoint, status=str(exc.status))
    return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status, headers=headers)


async def _generate(router: Router, request: Request, path: str, heap: HeapTrimmer, *, chat: bool) -> Response:
    endpoint = "chat" if chat else "completions"
    try:
        return await _serve(router, request, path, endpoint, chat)
    except ClientDisconnect:
        router.metrics.inc(CANCELLED)
        return Response(status_code=CLIENT_CLOSED)
    except Exception:  # a bug: still an answer in OpenAI's envelope, and counted
        log.exception("the router failed a request")
        return _error(router, endpoint, RequestError("the router failed the request", 500))
    finally:
        heap.large_request_done(getattr(request.state, "body_bytes", 0))


async def _serve(router: Router, request: Request, path: str, endpoint: str, chat: bool) -> Response:
    headers = {k.lower(): v for k, v in request.headers.items()}
    try:
        if not all(sendable(value) for _, value in request.headers.raw):
            raise RequestError("a header value holds a control character")
        body = await read_body(request, router.config.proxy.max_body_bytes)
        request.state.body_bytes = len(body)
        parsed = await asyncio.to_thread(parse_request, body, chat, headers)
    except RequestError as exc:
        router.metrics.inc(REJECTED, reason="malformed")
        return _error(router, endpoint, exc)
    work = asyncio.ensure_future(router.route(path, parsed, body, request.headers.raw))
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()  # before a streaming response starts listening for the disconnect itself
    await asyncio.gather(gone, return_exceptions=True)
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        router.metrics.inc(CANCELLED)
        return Response(status_code=CLIENT_CLOSED)
    try:
        response = work.result()
    except Overloaded as exc:
        router.metrics.inc(REJECTED, reason="queue_full")
        return _error(router, endpoint, RequestError(f"router overloaded: {exc}; retry later", 429),
                      headers={"Retry-After": str(router.config.admission.retry_after_s)})
    router.metrics.inc(REQUESTS, endpoint=endpoint, status=str(response.status_code))
    return response


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already, so only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _models(router: Router) -> Response:
    for replica in router.replicas:
        if not replica.up:
            continue
        try:
            answer = await replica.client.get("/v1/models", timeout=router.config.health.timeout_s)
        except httpx.HTTPError:
            continue
        if answer.status_code == 200:
            return Response(answer.content, 200, media_type="application/json",
                            headers={"x-kvtier-replica": replica.name})
    return JSONResponse(error_body("no replica is up", 503), status_code=503)
