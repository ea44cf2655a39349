"""The admin API's shared parts: who is calling, the request bodies, and the OpenAPI description.

``kvtier serve`` answers the admin API for its own cache and the vLLM connector's per-rank metrics server for
its rank's (both through kvtier.api.admin_ops); ``kvtier route`` fans each call out to its replicas and merges
their answers (kvtier.apps.route.admin). All use this module, so a body one accepts the others do too, and one
OpenAPI document describes them.

Who may do what (``authorize``), by the ``Authorization: Bearer <key>`` header:

* no header (or a malformed one): 401, for every admin route;
* the **admin key** (``--admin-key-file``, else ``KVTIER_ADMIN_KEY``; compared in constant time): everything;
* any other key is a **tenant key**, the same key the tenant sends with its completions: it may look up and
  clear its own tenant's entries (the cache salt its key derives, kvtier.api.tenants), nothing else. Naming a
  tenant, clearing beyond its own entries, pinning, unpinning and stats are 403. A server with no admin key
  configured answers 403 to every admin-only call.

Bodies are at most ``MAX_BODY_BYTES`` (a 413 beyond), decoded by the same decoder as the completion endpoints
(kvtier.api.json_body: nesting, integer length, NaN and lone surrogates are a 400, never a 500) and checked by
msgspec, strictly (no coercion, no unknown field): a prompt is ``tokens`` (token ids), ``text`` (tokenized by the
server's tokenizer as a completion prompt) or ``messages`` (an OpenAI chat, rendered by the server's chat template
as its chat route renders one), exactly one of them; ``tenant`` (admin only) is a tenant name from the cache
config's ``tenants``, or ``default`` (the empty salt).

What ``messages`` address is the prefix that the chat's next requests share (``chat_prompt``): the template
applied to the messages with the assistant's cue (``add_generation_prompt``) when the last message is the
user's, since the next request is exactly that chat and the assistant's answer extends it; without the cue
otherwise (a system prompt alone, a chat ending with the assistant's turn), since the next requests append a
user's message where the cue would be. ``add_generation_prompt`` in the body overrides the choice.
Anything else is a 400 that names the field (an unknown tenant name a 404, a pin past a tier's pin budget a 409),
and changes nothing.
"""

from __future__ import annotations

import hmac
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from kvtier.api.chat import ChatMessage, ChatPrompt, template_messages
from kvtier.api.errors import RequestError
from kvtier.api.json_body import decode_json
from kvtier.api.tenants import api_key, tenant_salt

PREFIX = "/admin/v1"
ADMIN_KEY_ENV = "KVTIER_ADMIN_KEY"
MAX_TOKENS = 1 << 20  #: token ids one admin call may name
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]  #: what a chunk key encodes (32 bits)
MAX_BODY_BYTES = 16 << 20  #: the largest admin request body any server accepts (MAX_TOKENS ids fit)
MAX_MESSAGES = 1 << 16  #: chat messages one admin call may name


class LookupBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /admin/v1/lookup``: how much of a prompt is cached, in all tiers together and in each."""

    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)] | None = None
    text: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: bool | None = None  #: with ``messages``: None chooses as the module docstring says
    tenant: str | None = None  #: admin only: a configured tenant name or ``default``

    def prompt(self) -> str | list[int] | ChatPrompt:
        """The prompt as the server's prompt function takes it (``parse_body`` checked there is one)."""
        if self.messages is not None:
            return chat_prompt(self.messages, self.add_generation_prompt)
        return self.text if self.text is not None else list(self.tokens or [])


class PinBody(LookupBody, forbid_unknown_fields=True, kw_only=True):
    """``POST /admin/v1/pin`` and ``/unpin``: the prompt's cached prefix, in ``tiers`` (by name; all that can pin
    when absent)."""

    tiers: list[str] | None = None


class ClearBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /admin/v1/clear``: ``tenant`` scope clears one tenant's entries (the caller's own for a tenant key,
    the named one for the admin), ``model`` this model's, ``all`` everything every tier holds."""

    scope: Literal["tenant", "model", "all"] = "tenant"
    tenant: str | None = None


#: Every admin route: (method, path under PREFIX, body or None, admin only, summary).
ROUTES: tuple[tuple[str, str, type | None, bool, str], ...] = (
    ("post", "/lookup", LookupBody, False, "Cached prefix tokens of a prompt, in all tiers and per tier"),
    ("post", "/pin", PinBody, True, "Pin a prompt's cached prefix (never evicted, never expires)"),
    ("post", "/unpin", PinBody, True, "Release the pins of a prompt's prefix"),
    ("post", "/clear", ClearBody, False, "Remove a tenant's, this model's or every entry from every tier"),
    ("get", "/stats", None, True, "Entries, bytes, pins, tenants and admission per tier"),
)


@dataclass(frozen=True)
class Caller:
    """Who is calling: the admin, or a tenant (its cache salt)."""

    admin: bool
    salt: bytes = b""

    @property
    def label(self) -> str:
        """For logs: ``admin`` or the tenant's salt prefix (no secret: the salt is a digest of the key)."""
        return "admin" if self.admin else f"tenant {self.salt.hex()[:12]}"


def admin_key_from(path: str | None, environ: dict[str, str] | os._Environ | None = None) -> str | None:
    """The admin key: the first line of the file at ``path``, else ``KVTIER_ADMIN_KEY``; None when neither is set.
    A RequestError is not the right error for a start-up problem: OSError / ValueError propagate."""
    if path:
        with open(path, encoding="utf-8") as fh:
            key = fh.readline().strip()
        if not key:
            raise ValueError(f"the admin key file {path} is empty")
        return key
    env = os.environ if environ is None else environ
    return env.get(ADMIN_KEY_ENV) or None


def authorize(header: str | None, admin_key: str | None, *, admin_only: bool) -> Caller:
    """The caller of an admin route (see the module docstring); RequestError 401 / 403 otherwise."""
    key = api_key(header)
    if key is None:
        raise RequestError("the admin API needs 'Authorization: Bearer <key>' (the admin key or a tenant key)", 401)
    if admin_key is not None and hmac.compare_digest(key.encode(), admin_key.encode()):
        return Caller(admin=True)
    if admin_only:
        raise RequestError("this admin call needs the admin key" if admin_key is not None else
                           "this server has no admin key configured (--admin-key-file or KVTIER_ADMIN_KEY)", 403)
    return Caller(admin=False, salt=tenant_salt(key))


def parse_body(raw: bytes, kind: type[msgspec.Struct]) -> Any:
    """``raw`` as ``kind``: strict JSON, strict types; a 400 naming the field otherwise."""
    value = decode_json(raw) if raw.strip() else {}
    if not isinstance(value, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        body = msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        where = re.search(r"at `\$\.(\w+)", str(exc)) or re.search(r"field `(\w+)`", str(exc))
        raise RequestError(f"invalid request: {exc}", param=where.group(1) if where else None) from None
    if isinstance(body, LookupBody) and [body.tokens, body.text, body.messages].count(None) != 2:
        raise RequestError("give the prompt as exactly one of tokens, text or messages", param="tokens")
    if isinstance(body, LookupBody) and body.messages is None and body.add_generation_prompt is not None:
        raise RequestError("add_generation_prompt goes with messages", param="add_generation_prompt")
    if isinstance(body, LookupBody) and body.tokens is not None and not body.tokens:
        raise RequestError("tokens must not be empty", param="tokens")
    return body


def chat_prompt(messages: list[ChatMessage], add_generation_prompt: bool | None = None) -> ChatPrompt:
    """The prompt ``messages`` address (see the module docstring): with the assistant's cue when
    ``add_generation_prompt``, or, when that is None, when the last message is the user's."""
    cue = messages[-1].role == "user" if add_generation_prompt is None else add_generation_prompt
    return ChatPrompt(template_messages(messages), cue)


def check_scope(caller: Caller, tenant: str | None, scope: str = "tenant") -> None:
    """403 unless ``caller`` may act on ``tenant`` (a name from the body) in ``scope``: a tenant key names no
    tenant and clears only its own entries."""
    if caller.admin:
        return
    if tenant is not None:
        raise RequestError("a tenant key acts on its own tenant only: drop 'tenant'", 403, param="tenant")
    if scope != "tenant":
        raise RequestError(f"clearing scope {scope!r} needs the admin key; a tenant key clears its own entries", 403,
                           param="scope")


def openapi(title: str = "kvtier admin API", version: str = "1") -> dict[str, Any]:
    """The OpenAPI 3.1 description of every route in ``ROUTES``, schemas from the msgspec bodies."""
    bodies = [body for _, _, body, _, _ in ROUTES if body is not None]
    (refs, components) = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    ref_of = dict(zip(bodies, refs))
    errors = {"401": {"description": "no or malformed Authorization header"},
              "403": {"description": "the key may not do this (a tenant key, or no admin key configured)"},
              "400": {"description": "malformed body, unknown field or tier (nothing changed)"},
              "404": {"description": "unknown tenant name (nothing changed)"},
              "409": {"description": "a pin past a tier's pin budget, or no cache (nothing changed)"}}
    paths: dict[str, Any] = {}
    for method, path, body, admin_only, summary in ROUTES:
        op: dict[str, Any] = {"summary": summary, "security": [{"bearer": []}],
                              "responses": {"200": {"description": "done; JSON answer"}, **errors}}
        if admin_only:
            op["description"] = "Admin key only."
        else:
            op["description"] = "Admin key, or a tenant key for the tenant's own entries."
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref_of[body]}}}
        paths[PREFIX + path] = {method: op}
    paths[PREFIX + "/openapi.json"] = {"get": {"summary": "This description", "responses": {
        "200": {"description": "OpenAPI 3.1 JSON"}}}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
