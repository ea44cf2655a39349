"""The admin API's shared parts (kvtier.api.admin: below the integrations, so the vLLM connector's metrics
server answers the same API)."""

from __future__ import annotations

from kvtier.api.admin import (
    ADMIN_KEY_ENV,
    MAX_TOKENS,
    PREFIX,
    ROUTES,
    Caller,
    ClearBody,
    LookupBody,
    PinBody,
    admin_key_from,
    authorize,
    check_scope,
    openapi,
    parse_body,
)

__all__ = ["ADMIN_KEY_ENV", "MAX_TOKENS", "PREFIX", "ROUTES", "Caller", "ClearBody", "LookupBody", "PinBody",
           "admin_key_from", "authorize", "check_scope", "openapi", "parse_body"]
