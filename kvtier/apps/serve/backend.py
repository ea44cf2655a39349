"""What the HTTP layer serves: a model, its tokenizer, an optional KVCache and the engine thread.

``Backend.from_config`` loads a transformers model from a local folder (by default the packaged
SmolLM2-135M-Instruct) and wraps it in a PrefixCachedLM over a KVCache built from ``CacheConfig``, or over
no cache at all (``cache=None``: the same server without kvtier, the baseline for comparisons). With
``blend`` set it is a BlendedLM, which also reuses cached segments (chat messages, separated passages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtier.api.chat import ChatPrompt
from kvtier.api.errors import RequestError
from kvtier.api.tenants import tenant_salt  # noqa: F401  (re-exported: app.py and others import it from here)
from kvtier.apps.serve.engine import Engine
from kvtier.apps.serve.prompt_limits import encode_within, refuse_overlong_chat
from kvtier.apps.serve.segmenter import NoSegments, Segmenter
from kvtier.base.errors import ConfigError
from kvtier.base.metrics import Metrics
from kvtier.core.cache import KVCache
from kvtier.core.config import CacheConfig
from kvtier.integrations.blend import BlendConfig, BlendedLM
from kvtier.integrations.transformers import PrefixCachedLM, cache_spec, model_identity, prefix_cached_lm
from kvtier.web.body import DEFAULT_MAX_BODY_BYTES
from kvtier.web.http_limits import HttpLimits


@dataclass(frozen=True)
class ServerConfig:
    """How ``kvtier serve`` runs. ``cache=None`` serves without kvtier; ``model_path=None`` is SmolLM2.

    ``blend`` (needs a cache) turns on reuse of cached segments; ``blend_separator`` splits text prompts.
    ``http``: what one client may cost the HTTP server before a request reaches the app (see
    kvtier.web.http_limits; ``app.server_config`` enforces it). ``admin_key``: the key of the admin API
    (kvtier.api.admin; None: no admin, tenant keys may still look up and clear their own entries).
    """

    model_path: Path | None = None
    served_name: str | None = None
    cache: CacheConfig | None = field(default_factory=CacheConfig)
    max_queue: int = 16
    default_max_tokens: int = 256
    dtype: str = "float32"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  #: larger request bodies get 413 before they are read
    blend: BlendConfig | None = None
    blend_separator: str | None = None
    http: HttpLimits = HttpLimits()
    admin_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.blend is not None and self.cache is None:
            raise ConfigError("blending reuses cached segments: it needs the cache (drop --no-cache)")


class Backend:
    """Model, tokenizer, engine and metrics behind the routes. Use ``close()`` to stop the engine."""

    def __init__(self, model, tokenizer, config: ServerConfig, name: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.name = name
        self.cache = (KVCache(cache_spec(model), model_identity(model), config.cache)
                      if config.cache is not None else None)
        self.metrics = self.cache.metrics if self.cache is not None else Metrics()
        try:
            self.lm, self.segmenter = self._generator(model, tokenizer, config)
        except BaseException:  # e.g. --blend with a model it does not support: the cache's tiers are ours to close
            self._close_cache()
            raise
        self.engine = Engine(self.lm, self.metrics, max_queue=config.max_queue)
        text_config = model.config.get_text_config(decoder=True)
        self.context = int(getattr(text_config, "max_position_embeddings", 0) or 2048)
        self.vocab_size = int(text_config.vocab_size)
        self.stop_ids = sorted({i for i in (tokenizer.eos_token_id, _token_id(tokenizer, "<|im_end|>"))
                                if i is not None})

    def _generator(self, model, tokenizer, config: ServerConfig) -> tuple[PrefixCachedLM, Segmenter | NoSegments]:
        """The generator (BlendedLM with ``blend``; else prefix_cached_lm's pick) and its prompt segmenter."""
        if config.blend is not None and self.cache is not None:
            return BlendedLM(model, self.cache, config.blend), Segmenter(tokenizer, config.blend_separator)
        return prefix_cached_lm(model, self.cache), NoSegments()

    @classmethod
    def from_config(cls, config: ServerConfig) -> Backend:
        from kvtier.integrations.models import load_model

        model, tokenizer = load_model(config.model_path, dtype=config.dtype)
        name = config.served_name or (config.model_path.name if config.model_path else "SmolLM2-135M-Instruct")
        return cls(model, tokenizer, config, name)

    def close(self) -> None:
        self.engine.close()
        self._close_cache()

    def _close_cache(self) -> None:
        if self.cache is not None:
            self.cache.close()

    # -- prompts ---------------------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template, ready for the assistant's turn (without
        its cue when not ``add_generation_prompt``: the prefix the chat's later requests share)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template: use /v1/completions", param="messages")
        def encode(part: str) -> list[int]:
            return self.tokenizer.encode(part, add_special_tokens=False)

        refuse_overlong_chat(self.tokenizer.apply_chat_template, encode, messages, self.context)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        return encode_within(encode, text, self.context)

    def admin_prompt(self, prompt: str | list[int] | ChatPrompt) -> list[int]:
        """Token ids of an admin call's prompt: chat messages as the chat route renders them, text and token ids
        as the completion route takes them (kvtier.api.admin_ops's ``PromptFn``)."""
        if isinstance(prompt, ChatPrompt):
            ids = self.chat_prompt(prompt.messages, prompt.add_generation_prompt)
            if not ids:
                raise RequestError("the messages render to no tokens", param="messages")
            return ids
        return self.completion_prompt(prompt)

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt, or the given ids after a range check."""
        if isinstance(prompt, str):
            ids = encode_within(self.tokenizer.encode, prompt, self.context)
            if not ids:
                raise RequestError("prompt encodes to no tokens", param="prompt")
            return ids
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def budget(self, prompt_ids: list[int], requested: int | None) -> int:
        """Tokens to generate: ``requested`` if it fits the context, else a 400; by default what fits."""
        room = self.context - len(prompt_ids)
        if room < 1:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.context}",
                               param="prompt")
        if requested is None:
            return min(self.config.default_max_tokens, room)
        if requested > room:
            raise RequestError(f"max_tokens={requested} does not fit: the prompt has {len(prompt_ids)} tokens and "
                               f"the context is {self.context}", param="max_tokens")
        return requested


def _token_id(tokenizer, token: str) -> int | None:
    vocab = tokenizer.get_vocab()
    return vocab.get(token)


def check_model_path(path: str | None) -> Path | None:
    if path is None:
        return None
    folder = Path(path).expanduser()
    if not (folder / "config.json").exists():
        raise ConfigError(f"{folder} is not a model folder (no config.json)")
    return folder
