"""What, beside its token ids, changes a vLLM request's KV, as kvtier keys: the inputs vLLM 0.32's own block
hashing folds into its block hashes (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``).

* ``request_salt``: the LoRA adapter (name and path) and the request's ``cache_salt``: the tenant part of the key
  (the namespace's salt, so entries are owned per adapter and salt).
* ``request_extras``: :class:`~kvtier.base.keys.ExtraKeys` as vLLM keys its blocks: the LoRA name over every
  position, each multimodal input's identifier (its hash) over its placeholder range, the cache salt over the
  first position, and for a prompt given as embeddings one SHA-256 digest of the embedding bytes of each
  chunk's span, read from the request's tensor in place (no copy of a contiguous tensor).
* A request with an input kvtier cannot key raises :class:`Unkeyable` (its kind): a multimodal input without an
  identifier or placeholder range, embeddings that are not a tensor, a request whose inputs cannot be read, or
  any request field vLLM's extra-keys code reads that kvtier does not handle (``vllm_keyed_fields``, read from
  vLLM's source once) when the request sets it. The scheduler neither loads nor stores such a request.
"""

from __future__ import annotations

import ast
import inspect
import logging
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
from blake3 import blake3

from kvtier.base.keys import SPAN_END, ExtraKeys, InputKind, SpanKey
from kvtier.tiers.control import MAX_TTL_S

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Request fields vLLM's block hashing reads, and what kvtier keys them as (None: the tokens, or vLLM's own
#: bookkeeping that carries nothing of the input).
HANDLED: dict[str, InputKind | None] = {
    "all_token_ids": None, "num_tokens": None, "block_hashes": None,
    "_prompt_embeds_per_block_hashes": None,  # vLLM's cache of the digests of prompt_embeds
    "lora_request": InputKind.LORA, "mm_features": InputKind.MULTIMODAL, "cache_salt": InputKind.CACHE_SALT,
    "prompt_embeds": InputKind.PROMPT_EMBEDS,
}
#: The functions of vLLM's kv_cache_utils whose reads of ``request`` make a block hash.
HASHING_FUNCTIONS = ("get_request_block_hasher", "need_extra_keys", "generate_block_hash_extra_keys")
UNREADABLE = "unreadable"  #: the kind counted for a request whose inputs could not be read


class Unkeyable(Exception):
    """A request input kvtier cannot key; ``kind`` names it (a request field, or ``UNREADABLE``)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind = kind


def request_salt(request: Request) -> bytes:
    """What separates one request's KV from another's with the same tokens for tenancy: the LoRA adapter (name
    and path, so a name re-pointed at another adapter is another key) and the cache salt."""
    lora = request.lora_request
    name, path = (lora.lora_name, lora.lora_path) if lora is not None else ("", "")
    salt = request.cache_salt or ""
    return f"lora={name}\0path={path}\0salt={salt}".encode() if name or salt else b""


def request_extras(request: Request, chunk_size: int, unhandled: frozenset[str] = frozenset()) -> ExtraKeys:
    """The request's extra keys (module docstring); Unkeyable if an input cannot be keyed. ``unhandled``: request
    fields vLLM keys that kvtier does not (a request that sets one is Unkeyable)."""
    try:
        for name in sorted(unhandled):
            if _is_set(getattr(request, name, None)):
                raise Unkeyable(name, "vLLM keys this input and kvtier does not")
        spans: list[SpanKey] = []
        if request.lora_request is not None:
            spans.append(SpanKey(InputKind.LORA, 0, SPAN_END, request.lora_request.lora_name.encode()))
        spans += _multimodal(request.mm_features or ())
        if request.cache_salt:
            spans.append(SpanKey(InputKind.CACHE_SALT, 0, 1, request.cache_salt.encode()))
        if request.prompt_embeds is not None:
            spans += embed_spans(request.prompt_embeds, chunk_size)
        return ExtraKeys(tuple(spans))
    except Unkeyable:
        raise
    except Exception as exc:  # a field of another shape than vLLM 0.32's: not cached, never an error in vLLM
        raise Unkeyable(UNREADABLE, f"{type(exc).__name__}: {exc}") from None


def _multimodal(features: Any) -> list[SpanKey]:
    spans = []
    for feature in features:
        identifier, position = getattr(feature, "identifier", None), getattr(feature, "mm_position", None)
        if not isinstance(identifier, str) or not identifier or position is None:
            raise Unkeyable("mm_features", "a multimodal input without an identifier or a placeholder range")
        start = int(position.offset)
        spans.append(SpanKey(InputKind.MULTIMODAL, start, start + int(position.length), identifier.encode()))
    return spans


def embed_spans(embeds: torch.Tensor, chunk_size: int) -> list[SpanKey]:
    """One span per chunk of the embedding rows: the BLAKE3 digest (32 bytes) of the rows' bytes (the last span
    may be short). The bytes are read in place from a contiguous CPU tensor. BLAKE3 rather than SHA-256: both are
    cryptographic, and BLAKE3 (a dependency of vLLM itself) hashes a 2,048-row embeddings prompt about 4x faster,
    which keeps the digest well inside its share of a cached request's time to first token."""
    if not isinstance(embeds, torch.Tensor) or embeds.dim() < 1:
        raise Unkeyable("prompt_embeds", "prompt embeddings that are not a tensor of rows")
    rows = embeds.detach()
    if rows.device.type != "cpu" or not rows.is_contiguous():
        rows = rows.to("cpu").contiguous()  # a copy only for a tensor vLLM 0.32 never hands the scheduler
    raw = rows.reshape(len(rows), -1).view(torch.uint8).numpy()
    return [SpanKey(InputKind.PROMPT_EMBEDS, i, min(i + chunk_size, len(raw)),
                    blake3(raw[i : i + chunk_size].data).digest())
            for i in range(0, len(raw), chunk_size)]


def _is_set(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return True
    try:
        return bool(value)
    except Exception:  # an object without a truth value: set
        return True


@cache
def vllm_keyed_fields() -> frozenset[str]:
    """The fields of ``request`` that vLLM's block hashing reads (HASHING_FUNCTIONS and the functions of the same
    module they call), from the installed vLLM's source. Empty if the source cannot be read (logged)."""
    from vllm.v1.core import kv_cache_utils

    try:
        tree = ast.parse(inspect.getsource(kv_cache_utils))
    except (OSError, TypeError, SyntaxError) as exc:
        log.warning("kvtier: cannot read vLLM's block hashing (%s): keying the inputs vLLM 0.32 keys", exc)
        return frozenset()
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    todo, seen, fields = list(HASHING_FUNCTIONS), set(), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "request":
                fields.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                todo.append(node.func.id)
    return frozenset(fields)


def unhandled_fields() -> frozenset[str]:
    """Fields vLLM keys that kvtier does not: requests setting them are not cached (warned once at start)."""
    unhandled = vllm_keyed_fields() - HANDLED.keys()
    if unhandled:
        log.warning("kvtier: this vLLM keys request fields kvtier does not (%s): requests that set them are "
                    "neither loaded nor stored", ", ".join(sorted(unhandled)))
    return frozenset(unhandled)


def request_ttl(request: Request) -> float | None:
    """The retention time a request asks for its stores: ``kv_transfer_params={"kvtier": {"ttl_s": SECONDS}}``
    (a positive number up to ``MAX_TTL_S``, what every tier can hold), None without one.

    Anything else there (a negative, zero, infinite or non-number ``ttl_s``, a ``kvtier`` value that is not an
    object, one past ``MAX_TTL_S``) is ignored with a warning, and the request is stored without a retention time:
    vLLM 0.32 has no connector hook that rejects a request before scheduling, and raising in the scheduler's calls
    would fail every request in the engine loop, not only this one. ``SchedulerSide.ignored_params`` counts them."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get("kvtier") if isinstance(params, dict) else None
    if ours is None:
        return None
    if not isinstance(ours, dict):
        raise ValueError(f"kv_transfer_params.kvtier must be an object such as {{'ttl_s': 30}}, got {ours!r}")
    ttl = ours.get("ttl_s")
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= MAX_TTL_S:
        raise ValueError(f"kv_transfer_params.kvtier.ttl_s must be a positive number of seconds up to {MAX_TTL_S}, "
                         f"got {ttl!r}")
    return float(ttl)
