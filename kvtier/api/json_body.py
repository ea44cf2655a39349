"""JSON from untrusted bytes: one decoder, one error, for every kvtier HTTP surface (completions and admin calls
of ``kvtier serve`` and ``kvtier route``, the vLLM rank server's admin calls, the replicas' answers the router
merges).

Decoding uses pydantic-core's JSON parser (jiter), already a dependency through pydantic, rather than the
standard library's or msgspec's: it refuses what they let through or turn into a 500 — integers too long for
Python's int-string limit, nesting deeper than a few hundred levels (``json.loads`` and ``msgspec`` raise
``RecursionError`` instead), lone UTF-16 surrogates such as ``"\\ud800"`` (which tokenizers cannot encode) and
``NaN``/``Infinity`` (not JSON) — each with a message saying where in the body the problem is.

Size is the caller's to bound before decoding (kvtier.web.body.read_body, the rank server's ``MAX_BODY_BYTES``).
"""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json

from kvtier.api.errors import RequestError


def decode_json(raw: bytes, partial: bool = False) -> Any:
    """The JSON value in ``raw``; RequestError (400) for anything that is not strict, well-formed JSON.

    ``partial``: ``raw`` may be cut short (a prefix of a document): what it holds is decoded as far as it goes,
    an unfinished string, number or literal at its end left out (an unfinished array or object is kept, with
    what it holds so far); the same strictness otherwise."""
    try:
        return from_json(raw, allow_inf_nan=False, allow_partial=partial)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
