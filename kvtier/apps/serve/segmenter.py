"""Where a request's reusable segments are, for ``kvtier serve --blend``.

* Chat requests: each message is a segment (put each retrieved document in its own message), except the
  last one, which with the assistant's turn opener is the query and always computed. Message boundaries come
  from rendering the chat template on growing message lists; a template whose rendering of the first
  messages is not a prefix of the whole (one that rewrites earlier turns) gives no segments.
* Text completions: with a separator configured, the text between separators is a segment, except the part
  after the last separator (the query). Token-id prompts have no segments.
* A prompt of more than ``MAX_SEGMENTS`` pieces (messages or separated texts) has no segments at all.

The prompt's tokens are never changed: segments are the runs of the prompt's own tokens that lie inside each
piece of text (offsets from the fast tokenizer). A token straddling a boundary belongs to no segment and is
computed; a piece whose tokens differ with its neighbours (a BPE merge across the boundary) simply gets a
different segment key. A tokenizer without offsets gives no segments.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.apps.serve.protocol import ChatRequest, CompletionRequest
from kvtier.core.segments import MAX_SEGMENTS
from kvtier.integrations.transformers import Span

log = logging.getLogger(__name__)



class NoSegments:
    """The segmenter of a server that does not blend: no request has segments."""

    def spans(self, request: ChatRequest | CompletionRequest, prompt_ids: list[int]) -> tuple[Span, ...]:
        return ()


class Segmenter:
    """Finds the segment spans of requests rendered and tokenized by ``tokenizer``."""

    def __init__(self, tokenizer, separator: str | None = None) -> None:
        if separator == "":
            raise ValueError("the blend separator must not be empty")
        self.tokenizer = tokenizer
        self.separator = separator

    def spans(self, request: ChatRequest | CompletionRequest, prompt_ids: list[int]) -> tuple[Span, ...]:
        """Token spans of ``request``'s segments in ``prompt_ids`` (the prompt the server built for it)."""
        if not getattr(self.tokenizer, "is_fast", False):
            return ()
        if isinstance(request, ChatRequest):
            return self.chat(request.template_messages(), prompt_ids)
        prompt = request.prompt_value()
        if isinstance(prompt, str) and self.separator:
            return self.text(prompt, prompt_ids)
        return ()

    def chat(self, messages: list[dict[str, str]], prompt_ids: list[int]) -> tuple[Span, ...]:
        """Spans of every message but the last in ``prompt_ids``, the chat template's rendering of them."""
        if len(messages) > MAX_SEGMENTS:  # finding message boundaries renders the template once per message:
            # a cost quadratic in the count, which a hostile request could otherwise choose
            log.debug("%d messages (more than %d): no segments", len(messages), MAX_SEGMENTS)
            return ()
        render = self.tokenizer.apply_chat_template
        texts = [render(messages[:i], tokenize=False) for i in range(1, len(messages))]
        full = render(messages, add_generation_prompt=True, tokenize=False)
        for before, after in zip(texts, [*texts[1:], full]):
            if not after.startswith(before):
                log.debug("the chat template rewrites earlier messages: no segments")
                return ()
        bounds = [0, *(len(text) for text in texts)]
        return self._token_spans(full, list(zip(bounds, bounds[1:])), prompt_ids, special=False)

    def text(self, text: str, prompt_ids: list[int]) -> tuple[Span, ...]:
        """Spans of the pieces of ``text`` before each separator in ``prompt_ids``, its tokenization."""
        pieces, start = [], 0
        while (at := text.find(self.separator, start)) >= 0:
            if len(pieces) == MAX_SEGMENTS:
                log.debug("more than %d separated pieces: no segments", MAX_SEGMENTS)
                return ()
            pieces.append((start, at))
            start = at + len(self.separator)
        return self._token_spans(text, pieces, prompt_ids, special=True)

    def _token_spans(self, text: str, pieces: Sequence[tuple[int, int]], prompt_ids: list[int], *,
                     special: bool) -> tuple[Span, ...]:
        """For each character range, the run of prompt tokens lying wholly inside it (empty runs dropped)."""
        if not pieces:
            return ()
        encoded = self.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        if list(encoded["input_ids"]) != list(prompt_ids):
            log.debug("the prompt does not tokenize as the text does: no segments")
            return ()
        offsets = encoded["offset_mapping"]
        spans, token = [], 0
        for begin, end in pieces:
            while token < len(offsets) and offsets[token][0] < begin:
                token += 1
            first = token
            while token < len(offsets) and offsets[token][1] <= end:
                token += 1
            if token > first:
                spans.append((first, token))
        return tuple(spans)
