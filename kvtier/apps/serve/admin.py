"""``kvtier serve``'s admin API (``/admin/v1/...``) over its cache's ``control`` (kvtier.core.control).

Routes, bodies and who may call what: kvtier.web.admin (its ``ROUTES``; ``GET /admin/v1/openapi.json`` describes
them). What each answers:

* ``lookup``: ``{"model", "prompt_tokens", "cached_tokens", "tiers": {tier: leading tokens that tier holds}}``
  for the caller's tenant (a tenant key) or the named one (admin; ``default`` without a name). It changes
  nothing: no eviction order, no admission sighting, no lookup metrics;
* ``pin`` / ``unpin``: ``{"tiers": {tier: tokens pinned | bytes released}}``;
* ``clear``: ``{"scope", "removed": {tier: entries removed, or null where the tier cannot}}``;
* ``stats``: per tier its usage (entries, bytes, capacity, pins, bytes per tenant), what it can do (``features``:
  pin, ttl, tenants, clear) and admission (policy, refusals by reason).

Every pin, unpin and clear is logged (logger ``kvtier.apps.serve.admin``) with the caller and the outcome, besides
the library's own log of it. Cache work runs on a worker thread, never on the event loop. Errors are OpenAI's
envelope with a 4xx (kvtier.web.admin lists them) and change nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvtier.apps.serve.backend import Backend
from kvtier.base.errors import InvalidArgument, NotSupported, PinBudgetExceeded
from kvtier.core.metrics import ADMISSION_REFUSED
from kvtier.policy.admission import Refusal
from kvtier.web.admin import (
    PREFIX,
    ROUTES,
    Caller,
    ClearBody,
    LookupBody,
    PinBody,
    authorize,
    check_scope,
    openapi,
    parse_body,
)
from kvtier.web.body import read_body
from kvtier.web.errors import RequestError, error_body

log = logging.getLogger(__name__)
MAX_ADMIN_BODY = 16 << 20


def add_admin_routes(app: FastAPI, backend: Backend, admin_key: str | None) -> None:
    """Serve the admin API for ``backend``'s cache on ``app``, guarded by ``admin_key`` (None: no admin)."""
    admin = _Admin(backend)
    handlers: dict[str, Callable[[Caller, Any], dict[str, Any]]] = {
        "/lookup": admin.lookup, "/pin": admin.pin, "/unpin": admin.unpin, "/clear": admin.clear,
        "/stats": admin.stats}
    doc = openapi()

    for method, path, body_type, admin_only, summary in ROUTES:
        endpoint = _endpoint(backend, admin_key, handlers[path], body_type, admin_only)
        app.add_api_route(PREFIX + path, endpoint, methods=[method.upper()], summary=summary,
                          include_in_schema=False)

    @app.get(PREFIX + "/openapi.json", include_in_schema=False)
    async def admin_openapi() -> dict[str, Any]:
        return doc


def _endpoint(backend: Backend, admin_key: str | None, handler: Callable[[Caller, Any], dict[str, Any]],
              body_type: type | None, admin_only: bool) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def endpoint(request: Request) -> JSONResponse:
        try:
            caller = authorize(request.headers.get("authorization"), admin_key, admin_only=admin_only)
            body = None
            if body_type is not None:
                body = parse_body(await read_body(request, MAX_ADMIN_BODY), body_type)
            answer = await asyncio.to_thread(handler, caller, body)
        except RequestError as exc:
            return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)
        return JSONResponse(answer)

    return endpoint


class _Admin:
    """The admin calls on one backend's cache; each runs on a worker thread."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def cache(self):
        if self.backend.cache is None:
            raise RequestError("this server runs without a cache (--no-cache)", 409)
        return self.backend.cache

    def lookup(self, caller: Caller, body: LookupBody) -> dict[str, Any]:
        cache = self.cache
        salt = self._salt(caller, body.tenant)
        ids = self._prompt(body)
        # locate, not KVCache.lookup: an operator's look is no request (no sighting for admission, no lookup
        # metrics); it counts the KV chunks held, not state snapshots of SSM layers.
        held = cache.chain.prefix(cache.locate(cache.keys(ids, salt=salt))) * cache.chunk_size
        return {"model": self.backend.name, "prompt_tokens": len(ids), "cached_tokens": held,
                "tiers": cache.control.lookup_tiers(ids, salt=salt)}

    def pin(self, caller: Caller, body: PinBody) -> dict[str, Any]:
        return self._pins("pin", caller, body)

    def unpin(self, caller: Caller, body: PinBody) -> dict[str, Any]:
        return self._pins("unpin", caller, body)

    def clear(self, caller: Caller, body: ClearBody) -> dict[str, Any]:
        cache = self.cache
        check_scope(caller, body.tenant, body.scope)
        if body.scope == "tenant":
            salt = self._salt(caller, body.tenant)
            removed = cache.control.clear(tenant=salt)
        elif body.tenant is not None:
            raise RequestError(f"scope {body.scope!r} takes no tenant", param="tenant")
        else:
            removed = cache.control.clear(all=body.scope == "all")
        who = body.tenant or ("default" if caller.admin else "own")
        log.info("admin clear %s%s by %s: removed %s", body.scope, f" ({who})" if body.scope == "tenant" else "",
                 caller.label, removed)
        return {"scope": body.scope, "removed": removed}

    def stats(self, caller: Caller, body: None) -> dict[str, Any]:
        cache = self.cache
        usage = {name: {**dataclasses.asdict(u), "tenant_bytes": dict(u.tenant_bytes)}
                 for name, u in cache.control.stats().items()}
        admission = {}
        for t, tier in enumerate(cache.tiers):
            settings = cache.config.tiers[t].admission_settings(first=t == 0)
            refused = {r.value: int(cache.metrics.get(ADMISSION_REFUSED, tier=tier.name, reason=r.value))
                       for r in Refusal}
            admission[tier.name] = {"policy": settings.policy, "max_bytes_per_s": settings.max_bytes_per_s,
                                    "refused": refused}
        return {"model": self.backend.name, "tiers": usage, "features": cache.control.features(),
                "admission": admission}

    # -- internals -----------------------------------------------------------------------------------------
    def _pins(self, op: str, caller: Caller, body: PinBody) -> dict[str, Any]:
        cache = self.cache
        salt = self._salt(caller, body.tenant)
        ids = self._prompt(body)
        call = cache.control.pin if op == "pin" else cache.control.unpin
        try:
            out = call(ids, salt=salt, tiers=body.tiers)
        except PinBudgetExceeded as exc:
            log.warning("admin %s by %s refused: %s", op, caller.label, exc)
            raise RequestError(str(exc), 409, param="tokens") from None
        except (NotSupported, InvalidArgument) as exc:
            raise RequestError(str(exc), param="tiers") from None
        log.info("admin %s of %d prompt tokens (tenant %s) by %s: %s", op, len(ids), body.tenant or "default",
                 caller.label, out)
        return {"tiers": out}

    def _salt(self, caller: Caller, tenant: str | None) -> bytes:
        """The cache salt the call acts on: the caller's own (tenant key), else the named tenant's (admin)."""
        check_scope(caller, tenant)
        if not caller.admin:
            return caller.salt
        if tenant is None or tenant == "default":
            return b""
        salts = self.cache.config.tenant_salts()
        if tenant not in salts:
            raise RequestError(f"unknown tenant {tenant!r}; configured: {sorted(salts) + ['default']}", 404,
                               param="tenant")
        return salts[tenant]

    def _prompt(self, body: LookupBody) -> list[int]:
        """Token ids of the body's prompt, checked as a completion prompt is."""
        prompt: str | list[int] = body.text if body.text is not None else list(body.tokens or [])
        return self.backend.completion_prompt(prompt)
