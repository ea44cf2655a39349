"""transformers models with SSM layers (pure Mamba2 and hybrids: Bamba, Granite 4 hybrids, Falcon-H1, Jamba,
Nemotron-H, ...): their cache <-> kvtier's attention KV and state snapshots, and prefix-cached generation.

transformers keeps such a model's state in one ``Cache``: attention layers hold KV (``layer.keys`` /
``layer.values``), SSM layers a convolution state and an SSM state per state slot (``conv_states[i]`` /
``recurrent_states[i]``), hybrid layers both. :func:`probe_layout` finds out which layer holds what by running
one token through the model, and derives the model's :class:`ModelStateSpec`.

**Exactness.** A prefill's result depends, in the last bits, on where the prompt is split: the SSM's chunked
scan and the attention kernels round differently for a different split. So :class:`StatefulPrefixCachedLM`
prefills every prompt in segments that end at every chunk boundary, cached or not: the state at boundary
``k`` is then the same bits however the request got there (restored at some earlier boundary or computed
from the start), and a continuation from a restored boundary repeats exactly the computation of generation
without the cache. Generation with and without kvtier gives identical greedy tokens (identical logits).
Positions are passed explicitly: some hybrids (Bamba) would otherwise restart them at 0 on every call.
"""

from __future__ import annotations

import inspect
import time
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from kvtier.base.errors import ConfigError
from kvtier.base.layout import KVSpec
from kvtier.base.state import ModelStateSpec, StateKind, StateSpec
from kvtier.core.cache import KVCache
from kvtier.core.snapshots import PrefixState, Snapshot
from kvtier.integrations.transformers import GenerationStats, Prefill, PrefixCachedLM

Slot = tuple[int, int]  #: (layer index, state index within the layer)


@dataclass(frozen=True)
class CacheLayout:
    """Where one model's prefix state lives in its transformers cache, and how to call the model."""

    spec: ModelStateSpec
    attention: tuple[int, ...]  #: layers holding attention KV
    slots: dict[StateKind, tuple[Slot, ...]]  #: per state kind, the slots its snapshot stacks, in order
    cache_arg: str  #: the forward argument that takes the cache (Mamba2: cache_params)
    takes_positions: bool  #: whether forward accepts position_ids

    def snapshot(self, past: DynamicCache) -> dict[StateKind, torch.Tensor]:
        """A copy of every state kind of ``past`` (batch size 1), stacked ``[slots, *shape]``."""
        out = {}
        for kind, slots in self.slots.items():
            states = [_state(past.layers[layer], kind)[index] for layer, index in slots]
            out[kind] = torch.cat(states).to("cpu", copy=True)
        return out

    def kv(self, past: DynamicCache, start: int, end: int) -> torch.Tensor:
        """Canonical attention KV ``[L, 2, T, H, D]`` of tokens ``[start, end)`` of ``past`` (a new tensor)."""
        layers = [torch.stack((past.layers[i].keys[0, :, start:end], past.layers[i].values[0, :, start:end]))
                  for i in self.attention]
        return torch.stack(layers).transpose(2, 3).contiguous()

    def restore(self, model: PreTrainedModel, prefix: PrefixState) -> SnapshottingCache:
        """A fresh cache holding ``prefix``: its attention KV and, in every SSM slot, its snapshot."""
        past = SnapshottingCache(config=model.config)
        device = model.device
        if prefix.kv is not None:
            for n, layer in enumerate(self.attention):
                kv = prefix.kv[n].to(device)
                past.layers[layer].update(kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0))
        for (layer, index), conv in zip(self.slots.get(StateKind.CONV, ()), prefix.states.get(StateKind.CONV, ())):
            past.layers[layer].update_conv_state(conv.unsqueeze(0).to(device), index,
                                                 conv_kernel_size=conv.shape[-1])
        for (layer, index), ssm in zip(self.slots.get(StateKind.SSM, ()), prefix.states.get(StateKind.SSM, ())):
            past.layers[layer].update_recurrent_state(ssm.unsqueeze(0).to(device), index)
        if prefix.states:  # the restored state is the past: the next forward continues it, not a fresh prefill
            for layer, index in {slot for slots in self.slots.values() for slot in slots}:
                past.layers[layer].has_previous_state[index] = True
        return past


class SnapshottingCache(DynamicCache):
    """A DynamicCache that also carries the state snapshots taken while prefilling into it, keyed by
    boundary (in chunks), so that they are stored with the request that computed them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.snapshots: dict[int, Snapshot] = {}


def _state(layer, kind: StateKind) -> dict[int, torch.Tensor | None]:
    return layer.conv_states if kind is StateKind.CONV else layer.recurrent_states


_LAYOUTS: weakref.WeakKeyDictionary[PreTrainedModel, CacheLayout] = weakref.WeakKeyDictionary()


def probe_layout(model: PreTrainedModel) -> CacheLayout:
    """Where ``model``'s cache keeps KV and SSM state (probed once per model object)."""
    layout = _LAYOUTS.get(model)
    if layout is None:
        layout = _LAYOUTS[model] = _probe(model)
    return layout


@torch.inference_mode()
def _probe(model: PreTrainedModel) -> CacheLayout:
    """Run one token through ``model`` and read off where its cache keeps KV and SSM state."""
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache_params" if "cache_params" in params else "past_key_values"
    past = DynamicCache(config=model.config)
    model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device), use_cache=True, **{cache_arg: past})
    attention = tuple(i for i, layer in enumerate(past.layers)
                      if isinstance(layer, CacheLayerMixin) and getattr(layer, "keys", None) is not None
                      and layer.keys.numel())
    if any(past.layers[i].is_sliding for i in attention):
        raise ConfigError("sliding-window attention layers are not supported (their KV is not kept per token)")
    slots = {kind: tuple((i, s) for i, layer in enumerate(past.layers)
                         if isinstance(layer, LinearAttentionCacheLayerMixin)
                         for s, state in _state(layer, kind).items() if state is not None)
             for kind in (StateKind.CONV, StateKind.SSM)}
    slots = {kind: found for kind, found in slots.items() if found}
    states = tuple(_state_spec(kind, [_state(past.layers[i], kind)[s] for i, s in found])
                   for kind, found in slots.items())
    kv = _kv_spec([past.layers[i].keys for i in attention]) if attention else None
    spec = ModelStateSpec(kv, states)
    return CacheLayout(spec, attention, slots, cache_arg, "position_ids" in params)


def _uniform(kind: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    first = tensors[0]
    if first.shape[0] != 1 or any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        raise ConfigError(f"{kind}: layers with different shapes or dtypes are not supported")
    return first


def _state_spec(kind: StateKind, tensors: list[torch.Tensor]) -> StateSpec:
    first = _uniform(f"{kind.value} state", tensors)
    return StateSpec(kind, len(tensors), tuple(first.shape[1:]), first.dtype)


def _kv_spec(keys: list[torch.Tensor]) -> KVSpec:
    first = _uniform("attention KV", keys)  # [1, kv_heads, tokens, head_dim]
    return KVSpec(len(keys), first.shape[1], first.shape[3], first.dtype)


def model_state_spec(model: PreTrainedModel) -> ModelStateSpec:
    """The ModelStateSpec of a model with SSM layers (its attention KV, if any, and its state kinds)."""
    return probe_layout(model).spec


class StatefulPrefixCachedLM(PrefixCachedLM):
    """PrefixCachedLM for models with SSM layers: restores KV plus state snapshots, prefills through every
    chunk boundary (see the module docstring) and stores snapshots where the cache's SnapshotPolicy says."""

    keeps_recurrent_state = True

    @classmethod
    def spec_for(cls, model: PreTrainedModel) -> ModelStateSpec:
        """What a KVCache for ``model`` holds: its attention KV (if any) and its state kinds."""
        return model_state_spec(model)

    def __init__(self, model: PreTrainedModel, cache: KVCache | None, *, chunk_size: int | None = None) -> None:
        """``chunk_size`` sets the prefill segments without a cache (default 256); with one it must be the
        cache's. Generation is identical with and without the cache only at the same chunk size."""
        super().__init__(model, cache)
        self.layout = probe_layout(model)
        if cache is not None and cache.model_spec != self.layout.spec:
            raise ConfigError(f"the cache holds {cache.model_spec}, but the model's state is {self.layout.spec}")
        if cache is not None and chunk_size not in (None, cache.chunk_size):
            raise ConfigError(f"chunk_size {chunk_size} differs from the cache's {cache.chunk_size}")
        self.chunk_size = cache.chunk_size if cache is not None else (chunk_size or 256)

    def _cached_prefix(self, prompt: list[int], salt: bytes, stats: GenerationStats) -> tuple[DynamicCache, int]:
        if self.cache is None:
            return SnapshottingCache(config=self.model.config), 0
        start = time.perf_counter()
        prefix = self.cache.retrieve_states(prompt, salt=salt, max_tokens=len(prompt) - 1)
        stats.retrieve_s = time.perf_counter() - start
        return self.layout.restore(self.model, prefix), prefix.tokens

    def _prefill_rest(self, prompt: list[int], start: int, past: DynamicCache) -> torch.Tensor:
        """Compute ``prompt[start:]`` segment by segment, each ending at a chunk boundary (or the prompt's end),
        snapshotting the state at the boundaries the snapshot policy picks; the next-token logits."""
        size = self.chunk_size
        wanted = set(self._snapshot_boundaries(start // size, len(prompt)))
        ends = [*range((start // size + 1) * size, len(prompt), size), len(prompt)]
        logits = None
        for begin, end in zip([start, *ends[:-1]], ends):
            logits = self._run(prompt[begin:end], begin, past, last_only=True)
            if end % size == 0 and end // size in wanted and isinstance(past, SnapshottingCache):
                past.snapshots[end // size] = self.layout.snapshot(past)
        return logits[0, -1]

    def _snapshot_boundaries(self, cached: int, prompt_tokens: int) -> list[int]:
        if self.cache is None:
            return []
        return self.cache.config.state_snapshots.boundaries(cached, prompt_tokens, self.chunk_size)

    def _decode(self, token: int, position: int, past: DynamicCache) -> torch.Tensor:
        return self._run([token], position, past, last_only=False)

    def _run(self, ids: list[int], position: int, past: DynamicCache, *, last_only: bool) -> torch.Tensor:
        kwargs = {self.layout.cache_arg: past}
        if self.layout.takes_positions:
            kwargs["position_ids"] = torch.arange(position, position + len(ids), device=self.device)[None]
        if last_only:
            kwargs["logits_to_keep"] = 1
        return self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, **kwargs).logits

    def _store(self, prompt: list[int], prefill: Prefill, salt: bytes, stats: GenerationStats,
               ttl_s: float | None = None) -> None:
        if self.cache is None:
            return
        start = time.perf_counter()
        past = prefill.past
        if self.layout.attention:  # the KV expires after ttl_s; snapshots keep no retention time
            self.cache.store(prompt, _LayoutSource(self.layout, past), salt=salt, ttl_s=ttl_s)
        snapshots = getattr(past, "snapshots", {})
        if snapshots:
            self.cache.store_states(prompt, snapshots, salt=salt)
            snapshots.clear()
        stats.store_s = time.perf_counter() - start


class _LayoutSource:
    """The attention KV of a hybrid model's cache as a kvtier KVSource."""

    def __init__(self, layout: CacheLayout, past: DynamicCache) -> None:
        self.layout, self.past = layout, past

    def chunk(self, start: int, end: int) -> torch.Tensor:
        return self.layout.kv(self.past, start, end)
