"""Tenants: a caller's API key and its cache salt (kvtier.api.tenants: below the integrations)."""

from __future__ import annotations

from kvtier.api.tenants import api_key, tenant_salt

__all__ = ["api_key", "tenant_salt"]
