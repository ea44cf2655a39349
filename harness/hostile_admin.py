"""A stand-in replica whose admin API answers like a broken or hostile server, for the router's fan-out tests.

    python -m tests.apps.route.hostile_admin_replica PORT

A real HTTP server (uvicorn) on a loopback port: ``/health`` 200, ``/kvtier/info`` 404 (a plain OpenAI
replica), and ``POST /admin/v1/lookup`` answering by the body's ``text``:

* ``huge``: 200 and 1 GiB of JSON-looking bytes, streamed without a length;
* ``drip``: 200 and one byte every 0.2 s, for ever;
* ``hang``: nothing at all, for ever (the head never comes);
* ``deep``: 200 and an array nested 100,000 deep; ``digits``: 200 and a 5,000-digit ``cached_tokens``;
* ``mistyped``: 200 and ``{"cached_tokens": "many"}``;
* anything else: 200 and a well-formed lookup answer carrying the ``Authorization`` header's bytes (hex) as
  this replica received them.

``POST /v1/completions`` answers a small completion carrying the ``Authorization`` bytes (hex) too.
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


async def _huge():
    chunk = b'{"pad": "' + b"x" * ((1 << 20) - 9)
    for _ in range(1024):
        yield chunk


async def _drip():
    yield b'{"cached_tokens": 1, "pad": "'
    while True:
        await asyncio.sleep(0.2)
        yield b"x"


async def lookup(request: Request) -> Response:
    text = json.loads(await request.body()).get("text")
    if text == "huge":
        return StreamingResponse(_huge(), media_type="application/json")
    if text == "drip":
        return StreamingResponse(_drip(), media_type="application/json")
    if text == "hang":
        await asyncio.sleep(3600)
    if text == "deep":
        return Response(b"[" * 100_000 + b"]" * 100_000, media_type="application/json")
    if text == "digits":
        return Response(b'{"cached_tokens": ' + b"7" * 5000 + b"}", media_type="application/json")
    if text == "mistyped":
        return JSONResponse({"cached_tokens": "many"})
    auth = dict(request.headers.raw).get(b"authorization", b"")
    return JSONResponse({"model": "stub", "prompt_tokens": 64, "cached_tokens": GOOD_CACHED, "tiers": {},
                         "authorization": auth.hex()})


async def complete(request: Request) -> Response:
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
                             Route("/admin/v1/lookup", lookup, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"])])


if __name__ == "__main__":
    uvicorn.run(create_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
