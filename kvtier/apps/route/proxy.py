"""Forward one request to one replica: retryable until the first byte reaches the client, streamed after.

The commit point. A replica's answer is held back until it carries something the client must see: for a
server-sent-event stream, the first event with text, a finish reason, usage, an error or ``[DONE]`` (a chat
stream's opening role-only event is held with it, so a replica that dies while the request waits in its
queue costs a retry on another replica, not the request); for any other answer, all of it (answers that are
not streams start at their status line: they pass through as they arrive too, never buffered whole). Until
then every failure (connection refused or reset, a timeout, a 5xx or 429, the replica's ejection by the
health checks while the request waits on it) is ``Retryable``; a 5xx or 429 answer is kept for the client
only if it is no larger than ``HOLD_LIMIT``. After it, bytes go to the client as they arrive; a replica that
breaks off mid-stream ends the stream with an error event (any other answer is broken off as well).

A client that disconnects cancels the upstream request: the caller cancels ``forward`` while holding, and the
streaming response's generator drops the upstream connection when the server stops it (a plain call, so it
happens even inside a cancelled scope). Requests go out over the replica's pooled aiohttp session
(kvtier.apps.route.upstream), never a client per request.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.responses import Response, StreamingResponse

from kvtier.apps.route.replicas import Replica, Retryable
from kvtier.apps.route.upstream import UpstreamAnswer, UpstreamError

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "content-encoding",
                        "accept-encoding"})
HOLD_LIMIT = 64 << 10  # a stream that sends this much without text is committed anyway; a larger error is dropped
TAIL_BYTES = 4096
_NOT_IN_A_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,18})')


@dataclass
class Hooks:
    """What the router learns while a request runs: ``first_text()`` at the commit point, ``finished(cached,
    ok)`` once at the end with the ``cached_tokens`` the replica reported (None if it reported none)."""

    first_text: Callable[[], None]
    finished: Callable[[int | None, bool], None]


def sendable(value: bytes) -> bool:
    """Whether a header value can be sent on (no control byte but HTAB; h11 refuses to send one, which the
    router would take for the replica's failure)."""
    return _NOT_IN_A_VALUE.search(value) is None


def upstream_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers for the replica, as the client's bytes (none re-encoded), less hop-by-hop ones and
    less whitespace around values (no part of a value, and h11 refuses to send it: a key with trailing spaces
    failed every replica in turn, and each failure counted towards its ejection). Values must be ``sendable``."""
    out = [(k, v.strip(b" \t")) for k, v in headers if k.decode("latin-1").lower() not in HOP_BY_HOP]
    out.append((b"accept-encoding", b"identity"))  # bytes pass through as they are; nothing to decode or re-encode
    return out


def _client_headers(upstream: UpstreamAnswer, replica: Replica) -> dict[str, str]:
    out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    out["x-kvtier-replica"] = replica.name
    return out


async def forward(replica: Replica, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                  hooks: Hooks) -> Response:
    """Send ``body`` to ``replica``; the response for the client, or Retryable (nothing was sent to it) when
    the replica fails, or is ejected, before the commit point."""
    upstream, chunks, held = await replica.unless_ejected(_until_commit(replica, path, body, headers))
    hooks.first_text()
    sse = _is_stream(upstream)
    scanner = UsageScanner() if sse else TailScanner() if upstream.status == 200 else None
    return StreamingResponse(_relay(upstream, chunks, held, hooks, replica.name, scanner, sse),
                             status_code=upstream.status, headers=_client_headers(upstream, replica))


def _is_stream(upstream: UpstreamAnswer) -> bool:
    return upstream.status == 200 and "text/event-stream" in upstream.headers.get("content-type", "")


async def _until_commit(replica: Replica, path: str, body: bytes,
                        headers: list[tuple[bytes, bytes]]) -> tuple[UpstreamAnswer, AsyncIterator[bytes], bytes]:
    """The replica's answer up to the commit point: the response, its remaining chunks and what was held."""
    try:
        upstream = await replica.upstream.send(path, body, headers)
    except UpstreamError as exc:
        raise Retryable(str(exc)) from None
    try:
        status = upstream.status
        chunks = upstream.chunks()
        if status >= 500 or status == 429:
            content = await _hold(chunks, lambda _: False)
            kept = len(content) <= HOLD_LIMIT
            answer = Response(content, status, _client_headers(upstream, replica)) if kept else None
            raise Retryable(f"status {status}", answer)
        held = await _hold(chunks, committing) if _is_stream(upstream) else b""
    except UpstreamError as exc:
        upstream.close(reuse=False)
        raise Retryable(f"{exc} before the first text") from None
    except BaseException:
        upstream.close(reuse=False)
        raise
    return upstream, chunks, held


async def _hold(chunks: AsyncIterator[bytes], enough: Callable[[bytes], bool]) -> bytes:
    """What arrives until ``enough`` of it, the end, or just over ``HOLD_LIMIT`` bytes (never more held)."""
    held = bytearray()
    async for chunk in chunks:
        held += chunk
        if len(held) > HOLD_LIMIT or enough(bytes(held)):
            break
    return bytes(held)


async def _relay(upstream: UpstreamAnswer, chunks: AsyncIterator[bytes], held: bytes, hooks: Hooks, name: str,
                 usage: UsageScanner | TailScanner | None, sse: bool) -> AsyncIterator[bytes]:
    """Every byte of the answer as it arrives. A replica that breaks off a stream ends it with an error event;
    one that breaks off any other answer breaks off the client's too (raised: the connection is aborted, so
    the client sees a truncated answer, not a complete-looking one)."""
    ok = False
    try:
        if held:
            _feed(usage, held)
            yield held
        async for chunk in chunks:
            _feed(usage, chunk)
            yield chunk
        ok = True
    except UpstreamError as exc:
        log.warning("replica %s broke off an answer: %s", name, exc)  # (the kind only: a message may quote headers)
        if not sse:
            raise
        error = {"error": {"message": f"the replica broke off the stream: {exc}",
                           "type": "server_error", "param": None, "code": 502}}
        yield f"data: {json.dumps(error)}\n\n".encode()
    finally:
        upstream.close(reuse=ok)  # a connection whose answer was not read whole is dropped: the replica stops
        hooks.finished(usage.cached_tokens if usage is not None else None, ok and upstream.status == 200)


def _feed(usage: UsageScanner | TailScanner | None, chunk: bytes) -> None:
    if usage is not None:
        usage.feed(chunk)


def _events(data: bytes) -> list[bytes]:
    """The complete server-sent events in ``data`` (the part after the last blank line is still arriving)."""
    return data.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]


def committing(data: bytes) -> bool:
    """Whether ``data`` holds an event the client must see (see the module docstring)."""
    for event in _events(data):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return True
            try:
                value = json.loads(payload)
            except ValueError:
                return True
            if not isinstance(value, dict) or "error" in value or value.get("usage"):
                return True
            if any(_carries_output(choice) for choice in value.get("choices") or ()):
                return True
    return False


def _carries_output(choice: object) -> bool:
    if not isinstance(choice, dict):
        return True
    if choice.get("text") or choice.get("finish_reason"):
        return True
    delta = choice.get("delta") or {}
    return not isinstance(delta, dict) or bool(delta.get("content")) or bool(set(delta) - {"role", "content"})


class UsageScanner:
    """Finds ``usage.prompt_tokens_details.cached_tokens`` in a stream as it passes, line by line."""

    def __init__(self) -> None:
        self._partial = b""
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if b'"usage"' in line and line.startswith(b"data:"):
                found = _cached_tokens(line[5:])
                if found is not None:
                    self.cached_tokens = found


class TailScanner:
    """Finds ``cached_tokens`` in a JSON answer as it passes, keeping only its last ``TAIL_BYTES`` (usage comes
    last in an OpenAI answer); the answer itself is never held."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        self._tail = (self._tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]

    @property
    def cached_tokens(self) -> int | None:
        found = _CACHED_TOKENS.findall(self._tail)
        return int(found[-1]) if found else None


def _cached_tokens(payload: bytes) -> int | None:
    try:
        usage = json.loads(payload).get("usage") or {}
        value = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None
