"""Request bodies as untrusted bytes: a size cap enforced while reading; JSON decoding that never raises anything
but a 4xx is kvtier.api.json_body's ``decode_json`` (re-exported here), shared with the servers that run
without Starlette.

The cap is checked against ``Content-Length`` before a byte of the body is read, and again as chunks arrive
(a chunked upload declares no length), so an oversized body costs at most ``limit`` bytes of memory and is
answered with 413 without waiting for the rest of it.
"""

from __future__ import annotations

from starlette.requests import Request

from kvtier.api.errors import RequestError
from kvtier.api.json_body import decode_json

__all__ = ["DEFAULT_MAX_BODY_BYTES", "decode_json", "read_body"]

DEFAULT_MAX_BODY_BYTES = 8 << 20
_MAX_LENGTH_DIGITS = 18  # any longer Content-Length is past every cap (and int() of it may be refused)


def _too_large(limit: int) -> RequestError:
    return RequestError(f"the request body is larger than this server's limit of {limit} bytes", 413)


def _declared_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or not value.isascii():
        raise RequestError(f"Content-Length must be a number of bytes, got {value[:40]!r}")
    return int(value) if len(value) <= _MAX_LENGTH_DIGITS else 1 << 63


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or RequestError(413) as soon as it is known to exceed ``limit`` bytes.

    Never holds more than ``limit`` bytes of it; the unread rest is left to the server, which closes the
    connection after the response.
    """
    declared = _declared_length(request)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)

