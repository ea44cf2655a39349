"""``kvtier route``'s admin API: each ``/admin/v1/...`` call fanned out to every replica, answers merged.

The routes and bodies are kvtier serve's (kvtier.api.admin): the router checks what it can without a replica (a
bearer key is present, the body is well formed: 401 / 400 / 413, forwarded nowhere; the body decoded as the
completion endpoints decode theirs) and forwards the caller's ``Authorization`` header (its bytes as sent, less
surrounding whitespace, which is no part of a header's value) and body unchanged, so each replica decides who
may do what with its own admin key. The answer::

    {"replicas": {"127.0.0.1:8001": {"status": 200, "body": {...}}, "127.0.0.1:8002": {"status": null,
                  "error": "ejected"}},
     "best": {"replica": "127.0.0.1:8001", "cached_tokens": 4096}}          # lookup only

Its status is the replicas' own when every replica that answered gave the same one (a tenant key's 403 is a
403 from the router too), else 200 when any answered 2xx, else 502. Replicas the health checks ejected are
not asked (listed with ``"error": "ejected"``); one that fails to answer is listed with its error.

Replicas' answers are untrusted like clients' bodies: each is read as it arrives up to ``MAX_ANSWER_BYTES``
(more is that replica's error, read no further), decoded by the same decoder (kvtier.api.json_body) off the
event loop, and a 2xx answer must be a JSON object (a lookup's with a whole ``cached_tokens``); anything else is
that replica's error in the merged answer, never the router's 500. The whole fan-out ends after
``ProxyConfig.admin_timeout_s``: a replica that hangs or drips its answer is listed as not answering in time.
Error entries name what went wrong, never an exception's message (httpx's quote the request's headers, so
the caller's key).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvtier.api.admin import MAX_BODY_BYTES, PREFIX, ROUTES, openapi, parse_body
from kvtier.api.errors import RequestError, error_body
from kvtier.api.json_body import decode_json
from kvtier.api.tenants import api_key
from kvtier.apps.route.proxy import sendable
from kvtier.apps.route.replicas import Replica
from kvtier.apps.route.service import Router
from kvtier.web.body import read_body

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 1 << 20  #: of one replica's answer to one admin call
_UNAUTHORIZED = "the admin API needs 'Authorization: Bearer <key>'"


def admin_routes(router: Router) -> list[Route]:
    """The admin routes for the router's app."""
    doc = openapi("kvtier route admin API (fanned out to every replica)")
    routes = [Route(PREFIX + path, _endpoint(router, path, body_type), methods=[method.upper()])
              for method, path, body_type, _, _ in ROUTES]

    async def describe(request: Request) -> Response:
        return JSONResponse(doc)

    routes.append(Route(PREFIX + "/openapi.json", describe, methods=["GET"]))
    return routes


def _endpoint(router: Router, path: str, body_type: type | None):
    async def endpoint(request: Request) -> Response:
        try:
            authorization = _authorization(request)
            body = b""
            if body_type is not None:
                body = await read_body(request, MAX_BODY_BYTES)
                await asyncio.to_thread(parse_body, body, body_type)  # a malformed body goes nowhere
        except RequestError as exc:
            return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)
        headers = [(b"authorization", authorization), (b"content-type", b"application/json"),
                   (b"accept-encoding", b"identity")]  # read as sent: no decompression to inflate past the cap
        answers = await _fan_out(router, request.method, PREFIX + path, body, headers, lookup=path == "/lookup")
        return _merge(router.replicas, answers, lookup=path == "/lookup")

    return endpoint


def _authorization(request: Request) -> bytes:
    """The caller's one ``Authorization`` header, its bytes less surrounding whitespace; RequestError 401 when
    there is none (or several), it is no bearer key, or it holds bytes no replica could be sent."""
    values = [v for k, v in request.headers.raw if k.lower() == b"authorization"]
    value = values[0].strip(b" \t") if len(values) == 1 else b""
    if not value or not sendable(value):
        raise RequestError(_UNAUTHORIZED, 401)
    if api_key(value.decode("latin-1")) is None:  # a malformed one raises its own 401
        raise RequestError(_UNAUTHORIZED, 401)
    return value


async def _fan_out(router: Router, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]], *,
                   lookup: bool) -> list[dict[str, Any]]:
    """Every replica's entry, in ``router.replicas``' order, within one deadline for all of them."""
    deadline = router.config.proxy.admin_timeout_s
    tasks = [asyncio.ensure_future(_ask(r, method, path, body, headers, lookup)) for r in router.replicas]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, timeout=deadline)
    finally:  # the deadline passed, or the caller went away: nothing is left waiting on a replica
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [task.result() if not task.cancelled() else {"status": None, "error": f"no answer within {deadline:g} s"}
            for task in tasks]


async def _ask(replica: Replica, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
               lookup: bool) -> dict[str, Any]:
    """One replica's entry: its status and decoded answer, or ``status`` None and what went wrong."""
    if not replica.up:
        return {"status": None, "error": "ejected"}
    try:
        request = replica.client.build_request(method, path, content=body or None, headers=headers)
        response = await replica.client.send(request, stream=True)
        try:
            raw = await _read_capped(response)
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        return {"status": None, "error": type(exc).__name__}  # never str(exc): it may quote our headers
    except Exception:
        log.exception("admin call to replica %s failed", replica.name)
        return {"status": None, "error": "the router failed this replica's call"}
    if raw is None:
        return {"status": None, "error": f"answered more than {MAX_ANSWER_BYTES} bytes"}
    return await asyncio.to_thread(_judge, response, raw, lookup)


async def _read_capped(response: httpx.Response) -> bytes | None:
    """The answer's bytes as sent, or None as soon as it is known to be longer than ``MAX_ANSWER_BYTES``."""
    if response.headers.get("content-encoding", "identity").lower() != "identity":
        return None  # asked for identity; a compressed answer could inflate past any cap
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and len(declared) < 19 and int(declared) > MAX_ANSWER_BYTES:
        return None
    chunks, size = [], 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _judge(response: httpx.Response, raw: bytes, lookup: bool) -> dict[str, Any]:
    """A replica's entry from its whole answer: an error entry for anything no kvtier replica answers."""
    status = response.status_code
    if not 200 <= status <= 599:
        return {"status": None, "error": f"answered HTTP status {status}"}
    try:
        parsed: Any = decode_json(raw)
    except RequestError:
        if status < 300:
            return {"status": None, "error": "answered something that is not JSON"}
        parsed = raw[:2000].decode("utf-8", "replace")  # an error page: shown as text
    if status < 300 and not isinstance(parsed, dict):
        return {"status": None, "error": "answered JSON that is not an object"}
    if status == 200 and lookup and not _whole(parsed.get("cached_tokens")):
        return {"status": None, "error": "answered a lookup without a whole number of cached_tokens"}
    return {"status": status, "body": parsed}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _merge(replicas: list[Replica], answers: list[dict[str, Any]], *, lookup: bool) -> Response:
    out: dict[str, Any] = {"replicas": {r.name: a for r, a in zip(replicas, answers)}}
    statuses = {a["status"] for a in answers if a["status"] is not None}
    if len(statuses) == 1:
        status = statuses.pop()
    elif any(200 <= s < 300 for s in statuses):
        status = 200
    else:
        status = 502
    if lookup:
        hits = [(a["body"]["cached_tokens"], r.name) for r, a in zip(replicas, answers) if a["status"] == 200]
        if hits:
            cached, name = max(hits)
            out["best"] = {"replica": name, "cached_tokens": cached}
    if status >= 400 and not any(a["status"] == status for a in answers):
        out.update(error_body("no replica answered", status))
    return JSONResponse(out, status_code=status)
