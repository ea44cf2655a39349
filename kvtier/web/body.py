"""Request bodies as untrusted bytes: a size cap enforced while reading, and JSON decoding that never raises
anything but a 4xx.

The cap is checked against ``Content-Length`` before a byte of the body is read, and again as chunks arrive
(a chunked upload declares no length), so an oversized body costs at most ``limit`` bytes of memory and is
answered with 413 without waiting for the rest of it.

Decoding uses pydantic-core's JSON parser (jiter), already a dependency through pydantic, rather than the
standard library's: it refuses what ``json.loads`` lets through or turns into a 500 — integers too long
for Python's int-string limit, nesting deeper than a few hundred levels (``json.loads`` hits the recursion
limit instead), lone UTF-16 surrogates such as ``"\\ud800"`` (which tokenizers cannot encode) and
``NaN``/``Infinity`` (not JSON) — each with a message saying where in the body the problem is.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json
from starlette.requests import Request

from kvtier.api.errors import RequestError

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


def decode_json(raw: bytes, partial: bool = False) -> Any:
    """The JSON value in ``raw``; RequestError (400) for anything that is not strict, well-formed JSON.

    ``partial``: ``raw`` may be cut short (a prefix of a document): what it holds is decoded as far as it goes,
    an unfinished string, number or literal at its end left out (an unfinished array or object is kept, with
    what it holds so far); the same strictness otherwise."""
    try:
        return from_json(raw, allow_inf_nan=False, allow_partial=partial)
    except ValueError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
