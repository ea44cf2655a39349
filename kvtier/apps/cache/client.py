"""One admin call over HTTP that a hostile or broken server cannot make ``kvtier cache`` wait on or fill up.

``call`` sends one request and reads its answer under one overall deadline (connecting, sending, the headers
and every byte of the body together: a server that drips or never ends its answer is cut off at the deadline,
not after each quiet gap) and a byte cap (``MAX_ANSWER_BYTES``: a declared larger answer is refused before its
body is read, an undeclared one when the cap is passed). The answer must be strict JSON (kvtier.web.body's
decoder: its depth limit turns a deeply nested document into an error, not a RecursionError) holding an object.
Anything else is a ``CallError`` whose message is one line, for the CLI to print as it is.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from kvtier.api.errors import RequestError
from kvtier.web.body import decode_json

MAX_ANSWER_BYTES = 16 << 20  #: an admin answer is a few KiB; a fan-out over many replicas, a few hundred
SHOWN_CHARS = 200  #: of a server's message, in the one line that reports it


class CallError(Exception):
    """The call failed; ``str()`` is one line that says how (no traceback, no body dump)."""


@dataclass(frozen=True)
class Answer:
    """A JSON object the server answered, with its HTTP status."""

    status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def call(method: str, url: str, body: dict[str, Any] | None, headers: dict[str, str], timeout_s: float,
         max_bytes: int = MAX_ANSWER_BYTES) -> Answer:
    """The server's answer to one call, read within ``timeout_s`` in all and ``max_bytes``; CallError otherwise
    (no answer in time, a transport failure, more bytes than the cap, an answer that is not a JSON object)."""
    try:
        return asyncio.run(asyncio.wait_for(_call(method, url, body, headers, max_bytes), timeout_s))
    except TimeoutError:
        raise CallError(f"{url}: no complete answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise CallError(one_line(f"{url}: {type(exc).__name__}: {exc}")) from None


async def _call(method: str, url: str, body: dict[str, Any] | None, headers: dict[str, str],
                max_bytes: int) -> Answer:
    # identity: a compressed answer would be inflated past the cap before it is counted
    headers = {**headers, "accept-encoding": "identity", "accept": "application/json"}
    async with httpx.AsyncClient(timeout=None, follow_redirects=False) as client:
        async with client.stream(method, url, json=body, headers=headers) as response:
            raw = await _read(response, max_bytes)
    return Answer(response.status_code, _decode(response, raw))


async def _read(response: httpx.Response, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise CallError(f"HTTP {response.status_code}: the answer has {int(declared):,} bytes, more than the "
                        f"{max_bytes:,} an admin answer may have")
    chunks, size = [], 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > max_bytes:
            raise CallError(f"HTTP {response.status_code}: the answer goes on past {max_bytes:,} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(response: httpx.Response, raw: bytes) -> dict[str, Any]:
    kind = response.headers.get("content-type", "no content type").split(";")[0].strip()
    try:
        value = decode_json(raw)
    except RequestError as exc:
        reason = str(exc).removeprefix("the request body is not valid JSON: ")
        raise CallError(one_line(f"HTTP {response.status_code}: the answer is not JSON ({kind}, {len(raw):,} "
                                 f"bytes): {reason}")) from None
    if not isinstance(value, dict):
        raise CallError(f"HTTP {response.status_code}: the answer is JSON but not an object "
                        f"({type(value).__name__})")
    return value


def one_line(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters (a server's message may be anything)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
