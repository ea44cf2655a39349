"""What the router reads from a request before choosing a replica, and the 4xx it answers by itself.

The bytes are decoded by kvtier serve's own JSON decoder (``kvtier.web.body.decode_json``), so whatever a
replica refuses as malformed JSON (lone surrogates, integers of thousands of digits, nesting thousands deep,
NaN) the router refuses the same way, with the same 400, before it costs a replica anything. The router
forwards bodies untouched (a replica may accept fields the router never heard of), so beyond that it checks
only what it needs and what no replica could serve: a JSON object, ``messages`` (chat) or ``prompt``
(completions) of the right shapes, token ids in ``[0, 2**32)`` (what a chunk key encodes), ``stream`` a
boolean, ``user`` a string, ``max_tokens`` positive. Anything else is the replica's business.

The tenant salt comes from the ``Authorization`` header exactly as kvtier serve derives it (``tenant_salt``),
never from the body. The session comes from ``X-Session-ID`` or ``user``; one longer than
``MAX_SESSION_ID_BYTES`` is a 400, and what the router keeps is a digest of the tenant's salt and the id, so a
session is remembered per tenant, in the same few bytes however long its id.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.web.body import decode_json
from kvtier.web.errors import RequestError
from kvtier.web.tenants import api_key, tenant_salt

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_BYTES = 256  #: a conversation or user id; longer ones are refused, not kept
TOKEN_ID_LIMIT = 1 << 32  #: chunk keys encode token ids as 32-bit integers


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
    #: the sticky session's key: a digest of the tenant's salt and the session id (None: no session)
    session: str | None
    salt: bytes


def parse_request(body: bytes, chat: bool, headers: dict[str, str]) -> ParsedRequest:
    """Check ``body`` and read what routing needs; RequestError (4xx) for what no replica could serve.

    Costs CPU in proportion to the body: callers run it off the event loop."""
    salt = tenant_salt(api_key(headers.get("authorization")))
    value = decode_json(body)
    if not isinstance(value, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        parsed = (_ChatBody if chat else _CompletionBody).model_validate(value)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]]
        first = exc.errors()[0]["loc"]
        raise RequestError("invalid request: " + "; ".join(problems), param=str(first[0]) if first else None) from None
    prompt = _chat_prompt(parsed) if chat else _completion_prompt(parsed)
    header = headers.get(SESSION_HEADER)
    session = _session_key(salt, header, SESSION_HEADER) if header else _session_key(salt, parsed.user, "user")
    return ParsedRequest(chat, prompt, parsed.stream, session, salt)


def _session_key(salt: bytes, session: str | None, param: str) -> str | None:
    if not session:
        return None
    raw = session.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_SESSION_ID_BYTES:
        raise RequestError(f"a session id ({param}) must not be longer than {MAX_SESSION_ID_BYTES} bytes", param=param)
    return hashlib.blake2b(raw, digest_size=16, key=salt[:64]).hexdigest()


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
    if any(not 0 <= t < TOKEN_ID_LIMIT for t in prompt):
        raise RequestError(f"token ids must be in [0, {TOKEN_ID_LIMIT})", param="prompt")
    return Prompt(ids=list(prompt))
