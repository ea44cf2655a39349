"""Token ids to text deltas, with stop strings, for streaming.

Decoding each token on its own breaks multi-byte characters and merges; instead the whole output is decoded
again at every token and the new suffix is released. Text that could still be the start of a stop string,
or that ends in an incomplete character (U+FFFD), is held back until it is decided.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Feed token ids with ``push``; read released text deltas. ``stopped`` once a stop string appeared."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_ids = set(skip_ids)
        self.ids: list[int] = []
        self.sent = 0  #: characters of the decoded text already released
        self.stopped = False
        self.text = ""

    def push(self, token: int) -> str:
        """Add one token; return the text that can be released now (possibly empty)."""
        if self.stopped:
            return ""
        if token not in self.skip_ids:
            self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop:
            at = self.text.find(stop)
            if at >= 0:
                self.stopped = True
                self.text = self.text[:at]
                return self._release(len(self.text))
        safe = len(self.text.rstrip("\ufffd"))
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._release(safe - hold)

    def flush(self) -> str:
        """The held-back text once generation has ended."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent:upto]
        self.sent = upto
        return delta
