"""``kvtier serve``'s admin API (``/admin/v1/...``) over its cache's ``control`` (kvtier.core.control).

Routes, bodies and who may call what: kvtier.api.admin (its ``ROUTES``; ``GET /admin/v1/openapi.json`` describes
them); what each call does and answers: kvtier.api.admin_ops, shared with the vLLM connector's metrics server.
This module only adapts FastAPI to it: the caller is checked before the body is read (at most
``MAX_BODY_BYTES`` bytes), and the cache work runs on a worker thread, never on the event loop. Errors are
OpenAI's envelope with a 4xx and change nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvtier.api.admin import MAX_BODY_BYTES, PREFIX, ROUTES
from kvtier.api.admin_ops import AdminOps
from kvtier.api.errors import RequestError, error_body
from kvtier.apps.serve.backend import Backend
from kvtier.web.body import read_body



def add_admin_routes(app: FastAPI, backend: Backend, admin_key: str | None) -> None:
    """Serve the admin API for ``backend``'s cache on ``app``, guarded by ``admin_key`` (None: no admin; tenant
    keys may still look up and clear their own entries)."""
    ops = AdminOps(lambda: backend.cache, name=backend.name, prompt=backend.admin_prompt, admin_key=admin_key)

    for method, path, body_type, _, summary in ROUTES:
        app.add_api_route(PREFIX + path, _endpoint(ops, path, body_type is not None), methods=[method.upper()],
                          summary=summary, include_in_schema=False)

    @app.get(PREFIX + "/openapi.json", include_in_schema=False)
    async def admin_openapi() -> dict[str, Any]:
        return ops.openapi


def _endpoint(ops: AdminOps, route: str, has_body: bool) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def endpoint(request: Request) -> JSONResponse:
        try:
            caller = ops.authorize(route, request.headers.get("authorization"))
            raw = await read_body(request, MAX_BODY_BYTES) if has_body else b""
            answer = await asyncio.to_thread(ops.run, route, caller, raw)
        except RequestError as exc:
            return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)
        return JSONResponse(answer)

    return endpoint
