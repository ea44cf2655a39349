"""A replica whose admin API answers like a broken or hostile server, for the router's admin fan-out: the test's
stand-in replica (tests/apps/route/test_hostile_admin.py) and the compromised replica of
benchmarks/_hostile_replica.py both answer ``POST /admin/v1/lookup`` with ``admin_lookup``.

    python -m harness.hostile_admin PORT

runs the test's replica: a real HTTP server (uvicorn) on a loopback port, ``/health`` 200, ``/kvtier/info`` 404 (a
plain OpenAI replica), ``POST /admin/v1/lookup`` as ``admin_lookup(1 GiB, echo_authorization=True)`` answers, and
``POST /v1/completions`` a small completion carrying the ``Authorization`` header's bytes (hex) as received.

``admin_lookup`` answers by the body's ``text``:

* ``huge``: 200 and ``huge_bytes`` of JSON-looking bytes, streamed without a length;
* ``drip``: 200 and one byte every 0.2 s, for ever;
* ``hang``: nothing at all, for ever (the head never comes);
* ``deep``: 200 and an array nested 100,000 deep; ``digits``: 200 and a 5,000-digit ``cached_tokens``;
* ``mistyped``: 200 and ``{"cached_tokens": "many"}``;
* anything else: 200 and a well-formed lookup answer (``GOOD_CACHED`` tokens cached), carrying the
  ``Authorization`` header's bytes (hex) as this replica received them if ``echo_authorization``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

GOOD_CACHED = 48
MIB = 1 << 20
_ANSWERS = {"deep": b"[" * 100_000 + b"]" * 100_000, "digits": b'{"cached_tokens": ' + b"7" * 5000 + b"}",
            "mistyped": b'{"cached_tokens": "many"}'}


async def _huge(size: int):
    yield b'{"pad": "'
    piece = b"x" * MIB
    for _ in range(size // MIB):
        yield piece


async def _drip():
    yield b'{"cached_tokens": 1, "pad": "'
    while True:
        await asyncio.sleep(0.2)
        yield b"x"


def admin_lookup(huge_bytes: int, echo_authorization: bool = False):
    """A Starlette endpoint for ``POST /admin/v1/lookup`` answering as the module docstring says."""

    async def lookup(request: Request) -> Response:
        text = json.loads(await request.body()).get("text")
        if text == "huge":
            return StreamingResponse(_huge(huge_bytes), media_type="application/json")
        if text == "drip":
            return StreamingResponse(_drip(), media_type="application/json")
        if text == "hang":
            await asyncio.sleep(3600)
        if text in _ANSWERS:
            return Response(_ANSWERS[text], media_type="application/json")
        answer = {"model": "stub", "prompt_tokens": 64, "cached_tokens": GOOD_CACHED, "tiers": {}}
        if echo_authorization:
            answer["authorization"] = dict(request.headers.raw).get(b"authorization", b"").hex()
        return JSONResponse(answer)

    return lookup


async def _complete(request: Request) -> Response:
    auth = dict(request.headers.raw).get(b"authorization", b"")
    return JSONResponse({"id": "cmpl-stub", "object": "text_completion", "authorization": auth.hex(),
                         "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def create_app() -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def info(request: Request) -> Response:
        return PlainTextResponse("not kvtier", status_code=404)

    return Starlette(routes=[Route("/health", health), Route("/kvtier/info", info),
                             Route("/admin/v1/lookup", admin_lookup(1 << 30, echo_authorization=True),
                                   methods=["POST"]),
                             Route("/v1/completions", _complete, methods=["POST"])])


if __name__ == "__main__":
    uvicorn.run(create_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
