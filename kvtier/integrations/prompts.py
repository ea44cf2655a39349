"""Prompt token ids as an OpenAI-compatible server computes them, for a router that must hash the same chunks.

``kvtier serve`` (and vLLM) turn a chat request into ids by rendering the model's chat template with the
generation prompt and encoding the text without adding special tokens, and a text completion by encoding the
text with them. ``PromptTokenizer`` does exactly that from the same tokenizer files, so the router's chunk
keys equal the replica's. Loading a tokenizer needs transformers, hence this module's place.

A router wants only a prompt's leading ids (``max_tokens``), so a chat whose messages hold more text than those
ids can come from is rendered over its leading messages only: those whose text reaches
``max_tokens x FIRST_WINDOW_CHARS_PER_TOKEN`` characters (``leading_messages``), then tokenized as
``encode_prefix`` does and less the ``CUT_MARGIN`` tokens the cut may have changed. That is right for a
template that renders a chat's leading messages as the start of the whole chat's text (each message appended
in turn, as chat templates do); it is checked where the chat is cut (the text of one message less must be the
start of it), and a chat whose template fails the check gets None (the router routes it without its cache). Rendering
costs the GIL in proportion to the messages rendered, so a chat of 240k messages costs no more than its first
few thousand. A chat that fits is rendered whole, with the generation prompt, and its ids are exactly those of
one encode of that text, computed incrementally (kvtier.integrations.prompt_cache): only the text after the
longest message prefix already tokenized (the session's last turn, or a shared system prompt) is encoded.

A folder whose ``tokenizer_config.json`` names the generic fast tokenizer (``TokenizersBackend``, as
transformers 5 saves one, or ``PreTrainedTokenizerFast``) is loaded with that class directly, which is what
``AutoTokenizer`` resolves it to, without ``AutoTokenizer``'s import of the model configs (and torch under them):
a router then never loads torch (about 180 MB). Any other tokenizer class goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvtier.base.errors import ConfigError
from kvtier.integrations.prompt_cache import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_TOKENS, IncrementalChat


class PromptTokenizer:
    """A model folder's tokenizer and chat template (default: the packaged SmolLM2-135M-Instruct)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, cache_entries: int = DEFAULT_MAX_ENTRIES,
                 cache_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        """``cache_entries``/``cache_tokens``: the bounds of the incremental tokenization's prefix cache (its
        memory: about 4 bytes a token plus ~200 bytes an entry, least recently used dropped first)."""
        from kvtier.integrations.models import ensure_smollm2

        folder = Path(path).expanduser() if path is not None else ensure_smollm2()
        self.source = folder  #: where the tokenizer was loaded from
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            self._tokenizer = _load(folder)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {folder}: {exc}") from None
        self.incremental = self._incremental(cache_entries, cache_tokens)

    def _incremental(self, entries: int = DEFAULT_MAX_ENTRIES, tokens: int = DEFAULT_MAX_TOKENS) -> IncrementalChat:
        tokenizer = self._tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer: the same ids without the wrapper
        if backend is not None and hasattr(backend, "encode"):
            def encode(text: str) -> list[int]:
                return backend.encode(text, add_special_tokens=False).ids
        else:
            def encode(text: str) -> list[int]:
                return tokenizer.encode(text, add_special_tokens=False)

        def render(messages: list[dict[str, str]], ready: bool) -> str:
            self.rendered += len(messages)
            return tokenizer.apply_chat_template(messages, add_generation_prompt=ready, tokenize=False)

        specials = [token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        return IncrementalChat(encode, render, specials, max_tokens=tokens, max_entries=entries)

    def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None,
             cut: bool = False) -> list[int] | None:
        """Ids of ``messages`` (role and text content) ready for the assistant's turn; None without a template.
        With ``max_tokens``, only about that many leading ids, at a cost bounded accordingly (rendering the
        leading messages only, see the module docstring). ``cut``: ``messages`` are only the leading ones of
        the chat (the ids are then those of their text, less ``CUT_MARGIN``; None if that is not a prefix)."""
        from kvtier.integrations.tokenize import CUT_MARGIN, FIRST_WINDOW_CHARS_PER_TOKEN

        tokenizer = self._tokenizer
        if not getattr(tokenizer, "chat_template", None):
            return None

        def encode(part: str) -> list[int]:
            return tokenizer.encode(part, add_special_tokens=False)

        def render(leading: list[dict[str, str]], ready: bool) -> str:
            self.rendered += len(leading)
            return tokenizer.apply_chat_template(leading, add_generation_prompt=ready, tokenize=False)

        lead = len(messages) if max_tokens is None else \
            leading_messages(messages, max(max_tokens, 1) * FIRST_WINDOW_CHARS_PER_TOKEN)
        if lead == len(messages) and not cut:
            text = render(messages, True)
            if max_tokens is None or len(text) <= max(max_tokens, 1) * FIRST_WINDOW_CHARS_PER_TOKEN:
                return self.incremental.ids(messages, text)  # what one encode of the text gives, from less work
            return self._encode(encode, text, max_tokens)
        text = render(messages[:lead], False)
        if lead >= 2 and not text.startswith(render(messages[: lead - 1], False)):
            return None  # this template does not render a chat's start as the start of its text
        ids = self._encode(encode, text, max_tokens)
        return ids[: max(len(ids) - CUT_MARGIN, 0)]

    def text(self, prompt: str, max_tokens: int | None = None) -> list[int]:
        """Ids of a completion's text prompt (with ``max_tokens``, only about that many leading ones)."""
        return self._encode(self._tokenizer.encode, prompt, max_tokens)

    rendered = 0  #: messages rendered so far (chat templates cost in proportion to them)

    @staticmethod
    def _encode(encode, text: str, max_tokens: int | None) -> list[int]:
        from kvtier.integrations.tokenize import encode_prefix

        return list(encode(text)) if max_tokens is None else encode_prefix(encode, text, max_tokens)


def leading_messages(messages: list[dict[str, str]], chars: int) -> int:
    """How many leading ``messages`` hold more than ``chars`` characters of text (their roles and contents, and
    a few for each one's markup); all of them if they hold less."""
    total = 0
    for i, message in enumerate(messages):
        total += len(message.get("content") or "") + len(message.get("role") or "") + 8
        if total > chars:
            return i + 1
    return len(messages)


#: Tokenizer classes that AutoTokenizer loads as the generic Rust-backed tokenizer, from tokenizer.json alone.
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _load(folder: Path):
    """The tokenizer of ``folder``: the generic class directly when the folder names it (no torch), else
    ``AutoTokenizer``. Raises OSError/ValueError as ``from_pretrained`` does."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in _GENERIC_CLASSES and (folder / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
