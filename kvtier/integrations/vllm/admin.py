"""The connector's per-rank HTTP server: the rank's cache metrics at ``/metrics`` and kvtier's admin API under
``/admin/v1`` (the same calls, bodies and answers as ``kvtier serve``: kvtier.api.admin_ops), on one port.

Started by the worker side of the connector when ``metrics_port`` is set (rank ``r`` on ``metrics_port + r``,
bound to ``metrics_host``), so ``kvtier cache --url http://host:port`` works against each rank.

* ``GET /metrics``: Prometheus text of the rank's cache, open as before (no key).
* ``GET /health``: ``{"status": "ok", "model": ...}`` (no key), or 503 with ``"status": "unhealthy"`` and
  ``dead_threads`` naming this process's long-lived kvtier threads that died (kvtier.base.threads: the
  connector's save and load threads among them), as ``kvtier serve``'s ``/health`` answers.
* ``/admin/v1/*``: the admin key only, from ``admin_key_file`` in the connector's config, else
  ``KVTIER_ADMIN_KEY`` in the worker's environment. vLLM's requests carry no kvtier tenant keys (their tenants
  are ``cache_salt`` values), so a tenant key is a 403 here. Without an admin key every admin call answers
  **403**, not 404: the routes exist (``GET /admin/v1/openapi.json`` still describes them) and a 403 tells the
  operator that the server needs a key configured, where a 404 would look like a kvtier without the API.
* A prompt is ``tokens`` (checked against the model's vocabulary and ``max_model_len``), ``text``, tokenized
  by the model's tokenizer, loaded in the worker on the first text call (a 400 when vLLM runs without one), or
  ``messages``, rendered by that tokenizer's own chat template and encoded without special tokens, as vLLM's
  chat route does by default (a server started with ``--chat-template`` renders with that one: give such a
  server tokens).

The standard library's request handlers on ``RankHTTPServer`` (kvtier.integrations.vllm.rank_http) on a daemon
thread: plain Prometheus text and JSON calls without an event loop in vLLM's worker process, with a bounded
number of threads and connections whatever clients do (idle ones are closed, not given a thread). Bodies are
at most ``MAX_BODY_BYTES`` with a ``Content-Length`` (else 413) and decoded as ``kvtier serve`` decodes them
(kvtier.api.admin.parse_body). Admin calls run tier I/O on a request's worker thread, never on vLLM's forward
pass; one that fails answers 500 naming only the error's type, and the server goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from kvtier.api.admin import MAX_BODY_BYTES, PREFIX
from kvtier.api.admin_ops import AdminOps, PromptFn
from kvtier.api.chat import ChatPrompt
from kvtier.api.errors import RequestError, error_body
from kvtier.base.metrics import CONTENT_TYPE
from kvtier.base.threads import WATCHED
from kvtier.core.cache import KVCache
from kvtier.integrations.vllm.rank_http import BoundedHandler, RankHTTPServer

log = logging.getLogger(__name__)


def token_prompt(vocab_size: int, max_tokens: int, tokenizer: Callable[[], Any] | None = None) -> PromptFn:
    """A prompt checker: token ids within ``[0, vocab_size)`` and at most ``max_tokens`` of them; text through
    ``tokenizer()``, chat messages through its chat template (called once, on the first such prompt; None or a
    failure: text and messages are a 400)."""
    loaded: list[Any] = []

    def tokenizer_for(param: str) -> Any:
        if not loaded:
            try:
                loaded.append(tokenizer() if tokenizer is not None else None)
            except Exception as exc:  # noqa: BLE001 - any loader failure means "no tokenizer"
                log.warning("kvtier admin: no tokenizer for text prompts: %s", exc)
                loaded.append(None)
        if loaded[0] is None:
            raise RequestError("this server has no tokenizer: give the prompt as tokens", param=param)
        return loaded[0]

    def prompt(value: str | list[int] | ChatPrompt) -> list[int]:
        if isinstance(value, ChatPrompt):
            ids = _render_chat(tokenizer_for("messages"), value)
        elif isinstance(value, str):
            ids = list(tokenizer_for("text").encode(value))
        else:
            ids = list(value)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
        if not ids:
            raise RequestError("the prompt has no tokens", param="text")
        if len(ids) > max_tokens:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than max_model_len {max_tokens}",
                               param="tokens")
        return ids

    return prompt


def _render_chat(tokenizer: Any, chat: ChatPrompt) -> list[int]:
    """Ids of ``chat`` as vLLM's chat route makes them by default: the tokenizer's template rendered to text,
    encoded without special tokens. A tokenizer without a template (or one that fails on these messages) is a
    400, not a 500: the caller can still give the prompt as tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template: give the prompt as tokens", param="messages")
    try:
        text = tokenizer.apply_chat_template(chat.messages, add_generation_prompt=chat.add_generation_prompt,
                                             tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as exc:  # noqa: BLE001 - a template is code of the model's: any failure is this prompt's
        raise RequestError(f"the chat template cannot render these messages: {exc}", param="messages") from None


class AdminServer:
    """``cache``'s metrics and admin API at ``http://host:port`` (port 0: any free port; ``self.port`` says which)
    from a daemon thread, until ``close``."""

    def __init__(self, cache: KVCache, port: int, host: str, *, name: str, prompt: PromptFn,
                 admin_key: str | None) -> None:
        self.ops = AdminOps(lambda: cache, name=name, prompt=prompt, admin_key=admin_key, tenant_keys=False)
        self._server = RankHTTPServer((host, port), _handler(cache, self.ops, name))
        self.port = self._server.port
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"kvtier-admin-{self.port}",
                                        daemon=True)
        self._thread.start()
        log.info("kvtier: metrics and admin API at http://%s:%d (admin key %s)", host, self.port,
                 "configured" if admin_key else "not configured: admin calls are refused")

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)


def health(name: str) -> tuple[int, dict[str, Any]]:
    """The rank's ``/health`` answer: 200 ok, or 503 naming the watched threads that died."""
    dead = WATCHED.dead()
    if not dead:
        return 200, {"status": "ok", "model": name}
    return 503, {"status": "unhealthy", "model": name, "dead_threads": dead}


def _handler(cache: KVCache, ops: AdminOps, name: str) -> type[BoundedHandler]:
    class Handler(BoundedHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.partition("?")[0]
            if path == "/metrics":
                self.reply(200, cache.metrics.render_prometheus().encode(), CONTENT_TYPE)
            elif path == "/health":
                self._json(*health(name))
            else:
                self._admin("GET", path, b"")

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("content-length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self._json(413, error_body(f"the body must be 0 to {MAX_BODY_BYTES} bytes with a Content-Length", 413))
                return
            self._admin("POST", self.path.partition("?")[0], self.rfile.read(length))

        def _admin(self, method: str, path: str, raw: bytes) -> None:
            if not path.startswith(PREFIX + "/"):
                self._json(404, error_body(f"no route {path}: /metrics, /health and {PREFIX}/*", 404))
                return
            try:
                status, answer = ops.handle(method, path, self.headers.get("authorization"), raw)
            except Exception as exc:  # noqa: BLE001 - a failed call answers 500; the server stays up
                log.exception("kvtier admin %s %s failed", method, path)
                status, answer = 500, error_body(f"the admin call failed ({type(exc).__name__})", 500)
            self._json(status, answer)

        def _json(self, status: int, answer: dict[str, Any]) -> None:
            self.reply(status, msgspec.json.encode(answer), "application/json")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: no line per scrape
            log.debug("kvtier admin: " + format, *args)

    return Handler
