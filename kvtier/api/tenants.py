"""Tenants: a caller's API key and the cache salt derived from it alone.

Shared by ``kvtier serve`` (which salts its cache with it) and ``kvtier route`` (which must hash the same
chunk keys to know where a tenant's prefixes are), so both read the header and derive the salt one way.
"""

from __future__ import annotations

import hashlib

from kvtier.api.errors import RequestError


def api_key(header: str | None) -> str | None:
    """The API key of ``Authorization: Bearer <key>`` (None without the header); a malformed one is a 401."""
    if header is None:
        return None
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise RequestError("the Authorization header must be 'Bearer <api key>'", 401)
    return key.strip()


def tenant_salt(api_key: str | None) -> bytes:
    """The cache salt of a caller: a digest of its API key (empty for callers without one).

    Derived from the Authorization header only, so one tenant can never name another's cache entries.
    """
    if not api_key:
        return b""
    return hashlib.sha256(b"kvtier-tenant\x00" + api_key.encode()).digest()
