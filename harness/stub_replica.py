"""A stand-in OpenAI replica for the router's hostile-input tests, run as its own process on a loopback port.

    python -m harness.stub_replica PORT [MODEL] [--blocks N [--block-ms MS]]

It speaks real HTTP (uvicorn) and answers like an OpenAI server without a model, so the router's tests start
in a second rather than loading one: ``/health`` 200, ``/kvtier/info`` 404 (a plain OpenAI replica: the router
keeps its own record), and the two generation routes answer a small non-streamed completion that echoes the
``x-echo`` header's raw bytes (hex) and names the port that served it. A prompt containing ``HOLD`` gets a
non-streamed 200 whose JSON body starts at once and ends only 60 s later: a router that buffers answers
whole passes none of it on meanwhile. ``/v1/models`` names MODEL when one is given (404 otherwise, as a server
that does not say what it serves).

With ``--blocks N`` it keeps a bounded cache as a real replica would, and publishes nothing about it: a text
prompt is a run of blocks (sentences ending in ``.``, as harness.router_trace writes them); the replica holds
the block prefixes of the prompts it served, at most N, least recently used dropped first, and its answer's
``held_blocks`` says how many leading blocks of the prompt it held when the request arrived. With
``--block-ms MS`` too, the answer comes MS milliseconds per block it did not hold later (a prefill of what is not
cached), so requests overlap in proportion to what their replica must compute, as on a real one. ``POST
/stub/forget`` empties the cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

HOLD_S = 60.0


class PrefixCache:
    """The block prefixes a replica holds: at most ``capacity``, least recently used dropped first. The oracle of
    harness.router_trace keeps the same model of every replica."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[bytes, None] = OrderedDict()

    @staticmethod
    def keys(blocks: list[str]) -> list[bytes]:
        out, h = [], b""
        for block in blocks:
            h = hashlib.sha256(h + block.encode()).digest()
            out.append(h)
        return out

    def clear(self) -> None:
        self._held.clear()

    def held(self, keys: list[bytes]) -> int:
        """Leading keys held, without touching them."""
        n = 0
        while n < len(keys) and keys[n] in self._held:
            n += 1
        return n

    def serve(self, keys: list[bytes]) -> int:
        """Leading keys held on arrival; then every prefix of the prompt is held (most recent last)."""
        n = self.held(keys)
        for key in keys:
            self._held[key] = None
            self._held.move_to_end(key)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)
        return n


def prompt_blocks(prompt: str) -> list[str]:
    return [part.strip() for part in prompt.split(".") if part.strip()]


def create_app(port: int, model: str | None = None, blocks: int | None = None, block_ms: float = 0.0) -> Starlette:
    cache = PrefixCache(blocks) if blocks else None

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def forget(request: Request) -> Response:  # a replay starts from cold caches
        if cache is not None:
            cache.clear()
        return JSONResponse({"forgot": True})

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
        held = None
        if cache is not None:
            try:
                prompt = json.loads(body).get("prompt")
            except (ValueError, AttributeError):
                prompt = None
            if isinstance(prompt, str):
                keys = PrefixCache.keys(prompt_blocks(prompt))
                held = cache.serve(keys)
                if block_ms:
                    await asyncio.sleep(block_ms * (len(keys) - held) / 1e3)
        return JSONResponse({"id": "cmpl-stub", "object": "text_completion", "served_by": port, "held_blocks": held,
                             "echo": echo.hex(), "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                                       "prompt_tokens_details": {"cached_tokens": 0}}})

    return Starlette(routes=[Route("/health", health), Route("/kvtier/info", info), Route("/v1/models", models),
                             Route("/stub/forget", forget, methods=["POST"]),
                             Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


async def _held():
    yield b'{"id": "cmpl-held", "pad": "' + b"x" * 4096
    await asyncio.sleep(HOLD_S)
    yield b'", "choices": [], ' + json.dumps({"usage": {"prompt_tokens_details": {"cached_tokens": 0}}})[1:].encode()


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="a stand-in OpenAI replica (see the module docstring)")
    p.add_argument("port", type=int)
    p.add_argument("model", nargs="?")
    p.add_argument("--blocks", type=int, help="keep a bounded cache of this many block prefixes")
    p.add_argument("--block-ms", type=float, default=0.0, help="answer this much later per block not held")
    args = p.parse_args()
    uvicorn.run(create_app(args.port, args.model, args.blocks, args.block_ms), host="127.0.0.1", port=args.port,
                log_level="warning")
