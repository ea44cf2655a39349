"""The admin API's calls over one cache's ``control`` (kvtier.core.control), for any server that answers it.

``AdminOps`` does everything but HTTP: who is calling (kvtier.api.admin.authorize), the body, the call on the
cache and its answer or a RequestError. ``kvtier serve`` (kvtier.apps.serve.admin, FastAPI) and the vLLM
connector's per-rank metrics server (kvtier.integrations.vllm.admin, the standard library's HTTP server) both
use it, so they answer the same calls the same way. What each call answers:

* ``lookup``: ``{"model", "prompt_tokens", "cached_tokens", "tiers": {tier: leading tokens that tier holds}}``
  for the caller's tenant (a tenant key) or the named one (admin; ``default`` without a name). It changes
  nothing: no eviction order, no admission sighting, no lookup metrics;
* ``pin`` / ``unpin``: ``{"tiers": {tier: tokens pinned | bytes released}}``;
* ``clear``: ``{"scope", "removed": {tier: entries removed, or null where the tier cannot}}``;
* ``stats``: per tier its usage (entries, bytes, capacity, pins, bytes per tenant), what it can do (``features``:
  pin, ttl, tenants, clear) and admission (policy, refusals by reason).

Every pin, unpin and clear is logged (logger ``kvtier.api.admin_ops``) with the caller and the outcome, besides
the library's own log of it. The calls block (they run tier I/O): an asyncio server runs them on a worker
thread. Errors are RequestErrors with a 4xx (kvtier.api.admin lists them) and change nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.api.admin import (
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
from kvtier.api.chat import ChatPrompt
from kvtier.api.errors import RequestError, error_body
from kvtier.base.errors import InvalidArgument, NotSupported, PinBudgetExceeded
from kvtier.core.metrics import ADMISSION_REFUSED
from kvtier.policy.admission import Refusal

if TYPE_CHECKING:
    from kvtier.core.cache import KVCache

log = logging.getLogger(__name__)

#: A prompt as a body gives it (text, token ids, or chat messages) -> its token ids, checked; RequestError
#: otherwise (a server that cannot render chat messages refuses a ChatPrompt with a 400).
PromptFn = Callable[[str | list[int] | ChatPrompt], list[int]]
_ROUTE = {path: (body, admin_only) for _, path, body, admin_only, _ in ROUTES}
_METHOD = {path: method.upper() for method, path, _, _, _ in ROUTES}


class AdminOps:
    """The admin calls on the cache ``cache_of()`` returns (None: the server runs without one, a 409).

    ``name`` is the model name the answers carry; ``prompt`` turns a body's prompt into token ids; ``admin_key``
    (None: no admin) guards the admin-only calls; with ``tenant_keys`` False only the admin key is accepted
    anywhere (a server whose requests do not carry kvtier's tenant keys, such as vLLM's). Thread-safe as far as
    the cache is."""

    def __init__(self, cache_of: Callable[[], KVCache | None], *, name: str, prompt: PromptFn,
                 admin_key: str | None, tenant_keys: bool = True) -> None:
        self._cache_of = cache_of
        self.name = name
        self._prompt_fn = prompt
        self.admin_key = admin_key
        self.tenant_keys = tenant_keys
        self.openapi = openapi()
        self._handlers: dict[str, Callable[[Caller, Any], dict[str, Any]]] = {
            "/lookup": self.lookup, "/pin": self.pin, "/unpin": self.unpin, "/clear": self.clear,
            "/stats": self.stats}

    # -- one HTTP call, whole ------------------------------------------------------------------------------
    def handle(self, method: str, path: str, authorization: str | None, raw: bytes) -> tuple[int, dict[str, Any]]:
        """One HTTP call to ``path`` (under PREFIX): (status, JSON answer). Unknown paths are a 404, a known path
        with another method a 405; ``openapi.json`` needs no key. Never raises a RequestError."""
        sub = path[len(PREFIX):] if path.startswith(PREFIX + "/") else None
        if sub == "/openapi.json" and method.upper() == "GET":
            return 200, self.openapi
        if sub not in _ROUTE:
            return 404, error_body(f"no admin route {path}; see {PREFIX}/openapi.json", 404)
        if method.upper() != _METHOD[sub]:
            return 405, error_body(f"{path} takes {_METHOD[sub]}", 405)
        try:
            caller = self.authorize(sub, authorization)
            return 200, self.run(sub, caller, raw)
        except RequestError as exc:
            return exc.status, error_body(str(exc), exc.status, exc.param)

    def authorize(self, route: str, authorization: str | None) -> Caller:
        """The caller of ``route`` (a path under PREFIX) by its Authorization header; RequestError 401 / 403. A
        server without tenant keys and without an admin key refuses everyone (403), whatever the header."""
        _, admin_only = _ROUTE[route]
        if not self.tenant_keys and self.admin_key is None:
            raise RequestError("this server has no admin key configured (admin_key_file or KVTIER_ADMIN_KEY)", 403)
        return authorize(authorization, self.admin_key, admin_only=admin_only or not self.tenant_keys)

    def run(self, route: str, caller: Caller, raw: bytes) -> dict[str, Any]:
        """The call on ``route`` by ``caller`` with the raw JSON body (ignored by a route without one)."""
        body_type, _ = _ROUTE[route]
        body = parse_body(raw, body_type) if body_type is not None else None
        return self._handlers[route](caller, body)

    # -- the calls -----------------------------------------------------------------------------------------
    @property
    def cache(self) -> KVCache:
        cache = self._cache_of()
        if cache is None:
            raise RequestError("this server runs without a cache", 409)
        return cache

    def lookup(self, caller: Caller, body: LookupBody) -> dict[str, Any]:
        cache = self.cache
        salt = self._salt(caller, body.tenant)
        ids = self._prompt(body)
        # locate, not KVCache.lookup: an operator's look is no request (no sighting for admission, no lookup
        # metrics); it counts the KV chunks held, not state snapshots of SSM layers.
        held = cache.chain.prefix(cache.locate(cache.keys(ids, salt=salt))) * cache.chunk_size
        return {"model": self.name, "prompt_tokens": len(ids), "cached_tokens": held,
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
        return {"model": self.name, "tiers": usage, "features": cache.control.features(), "admission": admission}

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
        """Token ids of the body's prompt, checked by the server's ``prompt``."""
        return self._prompt_fn(body.prompt())
