"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and the
admin API under /admin/v1 (kvtier.apps.serve.admin).

Every failure a client can cause is a 4xx with OpenAI's error envelope; a full queue is a 429 with
``Retry-After`` (answered at once, never by waiting). Responses carry ``usage.prompt_tokens_details.
cached_tokens``: the prompt tokens whose KV came from kvtier instead of being recomputed (as a prefix), and
``blended_tokens``: those that came from cached segments elsewhere in the prompt (``--blend``).

``server_config`` serves the app with the server's HTTP limits (``ServerConfig.http``): heads too large or with
too many headers are a 431, heads and bodies that do not arrive in time a 408, connections beyond the cap a 503,
each counted in ``kvtier_server_requests_total{endpoint="http"}`` and ``kvtier_server_rejected_total``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvtier.api.errors import RequestError, error_body
from kvtier.api.tenants import api_key
from kvtier.apps.serve.admin import add_admin_routes
from kvtier.apps.serve.backend import Backend, tenant_salt
from kvtier.apps.serve.engine import EngineDown, Event, EventKind, Job, Overloaded
from kvtier.apps.serve.metrics import (
    BLENDED_PROMPT_TOKENS,
    CACHED_PROMPT_TOKENS,
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REJECTED,
    REQUESTS,
    TTFT_SECONDS,
)
from kvtier.apps.serve.prompt_limits import refuse_too_many_messages
from kvtier.apps.serve.protocol import ChatRequest, CompletionRequest, parse
from kvtier.apps.serve.textstream import TextStream
from kvtier.base.metrics import CONTENT_TYPE
from kvtier.base.threads import WATCHED
from kvtier.integrations.sampling import SamplingParams
from kvtier.integrations.transformers import Span
from kvtier.web.body import decode_json, read_body
from kvtier.web.http_limits import guarded_protocol


@dataclass(frozen=True)
class Route:
    """What differs between the two generation endpoints."""

    endpoint: str
    chat: bool

    @property
    def obj(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


CHAT, COMPLETION = Route("chat", True), Route("completions", False)


def create_app(backend: Backend) -> FastAPI:
    """A FastAPI app serving ``backend``; the caller owns the backend and closes it."""
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None)
    app.state.backend = backend

    @app.get("/health")
    async def health() -> JSONResponse:
        """ok, or 503 naming the long-lived threads that died (kvtier.base.threads): requests they serve would
        never end, so a router or an orchestrator must see it."""
        dead = WATCHED.dead()
        body = {"status": "unhealthy" if dead else "ok", "model": backend.name, "in_flight": backend.engine.pending,
                "cache": backend.cache is not None}
        if dead:
            body["dead_threads"] = dead
        return JSONResponse(body, status_code=503 if dead else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": backend.name, "object": "model", "created": 0, "owned_by": "kvtier",
                "max_model_len": backend.context}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(backend.metrics.render_prometheus(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(backend, request, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(backend, request, CHAT)

    add_admin_routes(app, backend, backend.config.admin_key)
    return app


def server_config(app: FastAPI, backend: Backend, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's configuration for ``app`` (``create_app(backend)``, routes added since included), enforcing
    ``backend.config.http`` and counting every refusal like any other error answer."""
    limits = backend.config.http

    def refused(status: int, reason: str) -> None:
        backend.metrics.inc(REQUESTS, endpoint="http", status=str(status))
        backend.metrics.inc(REJECTED, reason=reason)

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                          http=guarded_protocol(limits, refused), timeout_keep_alive=limits.keep_alive_s)


def _error(backend: Backend, route: Route, exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    backend.metrics.inc(REQUESTS, endpoint=route.endpoint, status=str(exc.status))
    return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status, headers=headers)


async def _generate(backend: Backend, request: Request, route: Route):
    try:
        salt = tenant_salt(_api_key(request))
        raw = await read_body(request, backend.config.max_body_bytes)
        # Decoding, validation and tokenization cost CPU in proportion to the body: off the event loop, so
        # /health and other clients' streams go on meanwhile.
        prepared = await asyncio.to_thread(_prepare, backend, raw, route)
        job = Job(prepared.prompt_ids, prepared.max_tokens, salt, backend.stop_ids, asyncio.get_running_loop(),
                  prepared.sampling, segments=prepared.segments, ttl_s=prepared.request.cache_ttl_s)
        text = TextStream(backend.tokenizer, prepared.stops, skip_ids=backend.stop_ids)
        backend.engine.submit(job)  # last: a request is queued only once nothing about it can fail
    except RequestError as exc:
        return _error(backend, route, exc)
    except Overloaded as exc:
        backend.metrics.inc(REJECTED, reason="queue_full")
        return _error(backend, route, RequestError(f"server overloaded: {exc}; retry later", 429),
                      headers={"Retry-After": "1"})
    except EngineDown as exc:
        return _error(backend, route, RequestError(f"server unavailable: {exc}", 503))
    req = prepared.request
    rid = ("chatcmpl-" if route.chat else "cmpl-") + uuid.uuid4().hex
    if req.stream:
        body = _sse(backend, route, req, job, text, rid)
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        async for _ in _deltas(job, text):
            pass
    finally:
        job.cancelled.set()
    finish = job.finish
    if finish is None:
        return _error(backend, route, RequestError(job_error(job), 500))
    _account(backend, route, job, "200")
    choice = ({"index": 0, "message": {"role": "assistant", "content": text.text}, "finish_reason": finish}
              if route.chat else {"index": 0, "text": text.text, "finish_reason": finish, "logprobs": None})
    return {"id": rid, "object": route.obj, "created": int(time.time()), "model": backend.name,
            "choices": [choice], "usage": _usage(job)}


@dataclass(frozen=True)
class Prepared:
    """A request validated completely: what the engine and the text stream need, nothing left to check."""

    request: ChatRequest | CompletionRequest
    prompt_ids: list[int]
    max_tokens: int
    stops: list[str]
    sampling: SamplingParams
    segments: tuple[Span, ...]  #: token spans of reusable passages (used when the server blends)


def _prepare(backend: Backend, raw: bytes, route: Route) -> Prepared:
    """Everything that can refuse a request, cheapest first; runs on a worker thread."""
    if route.chat:
        refuse_too_many_messages(raw, backend.context)
    body = decode_json(raw)
    req = parse(ChatRequest if route.chat else CompletionRequest, body)
    if req.model is not None and req.model != backend.name:
        raise RequestError(f"model {req.model!r} is not served here; this server serves {backend.name!r}", 404,
                           param="model")
    if route.chat:
        prompt_ids, limit = backend.chat_prompt(req.template_messages()), req.limit()
    else:
        prompt_ids, limit = backend.completion_prompt(req.prompt_value()), req.max_tokens
    return Prepared(req, prompt_ids, backend.budget(prompt_ids, limit), req.stop_strings(), req.sampling(),
                    tuple(backend.segmenter.spans(req, prompt_ids)))


def _api_key(request: Request) -> str | None:
    return api_key(request.headers.get("authorization"))


async def _deltas(job: Job, text: TextStream) -> AsyncIterator[str]:
    """Text deltas of the job as they are released; afterwards ``job.finish`` is "stop", "length" or None
    (failed, with ``job.error`` saying why)."""
    while True:
        event: Event = await job.events.get()
        if event.kind is EventKind.ERROR:
            job.error = event.error
            return
        if event.kind is EventKind.DONE:
            job.finish = _finish_reason(job, text)
            tail = text.flush()
            if tail:
                yield tail
            return
        delta = text.push(event.token)
        if delta:
            yield delta
        if text.stopped:
            job.cancelled.set()  # the worker stops at its next token


def _finish_reason(job: Job, text: TextStream) -> str:
    if text.stopped or (job.stats.output_ids and job.stats.output_ids[-1] in job.stop_ids):
        return "stop"
    return "length"


def job_error(job: Job) -> str:
    return f"generation failed: {job.error or 'unknown error'}"


def _usage(job: Job) -> dict[str, Any]:
    stats = job.stats
    completion = len(stats.output_ids)
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": completion,
            "total_tokens": stats.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens, "blended_tokens": stats.blended_tokens}}


def _account(backend: Backend, route: Route, job: Job, status: str) -> None:
    m, stats = backend.metrics, job.stats
    m.inc(REQUESTS, endpoint=route.endpoint, status=status)
    m.inc(PROMPT_TOKENS, stats.prompt_tokens)
    m.inc(CACHED_PROMPT_TOKENS, stats.cached_tokens)
    m.inc(BLENDED_PROMPT_TOKENS, stats.blended_tokens)
    m.inc(GENERATION_TOKENS, len(stats.output_ids))
    m.observe(TTFT_SECONDS, stats.ttft_s)


async def _sse(backend: Backend, route: Route, req, job: Job, text: TextStream, rid: str) -> AsyncIterator[str]:
    """Server-sent events: a role chunk (chat), text deltas, a finish chunk, usage if asked, [DONE]."""
    created = int(time.time())

    def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> str:
        if route.chat:
            body: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": body, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        payload = {"id": rid, "object": route.obj + ".chunk" if route.chat else route.obj, "created": created,
                   "model": backend.name, "choices": [choice]}
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if route.chat:
            yield chunk(None, role=True)
        async for delta in _deltas(job, text):
            yield chunk(delta)
        if job.finish is None:
            backend.metrics.inc(REQUESTS, endpoint=route.endpoint, status="500")
            yield f"data: {json.dumps(error_body(job_error(job), 500))}\n\n"
        else:
            _account(backend, route, job, "200")
            yield chunk(None, finish=job.finish)
            if req.include_usage():
                usage = {"id": rid, "object": route.obj + ".chunk" if route.chat else route.obj,
                         "created": created, "model": backend.name, "choices": [], "usage": _usage(job)}
                yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()
