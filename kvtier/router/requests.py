"""What the router reads from a request before choosing a replica, and the 4xx it answers by itself.

The router forwards bodies untouched (a replica may accept fields the router never heard of), so it checks
only what it needs and what no replica could serve: a JSON object, ``messages`` (chat) or ``prompt``
(completions) of the right shapes, ``stream`` a boolean, ``user`` a string, ``max_tokens`` positive. Anything
else is the replica's business. The tenant salt comes from the ``Authorization`` header exactly as kvtier
serve derives it (``tenant_salt``), never from the body; the session from ``X-Session-ID`` or ``user``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.server.protocol import RequestError
from kvtier.tenants import api_key, tenant_salt

SESSION_HEADER = "x-session-id"


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    stream: bool = False
    user: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None


class _ChatBody(_Body):
    messages: Annotated[list[_Message], Field(min_length=1)]


class _CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]


@dataclass(frozen=True)
class Prompt:
    """The prompt of a request as the router tokenizes it: chat messages (role, text) or a completion's text
    or ids. ``messages`` None and ``text`` None and ``ids`` None: not tokenizable here (e.g. images)."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    ids: list[int] | None = None


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    prompt: Prompt
    stream: bool
    session: str | None
    salt: bytes


def parse_request(body: bytes, chat: bool, headers: dict[str, str]) -> ParsedRequest:
    """Check ``body`` and read what routing needs; RequestError (4xx) for what no replica could serve."""
    salt = tenant_salt(api_key(headers.get("authorization")))
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        parsed = (_ChatBody if chat else _CompletionBody).model_validate(value)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]]
        first = exc.errors()[0]["loc"]
        raise RequestError("invalid request: " + "; ".join(problems), param=str(first[0]) if first else None) from None
    prompt = _chat_prompt(parsed) if chat else _completion_prompt(parsed)
    session = headers.get(SESSION_HEADER) or parsed.user or None
    return ParsedRequest(chat, prompt, parsed.stream, session, salt)


def _chat_prompt(body: _ChatBody) -> Prompt:
    messages = []
    for message in body.messages:
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                return Prompt()  # images, audio ...: the replica knows how they tokenize, the router does not
            content = "".join(part["text"] for part in content)
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": content or ""})
    return Prompt(messages=messages)


def _completion_prompt(body: _CompletionBody) -> Prompt:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if any(t < 0 for t in prompt):
        raise RequestError("token ids must not be negative", param="prompt")
    return Prompt(ids=list(prompt))
