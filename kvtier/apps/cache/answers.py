"""Reading the admin API's answers: one server's (kvtier serve, a vLLM rank) or the router's fan-out.

A single server answers ``lookup`` with ``{"cached_tokens", "tiers", ...}`` and ``pin`` with ``{"tiers": {tier:
tokens pinned}}``; ``kvtier route`` answers ``{"replicas": {name: {"status", "body"}}, ...}`` with each
replica's answer as its body (kvtier.apps.route.admin). Errors are OpenAI's envelope (``{"error": {"message"}}``),
or whatever a broken server sends: these functions take any JSON object and never raise.
"""

from __future__ import annotations

from typing import Any

from kvtier.apps.cache.client import one_line


def matched(op: str, answer: dict[str, Any]) -> bool:
    """Whether a successful ``lookup`` or ``pin`` answer found any cached token (on any replica behind a
    router)."""
    replicas = answer.get("replicas")
    if isinstance(replicas, dict):
        return any(_matched_one(op, r.get("body")) for r in replicas.values()
                   if isinstance(r, dict) and r.get("status") == 200)
    return _matched_one(op, answer)


def _matched_one(op: str, body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    if op == "lookup":
        return _count(body.get("cached_tokens")) > 0
    tiers = body.get("tiers")
    return isinstance(tiers, dict) and any(_count(v) > 0 for v in tiers.values())


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def error_message(answer: dict[str, Any]) -> str:
    """One line saying why the server refused: its error message, or the first replica's behind a router."""
    message = _message(answer)
    replicas = answer.get("replicas")
    if message is None and isinstance(replicas, dict):
        for name, reply in replicas.items():
            if isinstance(reply, dict):
                message = _message(reply.get("body")) or reply.get("error")
            if isinstance(message, str):
                message = f"{name}: {message}"
                break
    return one_line(message) if isinstance(message, str) and message.strip() else "the server refused"


def _message(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) else None
