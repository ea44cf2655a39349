"""Hugging Face transformers integration: DynamicCache <-> canonical KV, and prefix-cached greedy generation.

``PrefixCachedLM`` wraps a causal LM (batch size 1, full-attention layers) and a KVCache:

* the longest cached prefix of the prompt is retrieved (always leaving at least one token to compute, since
  the engine needs the last position's logits) and handed to the model as a ``DynamicCache``;
* only the remaining tokens are prefilled;
* the first token is yielded before the prompt's KV is stored, so storing never delays time to first token;
* decoding is greedy by default, so outputs with and without the cache are comparable token for token;
  ``sampling=SamplingParams(...)`` samples instead (sampling.py), which never changes what is cached.

Models with SSM layers (Mamba2, hybrids) keep state beyond KV: :func:`prefix_cached_lm` and
:func:`cache_spec` pick kvtier.integrations.hybrid's StatefulPrefixCachedLM and ModelStateSpec for them. That
class derives from PrefixCachedLM, so this module finds it by name in ``GENERATORS`` (a lazy registry) rather
than importing it: hybrid.py depends on this module, never the reverse.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from kvtier.base.errors import ConfigError
from kvtier.base.layout import KVSpec
from kvtier.base.registry import Registry
from kvtier.base.state import ModelStateSpec
from kvtier.core.cache import KVCache
from kvtier.integrations.sampling import GREEDY, Sampler, SamplingParams
from kvtier.native import gpu


def kv_spec(model: PreTrainedModel) -> KVSpec:
    """The KVSpec of a decoder-only model's full-attention KV cache."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError("only models whose layers all use full attention are supported")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVSpec(config.num_hidden_layers, kv_heads, head_dim, model.dtype)


def has_recurrent_state(model: PreTrainedModel) -> bool:
    """Whether ``model``'s cache has SSM (linear-attention) layers, whose state is not per-token KV."""
    past = DynamicCache(config=model.config)
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in past.layers)


def generator_class(model: PreTrainedModel) -> type[PrefixCachedLM]:
    """The generator class for ``model``: StatefulPrefixCachedLM for models with SSM layers, else PrefixCachedLM."""
    return GENERATORS["recurrent" if has_recurrent_state(model) else "attention"]


def cache_spec(model: PreTrainedModel) -> KVSpec | ModelStateSpec:
    """What a KVCache for ``model`` holds: its KVSpec, or a ModelStateSpec for models with SSM layers."""
    return generator_class(model).spec_for(model)


def prefix_cached_lm(model: PreTrainedModel, cache: KVCache | None) -> PrefixCachedLM:
    """The generator for ``model``: PrefixCachedLM, or StatefulPrefixCachedLM for models with SSM layers."""
    return generator_class(model)(model, cache)


def model_identity(model: PreTrainedModel) -> str:
    """Name (or path), revision when known, and a fingerprint of the config: what the KV bytes depend on."""
    config = model.config
    body = json.dumps(config.to_dict(), sort_keys=True, default=str).encode()
    fingerprint = hashlib.sha256(body).hexdigest()[:16]
    revision = getattr(config, "_commit_hash", None) or "local"
    return f"{config.name_or_path or type(model).__name__}@{revision}#{fingerprint}"


def to_canonical(past: DynamicCache, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Tokens ``[start, end)`` of a batch-1 DynamicCache as a new canonical ``[L, 2, T, H, D]`` tensor."""
    layers = []
    for layer in past.layers:
        keys, values = layer.keys, layer.values
        if keys is None or keys.shape[0] != 1:
            raise ConfigError("only batch size 1 caches convert to canonical KV")
        layers.append(torch.stack((keys[0, :, start:end], values[0, :, start:end])))  # [2, H, T, D]
    return torch.stack(layers).transpose(2, 3).contiguous()  # [L, 2, T, H, D]


def to_dynamic_cache(kv: torch.Tensor, model: PreTrainedModel) -> DynamicCache:
    """A DynamicCache holding canonical ``kv`` ([L, 2, T, H, D]) for batch size 1."""
    layers = [(kv[i, 0].transpose(0, 1).unsqueeze(0), kv[i, 1].transpose(0, 1).unsqueeze(0))
              for i in range(kv.shape[0])]
    return DynamicCache(layers, config=model.config)


class DynamicCacheSource:
    """A DynamicCache as a kvtier KVSource."""

    def __init__(self, past: DynamicCache) -> None:
        self.past = past
        keys = past.layers[0].keys if past.layers else None
        self.device = keys.device if keys is not None else torch.device("cpu")  # a model on a GPU: chunks there

    def chunk(self, start: int, end: int) -> torch.Tensor:
        kv = to_canonical(self.past, start, end)
        if kv.device.type == "cuda":  # computed on this thread's stream: kvtier's copy waits for it there
            gpu.ready_after(kv, torch.cuda.current_stream(kv.device))
        return kv


#: ``(start, end)``: a span of prompt tokens (a reusable segment, for blending).
Span = tuple[int, int]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  #: prompt tokens whose KV came from kvtier
    blended_tokens: int = 0  #: prompt tokens whose KV came from cached segments, not recomputed (BlendedLM)
    ttft_s: float = 0.0  #: lookup + retrieve + prefill of the rest + first token
    retrieve_s: float = 0.0
    store_s: float = 0.0
    total_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Prefill:
    """What a prompt's prefill leaves for decoding and for storing."""

    past: DynamicCache
    logits: torch.Tensor  #: next-token logits after the prompt's last token, ``[vocab]``
    exact_tokens: int  #: leading prompt tokens whose KV equals a full prefill's: what may be stored as prefix


class PrefixCachedLM:
    """Generation (greedy unless sampling is asked for) for one causal LM, reusing prompt prefixes through a
    KVCache (or none)."""

    #: Subclasses that restore SSM state set this; this class would silently drop it.
    keeps_recurrent_state = False

    def __init__(self, model: PreTrainedModel, cache: KVCache | None) -> None:
        if not self.keeps_recurrent_state and has_recurrent_state(model):
            raise ConfigError(f"{type(model).__name__} has SSM layers: use prefix_cached_lm(model, cache)")
        self.model = model
        self.cache = cache
        self.device = model.device

    @classmethod
    def spec_for(cls, model: PreTrainedModel) -> KVSpec | ModelStateSpec:
        """What a KVCache for ``model`` holds when this class generates for it: its attention KV."""
        return kv_spec(model)

    @classmethod
    def with_new_cache(cls, model: PreTrainedModel, config=None, **kwargs) -> PrefixCachedLM:
        """A generator for ``model`` over a new KVCache (the stateful one for models with SSM layers)."""
        cache = KVCache(cache_spec(model), model_identity(model), config, **kwargs)
        return prefix_cached_lm(model, cache) if cls is PrefixCachedLM else cls(model, cache)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, salt: bytes = b"",
                 stop_ids: Sequence[int] = (), sampling: SamplingParams = GREEDY,
                 segments: Sequence[Span] = (), ttl_s: float | None = None) -> GenerationStats:
        stats = GenerationStats()
        for _ in self.stream(prompt_ids, max_new_tokens, salt=salt, stop_ids=stop_ids, stats=stats,
                             sampling=sampling, segments=segments, ttl_s=ttl_s):
            pass
        return stats

    @torch.inference_mode()
    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int, *, salt: bytes = b"",
               stop_ids: Sequence[int] = (), stats: GenerationStats | None = None,
               sampling: SamplingParams = GREEDY, segments: Sequence[Span] = (),
               ttl_s: float | None = None) -> Iterator[int]:
        """Yield generated token ids one by one; ``stats`` (if given) is filled in as generation proceeds.

        Generation stops after ``max_new_tokens`` or after yielding a token in ``stop_ids``. Tokens are chosen
        by ``sampling`` (greedy by default); the prompt's KV stored in the cache is the same either way.
        ``segments`` are the prompt's reusable passages as token spans; only a blending subclass (BlendedLM)
        uses them. ``ttl_s``: the stored prompt KV expires that many seconds later (``KVCache.store``).
        """
        sampler = Sampler(sampling)
        stats = stats if stats is not None else GenerationStats()
        prompt = list(prompt_ids)
        begin = time.perf_counter()
        prefill = self.prefill(prompt, salt=salt, segments=segments, stats=stats)
        past = prefill.past
        token = sampler.choose(prefill.logits)
        stats.ttft_s = time.perf_counter() - begin
        for step in range(max_new_tokens):
            stats.output_ids.append(token)
            yield token
            if step == 0:
                self._store(prompt, prefill, salt, stats, ttl_s)
            if token in stop_ids or step + 1 == max_new_tokens:
                break
            logits = self._decode(token, len(prompt) + step, past)
            token = sampler.choose(logits[0, -1])
        stats.total_s = time.perf_counter() - begin

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int], *, salt: bytes = b"", segments: Sequence[Span] = (),
                stats: GenerationStats | None = None) -> Prefill:
        """The prompt's KV and next-token logits, reusing what the cache holds. Stores nothing (``stream``
        stores after the first token). ``stats`` (if given) gets the prompt, cached and blended token counts."""
        prompt = list(prompt_ids)
        if not prompt:
            raise ConfigError("the prompt must hold at least one token")
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(prompt)
        return self._prefill(prompt, segments, salt, stats)

    def _prefill(self, prompt: list[int], segments: Sequence[Span], salt: bytes, stats: GenerationStats) -> Prefill:
        """The prompt's KV and next-token logits: its cached prefix, then a prefill of the rest."""
        past, n_cached = self._cached_prefix(prompt, salt, stats)
        stats.cached_tokens = n_cached
        return Prefill(past, self._prefill_rest(prompt, n_cached, past), len(prompt))

    def _prefill_rest(self, prompt: list[int], start: int, past: DynamicCache) -> torch.Tensor:
        """The next-token logits after computing ``prompt[start:]`` into ``past`` (a hook for stateful models)."""
        return self._forward(prompt[start:], past)

    def _forward(self, ids: list[int], past: DynamicCache) -> torch.Tensor:
        """Run ``ids`` after ``past`` (extending it); the next-token logits after the last one."""
        # logits_to_keep=1: the LM head only for the last position (for a 49k vocabulary it would otherwise
        # cost as much as a good part of the prefill).
        inputs = torch.tensor([ids], device=self.device)
        return self.model(input_ids=inputs, past_key_values=past, use_cache=True, logits_to_keep=1).logits[0, -1]

    def _decode(self, token: int, position: int, past: DynamicCache) -> torch.Tensor:
        """Logits after feeding ``token``, the sequence's ``position``-th, into ``past``."""
        return self.model(input_ids=torch.tensor([[token]], device=self.device), past_key_values=past,
                          use_cache=True).logits

    def _cached_prefix(self, prompt: list[int], salt: bytes, stats: GenerationStats) -> tuple[DynamicCache, int]:
        if self.cache is None:
            return DynamicCache(config=self.model.config), 0
        start = time.perf_counter()
        kv, n = self.cache.retrieve(prompt, salt=salt, max_tokens=len(prompt) - 1)
        stats.retrieve_s = time.perf_counter() - start
        if n == 0 or kv is None:
            return DynamicCache(config=self.model.config), 0
        return to_dynamic_cache(kv[:, :, :n].to(self.device), self.model), n

    def _store(self, prompt: list[int], prefill: Prefill, salt: bytes, stats: GenerationStats,
               ttl_s: float | None = None) -> None:
        if self.cache is None:
            return
        start = time.perf_counter()
        self.cache.store(prompt[: prefill.exact_tokens], DynamicCacheSource(prefill.past), salt=salt, ttl_s=ttl_s)
        stats.store_s = time.perf_counter() - start


#: The generator class for each kind of model ("attention": every layer full attention; "recurrent": some
#: layers keep SSM state), resolved on first use.
GENERATORS: Registry[type[PrefixCachedLM]] = Registry("generator")
GENERATORS.register("attention", __name__, "PrefixCachedLM")
GENERATORS.register("recurrent", "kvtier.integrations.hybrid", "StatefulPrefixCachedLM")
