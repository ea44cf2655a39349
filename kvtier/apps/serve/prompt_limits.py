"""Bounded prompt tokenizing for ``kvtier serve``: a prompt the context cannot hold is a 400 on ``prompt``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvtier.api.errors import RequestError
from kvtier.integrations.tokenize import CUT_MARGIN, FIRST_WINDOW_CHARS_PER_TOKEN, PromptTooLong

__all__ = ["CUT_MARGIN", "FIRST_WINDOW_CHARS_PER_TOKEN", "encode_within", "refuse_overlong_chat",
           "refuse_too_many_messages"]

#: bodies from this size on are counted before they are decoded whole (a smaller one decodes in a few ms)
COUNT_FROM_BYTES = 1 << 20


def encode_within(encode: Callable[[str], Sequence[int]], text: str, context: int) -> list[int]:
    """:func:`kvtier.integrations.tokenize.encode_within`, refusing a too-long prompt with RequestError(400)."""
    from kvtier.integrations.tokenize import encode_within as encode_bounded

    try:
        return encode_bounded(encode, text, context)
    except PromptTooLong as exc:
        raise RequestError(str(exc), param="prompt") from exc


def refuse_overlong_chat(render: Callable[..., Any], encode: Callable[[str], Sequence[int]],
                         messages: list[dict[str, str]], context: int) -> None:
    """RequestError(400) for a chat whose leading messages alone have more tokens than ``context``, found by
    rendering only as many leading messages as hold twice the text of the first tokenizing window
    (``render`` is the tokenizer's ``apply_chat_template``). A chat of 240k messages then costs the render of
    its first few thousand, not of all of them. Returns quietly when the chat is short enough to be rendered
    whole, when its leading messages fit, or when the template does not render a chat's start as the start of
    its text (then the caller's whole render and ``encode_within`` decide, as before)."""
    from kvtier.integrations.prompts import leading_messages

    lead = leading_messages(messages, 2 * max(context, 1) * FIRST_WINDOW_CHARS_PER_TOKEN)
    if lead == len(messages):
        return
    text = render(messages[:lead], add_generation_prompt=False, tokenize=False)
    if lead >= 2 and not text.startswith(render(messages[: lead - 1], add_generation_prompt=False, tokenize=False)):
        return
    encode_within(encode, text, context)


class _MessagesOnly(msgspec.Struct):
    messages: list[msgspec.Raw] | None = None


def refuse_too_many_messages(raw: bytes, context: int) -> None:
    """RequestError(400) on ``messages`` for a chat body with more messages than ``context`` has tokens (each
    message renders to at least its role's header), found before the body is decoded whole. Decoding and
    validating a 240k-message body holds the interpreter lock for a few hundred ms in one C call, which stalls
    the event loop's /health meanwhile; counting the messages as raw spans takes about a quarter of that.
    Bodies under ``COUNT_FROM_BYTES``, and anything this count cannot read, are left to the full decoder,
    whose errors are the ones to give."""
    if len(raw) < COUNT_FROM_BYTES:
        return
    try:
        messages = msgspec.json.decode(raw, type=_MessagesOnly).messages
    except (msgspec.DecodeError, RecursionError, ValueError):
        return
    if messages is not None and len(messages) > context:
        raise RequestError(f"a chat of {len(messages):,} messages cannot fit this model's context of {context:,} "
                           "tokens", param="messages")
