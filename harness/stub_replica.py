"""A stand-in OpenAI replica for the router's hostile-input tests, run as its own process on a loopback port.

    python -m harness.stub_replica PORT [MODEL]

It speaks real HTTP (uvicorn) and answers like an OpenAI server without a model, so the router's tests start
in a second rather than loading one: ``/health`` 200, ``/kvtier/info`` 404 (a plain OpenAI replica: the router
keeps its own record), and the two generation routes answer a small non-streamed completion that echoes the
``x-echo`` header's raw bytes (hex) and names the port that served it. A prompt containing ``HOLD`` gets a
non-streamed 200 whose JSON body starts at once and ends only 60 s later: a router that buffers answers
whole passes none of it on meanwhile. ``/v1/models`` names MODEL when one is given (404 otherwise, as a server
that does not say what it serves).
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

HOLD_S = 60.0


def create_app(port: int, model: str | None = None) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def info(request: Request) -> Response:
        return PlainTextResponse("not kvtier", status_code=404)

    async def models(request: Request) -> Response:
        if model is None:
            return PlainTextResponse("no models here", status_code=404)
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "stub"}]})

    async def generate(request: Request) -> Response:
        body = await request.body()
        if b"HOLD" in body:
            return StreamingResponse(_held(), media_type="application/json")
        echo = dict(request.headers.raw).get(b"x-echo", b"")
        return JSONResponse({"id": "cmpl-stub", "object": "text_completion", "served_by": port,
                             "echo": echo.hex(), "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                                       "prompt_tokens_details": {"cached_tokens": 0}}})

    return Starlette(routes=[Route("/health", health), Route("/kvtier/info", info), Route("/v1/models", models),
                             Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


async def _held():
    yield b'{"id": "cmpl-held", "pad": "' + b"x" * 4096
    await asyncio.sleep(HOLD_S)
    yield b'", "choices": [], ' + json.dumps({"usage": {"prompt_tokens_details": {"cached_tokens": 0}}})[1:].encode()


if __name__ == "__main__":
    port = int(sys.argv[1])
    uvicorn.run(create_app(port, sys.argv[2] if len(sys.argv) > 2 else None), host="127.0.0.1", port=port,
                log_level="warning")
