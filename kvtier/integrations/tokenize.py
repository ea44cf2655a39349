"""Prompt text to token ids without paying for text the context cannot hold (any engine's tokenizer).

Tokenizing costs time in proportion to the text, and a client can send far more text than a context holds
(a 10 MB prompt is 1.7 M tokens of work before the context check could refuse it). So a text longer than
the first window is tokenized in prefixes that double in length: once a prefix alone has more tokens than
the context (plus a margin for the cut), the whole text has too, and it is refused. The work stays within
about twice the cost of tokenizing a context's worth of text, however long the text is. A text that fits is
tokenized whole, so the ids it gets are exactly what one ``encode`` of it gives.

Soundness rests on tokenization being local, as it is for BPE, WordPiece and Unigram tokenizers behind
whitespace or byte-level pre-tokenizers: a prefix cut at whitespace tokenizes like the start of the whole
text except for at most a few tokens at the cut, far fewer than ``CUT_MARGIN``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

FIRST_WINDOW_CHARS_PER_TOKEN = 8  # prompts average ~4 characters a token: most that fit take one encode
CUT_MARGIN = 64  #: tokens a cut may add to a prefix's count beyond what the whole text has up to that point
_CUT_SEARCH = 256  # how far back from a window's end to look for whitespace to cut at


class PromptTooLong(ValueError):
    """A prompt with certainly more tokens than a context holds; ``tokens`` is a lower bound on its count."""

    def __init__(self, tokens: int, context: int) -> None:
        super().__init__(f"the prompt has more than {tokens} tokens; this model's context is {context}")
        self.tokens = tokens
        self.context = context


def encode_within(encode: Callable[[str], Sequence[int]], text: str, context: int) -> list[int]:
    """``list(encode(text))``, or PromptTooLong once ``text`` certainly has more than
    ``context`` tokens. Texts between ``context`` and ``context + CUT_MARGIN`` tokens come back whole, for the
    caller's exact length check."""
    window = max(context, 1) * FIRST_WINDOW_CHARS_PER_TOKEN
    while len(text) > window:
        counted = len(encode(text[: _cut(text, window)]))
        if counted > context + CUT_MARGIN:
            raise PromptTooLong(counted - CUT_MARGIN, context)
        window *= 2
    return list(encode(text))


def encode_prefix(encode: Callable[[str], Sequence[int]], text: str, max_tokens: int) -> list[int]:
    """The ids ``encode(text)`` starts with, at most about ``max_tokens`` of them, at a cost bounded as in
    ``encode_within``: all of them for a text that fits, else those of a prefix that is certainly longer,
    less the ``CUT_MARGIN`` tokens its cut may have changed. For a router, which needs a prompt's leading
    chunks to know where it is cached, not the whole prompt (the replica judges whether it fits)."""
    window = max(max_tokens, 1) * FIRST_WINDOW_CHARS_PER_TOKEN
    while len(text) > window:
        ids = list(encode(text[: _cut(text, window)]))
        if len(ids) > max_tokens + CUT_MARGIN:
            return ids[: len(ids) - CUT_MARGIN]
        window *= 2
    return list(encode(text))


def _cut(text: str, window: int) -> int:
    """Where to end a prefix of about ``window`` characters: at whitespace if there is some near the end."""
    floor = max(window - _CUT_SEARCH, 0)
    at = max(text.rfind(" ", floor, window), text.rfind("\n", floor, window))
    return at if at > floor else window
