"""Prompt token ids as an OpenAI-compatible server computes them, for a router that must hash the same chunks.

``kvtier serve`` (and vLLM) turn a chat request into ids by rendering the model's chat template with the
generation prompt and encoding the text without adding special tokens, and a text completion by encoding the
text with them. ``PromptTokenizer`` does exactly that from the same tokenizer files, so the router's chunk
keys equal the replica's. Loading a tokenizer needs transformers, hence this module's place.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.base.errors import ConfigError


class PromptTokenizer:
    """A model folder's tokenizer and chat template (default: the packaged SmolLM2-135M-Instruct)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        from transformers import AutoTokenizer

        from kvtier.integrations.models import ensure_smollm2

        folder = Path(path).expanduser() if path is not None else ensure_smollm2()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {folder}: {exc}") from None

    def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> list[int] | None:
        """Ids of ``messages`` (role and text content) ready for the assistant's turn; None without a template.
        With ``max_tokens``, only about that many leading ids, at a cost bounded accordingly (``encode_prefix``)."""
        tokenizer = self._tokenizer
        if not getattr(tokenizer, "chat_template", None):
            return None
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._encode(lambda part: tokenizer.encode(part, add_special_tokens=False), text, max_tokens)

    def text(self, prompt: str, max_tokens: int | None = None) -> list[int]:
        """Ids of a completion's text prompt (with ``max_tokens``, only about that many leading ones)."""
        return self._encode(self._tokenizer.encode, prompt, max_tokens)

    @staticmethod
    def _encode(encode, text: str, max_tokens: int | None) -> list[int]:
        from kvtier.integrations.tokenize import encode_prefix

        return list(encode(text)) if max_tokens is None else encode_prefix(encode, text, max_tokens)
