"""Request errors and OpenAI's error envelope, shared by ``kvtier serve`` and ``kvtier route``."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status (4xx) to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
