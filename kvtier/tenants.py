"""Tenants: the cache salt of a caller, derived from its API key alone.

One function shared by ``kvtier serve`` (which salts its cache with it) and ``kvtier route`` (which must hash
the same chunk keys to know where a tenant's prefixes are).
"""

from __future__ import annotations

import hashlib


def tenant_salt(api_key: str | None) -> bytes:
    """The cache salt of a caller: a digest of its API key (empty for callers without one).

    Derived from the Authorization header only, so one tenant can never name another's cache entries.
    """
    if not api_key:
        return b""
    return hashlib.sha256(b"kvtier-tenant\x00" + api_key.encode()).digest()
