"""What the router reads from a request before choosing a replica, and the 4xx it answers by itself.

The bytes are decoded by kvtier serve's own JSON decoder (``kvtier.web.body.decode_json``), so whatever a
replica refuses as malformed JSON (lone surrogates, integers of thousands of digits, nesting thousands deep,
NaN) the router refuses the same way, with the same 400, before it costs a replica anything. The router
forwards bodies untouched (a replica may accept fields the router never heard of), so beyond that it checks
only what it needs and what no replica could serve: a JSON object, ``messages`` (chat) or ``prompt``
(completions, or ``prompt_embeds``) of the right shapes, token ids in ``[0, 2**32)`` (what a chunk key
encodes), ``stream`` a boolean, ``user`` a string, ``max_tokens`` positive, kvtier's ``cache_ttl_s`` a number of
seconds in ``[0, MAX_TTL_S]`` (what every tier can hold). Anything else is the replica's business.

The tenant salt comes from the ``Authorization`` header exactly as kvtier serve derives it (``tenant_salt``),
never from the body. The session comes from ``X-Session-ID`` or ``user``; one longer than
``MAX_SESSION_ID_BYTES`` is a 400, and what the router keeps is a digest of the tenant's salt and the id, so a
session is remembered per tenant, in the same few bytes however long its id.

What the router scores is the prompt's text or token ids alone. A request whose KV depends on more (chat content
parts other than text: images, audio, video; ``prompt_embeds``; a ``cache_salt``) is routed by load alone
(``Prompt()``): the blocks replicas publish for such prompts carry extra keys and are never indexed
(kvtier.fleet.vllm_index), so scoring its token ids would predict hits on another prompt's blocks.

Decoding costs the GIL in one call, in proportion to the objects a body holds, so a body over ``WHOLE_BODY_BYTES``
is not decoded whole: its top level is split into fields without building their values (msgspec's raw values: the
JSON structure is checked, nothing is allocated), every field but ``messages`` and ``prompt`` is decoded strictly as
above, and of those two (when they are arrays and longer than ``PREFIX_BYTES``) only the elements that end within
their first ``PREFIX_BYTES`` bytes are decoded and checked (``Prompt.cut`` says so). Those hold more tokens than
the router hashes (``ProxyConfig.max_prompt_tokens``); the rest is the replica's to check, and a replica answers a
bad message anywhere in the body with its own 400, which the router passes on. An array whose first element alone
is longer than ``PREFIX_BYTES`` (one long text) is decoded whole: a few large values cost little.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvtier.api.errors import RequestError
from kvtier.api.tenants import api_key, tenant_salt
from kvtier.base.sizes import MAX_TTL_S
from kvtier.web.body import decode_json

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_BYTES = 256  #: a conversation or user id; longer ones are refused, not kept
TOKEN_ID_LIMIT = 1 << 32  #: chunk keys encode token ids as 32-bit integers
WHOLE_BODY_BYTES = 1 << 20  #: bodies up to this size are decoded whole
PREFIX_BYTES = 1 << 20  #: of a longer body's ``messages`` or ``prompt`` array, the bytes decoded
_PREFIXED = ("messages", "prompt")
#: fields that make a prompt's KV differ from its text's (vLLM's extensions): such a request is routed by load
#: alone, as an image prompt is, never scored against the blocks of the same token ids without them
UNSCORED_FIELDS = ("prompt_embeds", "cache_salt")


# msgspec, not pydantic models: checking a chat of 250k messages (what 8 MiB holds) took pydantic 1.05 s of CPU
# in one call that holds the GIL, so the event loop stalled that long; msgspec.convert takes 26 ms (40x less).
class _Message(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Body(msgspec.Struct, kw_only=True):  # strict types; fields the router does not know are the replica's
    model: str | None = None
    stream: bool = False
    user: str | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    cache_ttl_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_TTL_S)] | None = None  #: as kvtier serve takes it


class _ChatBody(_Body, kw_only=True):
    messages: Annotated[list[_Message], msgspec.Meta(min_length=1)]


class _CompletionBody(_Body, kw_only=True):
    #: text, ids, or a batch (list of texts or of id lists): checked in _completion_prompt; may be left out only
    #: when ``prompt_embeds`` is given (vLLM's extension)
    prompt: str | list[Any] | None = None
    prompt_embeds: Any = None


@dataclass(frozen=True)
class Prompt:
    """The prompt of a request as the router tokenizes it: chat messages (role, text) or a completion's text
    or ids. ``messages`` None and ``text`` None and ``ids`` None: not tokenizable here (e.g. images).
    ``cut``: ``messages`` or ``ids`` are only the leading ones of the request's (see the module docstring)."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    ids: list[int] | None = None
    cut: bool = False


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
    value, cut = (decode_json(body), False) if len(body) <= WHOLE_BODY_BYTES else _decode_leading(body)
    if not isinstance(value, dict):
        raise RequestError("the request body must be a JSON object")
    parsed = _convert(value, _ChatBody if chat else _CompletionBody)
    prompt = _chat_prompt(parsed) if chat else _completion_prompt(parsed)
    if any(value.get(name) is not None for name in UNSCORED_FIELDS):
        prompt = Prompt()  # its KV depends on more than the token ids the router would hash
    if cut and (prompt.messages is not None or prompt.ids is not None):
        prompt = Prompt(prompt.messages, prompt.text, prompt.ids, cut=True)
    header = headers.get(SESSION_HEADER)
    session = _session_key(salt, header, SESSION_HEADER) if header else _session_key(salt, parsed.user, "user")
    return ParsedRequest(chat, prompt, parsed.stream, session, salt)


def _decode_leading(body: bytes) -> tuple[dict[str, Any], bool]:
    """A large body's fields, with only the leading elements of its prompt arrays; and whether any was cut."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise RequestError("the request body must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    value, cut = {}, False
    for name, raw in fields.items():
        view = memoryview(raw)
        if name in _PREFIXED and len(view) > PREFIX_BYTES and view[:1] == b"[":
            leading = decode_json(bytes(view[:PREFIX_BYTES]), partial=True)
            if isinstance(leading, list) and len(leading) >= 2:  # the last may be cut short: dropped
                value[name], cut = leading[:-1], True
                continue
        value[name] = decode_json(bytes(view))
    return value, cut


def _convert(value: Any, kind: type, param: str | None = None) -> Any:
    """``value`` as ``kind`` (strict: no coercion), or a 400 naming the field (``param``, else the top-level
    field msgspec's path names)."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        where = re.search(r"at `\$\.(\w+)", str(exc)) or re.search(r"missing required field `(\w+)`", str(exc))
        raise RequestError(f"invalid request: {exc}", param=param or (where.group(1) if where else None)) from None


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
    if prompt is None:
        if body.prompt_embeds is None:
            raise RequestError("prompt is required (or prompt_embeds)", param="prompt")
        return Prompt()
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        batch = _convert(prompt, list[str] if isinstance(prompt[0], str) else list[list[int]], "prompt")
        prompt = batch[0]  # a batch: routed by its first prompt
    elif isinstance(prompt, list):
        prompt = _convert(prompt, list[int], "prompt")
    if not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if min(prompt) < 0 or max(prompt) >= TOKEN_ID_LIMIT:
        raise RequestError(f"token ids must be in [0, {TOKEN_ID_LIMIT})", param="prompt")
    return Prompt(ids=prompt)
