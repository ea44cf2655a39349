"""Bounded prompt tokenizing for ``kvtier serve``: a prompt the context cannot hold is a 400 on ``prompt``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.integrations.tokenize import CUT_MARGIN, FIRST_WINDOW_CHARS_PER_TOKEN, PromptTooLong
from kvtier.web.errors import RequestError

__all__ = ["CUT_MARGIN", "FIRST_WINDOW_CHARS_PER_TOKEN", "encode_within"]


def encode_within(encode: Callable[[str], Sequence[int]], text: str, context: int) -> list[int]:
    """:func:`kvtier.integrations.tokenize.encode_within`, refusing a too-long prompt with RequestError(400)."""
    from kvtier.integrations.tokenize import encode_within as encode_bounded

    try:
        return encode_bounded(encode, text, context)
    except PromptTooLong as exc:
        raise RequestError(str(exc), param="prompt") from exc
