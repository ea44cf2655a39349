"""A chat's token ids from the ids of the chat it extends: tokenize only what is new, get exactly the full ids.

A session's next request repeats its last one and adds turns, and sessions share a system prompt; a router that
tokenizes every request whole spends most of its CPU re-tokenizing text it has seen. ``IncrementalChat`` keeps
the ids of rendered message prefixes (a bounded LRU, keyed by a digest of the messages, each entry checked
against a digest of its rendered text) and encodes only the text after the longest one that the new chat's
rendering starts with.

Exactness. The ids equal those of one ``encode`` of the whole rendered text (what a replica computes), because
a cut is made only where that holds for the tokenizer at hand: right before a special token that the tokenizer
splits off before anything else looks at the text (``SafeCuts``: probed once per token string by encoding
texts around it whole and in two parts; a token that strips whitespace before it, or a normalizer or
pre-tokenizer that looks across it, fails the probe). Everything else (a template that does not render a
chat's start as the start of its text, a cut before a token that failed the probe) falls back to encoding
more of the text, and at worst all of it.
"""

from __future__ import annotations

import hashlib
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 4 << 20  #: token ids an IncrementalChat keeps by default
DEFAULT_MAX_ENTRIES = 65_536  #: message prefixes an IncrementalChat keeps by default

Encode = Callable[[str], Sequence[int]]
Render = Callable[[list[dict[str, str]], bool], str]

#: texts a probe puts before and after a candidate cut token: plain, whitespace-ended, word-glued
_PROBE_BEFORE = ("hello world", "hello world\n", "hello world ", "x", "\n\n", "")
_PROBE_AFTER = ("user\nhi there", " leading space", "\nnext line", "", "assistant\n")


class SafeCuts:
    """Which special-token strings a text may be cut right before, for this tokenizer (see the module
    docstring). ``at(text, i)``: whether ``encode(text) == encode(text[:i]) + encode(text[i:])`` is assured.
    Each token string is probed the first time a cut lands before it, then remembered."""

    def __init__(self, encode: Encode, specials: Sequence[str]) -> None:
        self._encode = encode
        ordered = sorted({s for s in specials if s}, key=len, reverse=True)  # the longest match wins, as in encode
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._probed: dict[str, bool] = {}

    def _probe(self, token: str) -> bool:
        encode = self._encode
        for before in _PROBE_BEFORE:
            for after in _PROBE_AFTER:
                if list(encode(before + token + after)) != [*encode(before), *encode(token + after)]:
                    return False
        return True

    def at(self, text: str, i: int) -> bool:
        if i == 0 or i == len(text):
            return True
        found = self._pattern.match(text, i) if self._pattern is not None and 0 < i < len(text) else None
        if found is None:
            return False
        token = found.group()
        safe = self._probed.get(token)
        if safe is None:
            safe = self._probed[token] = self._probe(token)
        return safe


@dataclass(frozen=True)
class _Entry:
    ids: array  #: the ids of the rendered prefix, as unsigned 32-bit ints (4 bytes a token)
    chars: int  #: its length in characters
    digest: int  #: of its text: a hit must render to the very same text


def _text_digest(text: str) -> int:
    """Python's own string hash: keyed per process (SipHash with a random seed), so a client cannot aim a
    collision at it, and five times cheaper than a cryptographic digest of the text. Only compared within this
    process, never stored or sent."""
    return hash(text)


def message_digests(messages: list[dict[str, str]]) -> list[bytes]:
    """``d[k]``: a digest of ``messages[:k]`` (roles and contents, length-prefixed), chained; ``d[0]`` of none."""
    out = [b""]
    for message in messages:
        h = hashlib.blake2b(out[-1], digest_size=16)
        for part in (message.get("role") or "", message.get("content") or ""):
            raw = part.encode("utf-8", "surrogatepass")
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
        out.append(h.digest())
    return out


class IncrementalChat:
    """Ids of a rendered chat, reusing the ids of the longest cached message prefix it extends.

    Holds at most ``max_tokens`` token ids over at most ``max_entries`` prefixes, least recently used dropped
    first. Thread-safe (routers tokenize on worker threads). ``hits``/``misses``/``encoded_chars`` count what
    the cache saved."""

    def __init__(self, encode: Encode, render: Render, specials: Sequence[str],
                 max_tokens: int = DEFAULT_MAX_TOKENS, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._encode, self._render = encode, render
        self.cuts = SafeCuts(encode, specials)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._tokens = 0
        self.max_tokens, self.max_entries = max_tokens, max_entries
        self._lock = threading.Lock()
        self.hits = self.misses = self.encoded_chars = 0

    def ids(self, messages: list[dict[str, str]], text: str | None = None) -> list[int]:
        """The ids of ``text`` (default: ``messages`` rendered with the generation prompt), exactly those of
        ``encode(text)``; the ids of ``messages`` rendered without it are kept for the chat's next turn."""
        text = self._render(messages, True) if text is None else text
        digests = message_digests(messages)
        base, start = self._longest(text, digests)
        if base is None and len(messages) > 1:
            base, start = self._first_message(text, messages, digests[1])
        ids = array("I", base if base is not None else ())
        prefix = self._render(messages, False)
        if len(prefix) > start and text.startswith(prefix) and self.cuts.at(text, len(prefix)):
            ids.extend(self._piece(text, start, len(prefix)))
            self._store(digests[-1], ids, prefix)
            start = len(prefix)
        ids.extend(self._piece(text, start, len(text)))
        return ids.tolist()

    def _piece(self, text: str, start: int, end: int) -> Sequence[int]:
        self.encoded_chars += end - start
        return self._encode(text[start:end]) if end > start else ()

    def _longest(self, text: str, digests: list[bytes]) -> tuple[array | None, int]:
        """The ids and length of the longest cached prefix ``text`` starts with and may be cut after."""
        for key in reversed(digests[1:]):
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
            if entry is None or entry.chars > len(text) or not self.cuts.at(text, entry.chars):
                continue
            if _text_digest(text[: entry.chars]) == entry.digest:
                self.hits += 1
                return entry.ids, entry.chars
        self.misses += 1
        return None, 0

    def _first_message(self, text: str, messages: list[dict[str, str]], key: bytes) -> tuple[array | None, int]:
        """On a miss: the first message (a system prompt, which sessions share) tokenized and kept on its own."""
        first = self._render(messages[:1], False)
        if not first or not text.startswith(first) or not self.cuts.at(text, len(first)):
            return None, 0
        ids = array("I", self._piece(text, 0, len(first)))
        self._store(key, ids, first)
        return ids, len(first)

    def _store(self, key: bytes, ids: array, text: str) -> None:
        entry = _Entry(array("I", ids), len(text), _text_digest(text))
        if len(entry.ids) > self.max_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._tokens += len(entry.ids) - (len(old.ids) if old is not None else 0)
            self._entries[key] = entry
            while self._tokens > self.max_tokens or len(self._entries) > self.max_entries:
                _, dropped = self._entries.popitem(last=False)
                self._tokens -= len(dropped.ids)

    @property
    def cached_tokens(self) -> int:
        return self._tokens
