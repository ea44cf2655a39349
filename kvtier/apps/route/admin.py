"""``kvtier route``'s admin API: each ``/admin/v1/...`` call fanned out to every replica, answers merged.

The routes and bodies are kvtier serve's (kvtier.api.admin): the router checks what it can without a replica (a
bearer key is present, the body is well formed: 401 / 400, forwarded nowhere) and forwards the caller's
``Authorization`` header and body unchanged, so each replica decides who may do what with its own admin key.
The answer::

    {"replicas": {"127.0.0.1:8001": {"status": 200, "body": {...}}, "127.0.0.1:8002": {"status": null,
                  "error": "ejected"}},
     "best": {"replica": "127.0.0.1:8001", "cached_tokens": 4096}}          # lookup only

Its status is the replicas' own when every replica that answered gave the same one (a tenant key's 403 is a
403 from the router too), else 200 when any answered 2xx, else 502. Replicas the health checks ejected are
not asked (listed with ``"error": "ejected"``); one that fails to answer is listed with its error.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvtier.api.admin import PREFIX, ROUTES, openapi, parse_body
from kvtier.api.errors import RequestError, error_body
from kvtier.api.tenants import api_key
from kvtier.apps.route.replicas import Replica
from kvtier.apps.route.service import Router
from kvtier.web.body import read_body

MAX_ADMIN_BODY = 16 << 20
TIMEOUT_S = 120.0  #: a clear of a large disk or shared store may take a while


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
            header = request.headers.get("authorization")
            if api_key(header) is None:
                raise RequestError("the admin API needs 'Authorization: Bearer <key>'", 401)
            body = b""
            if body_type is not None:
                body = await read_body(request, MAX_ADMIN_BODY)
                await asyncio.to_thread(parse_body, body, body_type)  # a malformed body goes nowhere
        except RequestError as exc:
            return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)
        headers = {"authorization": header or "", "content-type": "application/json"}
        method = request.method
        answers = await asyncio.gather(*(_ask(r, method, PREFIX + path, body, headers) for r in router.replicas))
        return _merge(router.replicas, answers, lookup=path == "/lookup")

    return endpoint


async def _ask(replica: Replica, method: str, path: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    if not replica.up:
        return {"status": None, "error": "ejected"}
    try:
        answer = await replica.client.request(method, path, content=body or None, headers=headers,
                                              timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    try:
        parsed: Any = answer.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = answer.text[:2000]
    return {"status": answer.status_code, "body": parsed}


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
        hits = [(a["body"].get("cached_tokens", 0), r.name) for r, a in zip(replicas, answers)
                if a["status"] == 200 and isinstance(a.get("body"), dict)]
        if hits:
            cached, name = max(hits)
            out["best"] = {"replica": name, "cached_tokens": cached}
    if status >= 400 and not any(a["status"] == status for a in answers):
        out.update(error_body("no replica answered", status))
    return JSONResponse(out, status_code=status)
