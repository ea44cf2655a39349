"""Request errors and OpenAI's error envelope (kvtier.api.errors: below the integrations, which answer them too)."""

from __future__ import annotations

from kvtier.api.errors import RequestError, error_body

__all__ = ["RequestError", "error_body"]
