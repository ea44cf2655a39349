"""One blended prefill: a prompt whose KV is partly cached segments, computed layer by layer.

Input: the prompt's token ids, the KV of its cached prefix (exact), and spans whose KV comes from cached
segments (already re-rotated to their positions here, but computed without the rest of the prompt before
them). Every other token (the query, separators, segments that missed) is computed normally.

The model's own decoder layers run one at a time over the *active* tokens only, attending to the whole
prompt's KV, which lives in ``ScatterKV``: fresh K/V of the active tokens are written at their positions,
all other positions keep their cached K/V. As in CacheBlend (Yao et al., EuroSys'25):

1. layers ``0 .. check_layer`` compute every token of the work region (all but the cached prefix);
2. at ``check_layer`` the fresh K/V of each reused token is compared with its cached K/V; the relative
   deviation says how much the token's KV changed once the segments attend to each other;
3. the ``recompute_ratio`` share of reused tokens that deviate most stay active in the later layers, with the
   non-reused tokens; the others keep their cached K/V from there on;
4. the quality gate: if the deviation left behind (mean over the tokens that stop) exceeds ``max_deviation``,
   every token stays active, which makes the rest of the pass exactly a full prefill.

``recompute_ratio = 1`` is a full prefill; ``0`` is naive concatenation (no layer recomputes a reused token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvtier.base.layout import KVSpec
from kvtier.integrations.blend.config import BlendConfig
from kvtier.integrations.transformers import kv_spec


@dataclass(frozen=True)
class ReusedSpan:
    """Prompt positions ``[start, end)`` whose canonical KV ``[L, 2, end - start, H, D]`` comes from a cached
    segment, keys already rotated to these positions."""

    start: int
    end: int
    kv: torch.Tensor


@dataclass(frozen=True)
class BlendResult:
    past: DynamicCache  #: the whole prompt's KV, for decoding
    logits: torch.Tensor  #: next-token logits at the prompt's last position, ``[vocab]``
    reused: int  #: tokens whose KV came from cached segments
    recomputed: int  #: of those, tokens recomputed in the layers after the check layer
    deviation: float  #: mean relative K/V deviation of the reused tokens left unrecomputed (0 if none)
    gated: bool  #: the gate found the deviation too high: every token was recomputed


class ScatterKV:
    """A duck-typed transformers cache for one blended prefill.

    Holds, per layer, K and V for every prompt position (``[1, kv_heads, tokens, head_dim]``). The attention
    layers call ``update`` with the fresh K/V of the tokens being computed; they are written at
    ``positions`` (set before each call) and the K/V of positions ``[0, length)`` are returned to attend
    over. ``observe`` (when set) sees the fresh K/V before they overwrite the cached ones.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values
        self.positions = torch.empty(0, dtype=torch.long)
        self.length = 0
        self.observe = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.observe is not None:
            self.observe(layer_idx, key_states, value_states)
        keys.index_copy_(2, self.positions, key_states)
        values.index_copy_(2, self.positions, value_states)
        return keys[:, :, : self.length], values[:, :, : self.length]

    def to_dynamic_cache(self, config) -> DynamicCache:
        return DynamicCache(list(zip(self.keys, self.values)), config=config)


def _scatter_kv(prefix: DynamicCache | None, n_prefix: int, spans: list[ReusedSpan], n: int,
                spec: KVSpec, device: torch.device) -> ScatterKV:
    """Full-length K/V buffers holding the prefix and the reused spans (zeros elsewhere, computed later)."""
    keys, values = [], []
    for layer in range(spec.num_layers):
        k = torch.zeros((1, spec.num_kv_heads, n, spec.head_dim), dtype=spec.dtype, device=device)
        v = torch.zeros_like(k)
        if prefix is not None and n_prefix:
            k[:, :, :n_prefix] = prefix.layers[layer].keys[:, :, :n_prefix]
            v[:, :, :n_prefix] = prefix.layers[layer].values[:, :, :n_prefix]
        for span in spans:
            k[0, :, span.start:span.end] = span.kv[layer, 0].transpose(0, 1)
            v[0, :, span.start:span.end] = span.kv[layer, 1].transpose(0, 1)
        keys.append(k)
        values.append(v)
    return ScatterKV(keys, values)


def _causal_mask(queries: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[1, 1, queries, n]`` mask: a query at position p sees keys at positions <= p."""
    keys = torch.arange(n, device=queries.device)
    allowed = keys[None, :] <= queries[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=queries.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


#: Active tokens are computed in up to this many blocks of consecutive positions, each attending only to the
#: keys up to its last position: what a causal kernel skips, a masked one would compute and throw away.
MAX_BLOCKS, MIN_BLOCK = 8, 32


@dataclass
class _Active:
    """The tokens a layer computes: positions (sorted), hidden states, rotary cos/sin, and query blocks."""

    positions: torch.Tensor
    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __post_init__(self) -> None:
        count = max(1, min(MAX_BLOCKS, len(self.positions) // MIN_BLOCK))
        bounds = [int(b) for b in torch.linspace(0, len(self.positions), count + 1)]
        self.blocks = []
        for lo, hi in zip(bounds, bounds[1:]):
            end = int(self.positions[hi - 1]) + 1
            self.blocks.append((slice(lo, hi), end, _causal_mask(self.positions[lo:hi], end, self.hidden.dtype)))

    def keep(self, index: torch.Tensor) -> _Active:
        return _Active(self.positions[index], self.hidden[:, index], self.cos[:, index], self.sin[:, index])


def _run_layer(layer, kv: ScatterKV, active: _Active) -> torch.Tensor:
    """The layer's output for the active tokens, block by block (a block sees the fresh K/V of those before)."""
    out = []
    for part, end, mask in active.blocks:
        kv.positions, kv.length = active.positions[part], end
        out.append(layer(active.hidden[:, part], attention_mask=mask, position_ids=kv.positions[None],
                         past_key_values=kv, use_cache=True, position_embeddings=(active.cos[:, part],
                                                                                   active.sin[:, part])))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


class _Selector:
    """Observes the check layer's fresh K/V and picks the reused tokens to keep recomputing."""

    def __init__(self, kv: ScatterKV, check_layer: int, reused: torch.Tensor, config: BlendConfig) -> None:
        self.kv, self.check_layer, self.reused, self.config = kv, check_layer, reused, config
        self.parts: list[torch.Tensor] = []  # relative deviation of each active token, block by block

    def __call__(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if layer != self.check_layer:
            return
        at = self.kv.positions
        old_k = self.kv.keys[layer].index_select(2, at)
        old_v = self.kv.values[layer].index_select(2, at)
        change = (keys - old_k).float().square().sum((1, 3)) + (values - old_v).float().square().sum((1, 3))
        size = keys.float().square().sum((1, 3)) + values.float().square().sum((1, 3))
        self.parts.append((change / size.clamp_min(1e-12))[0])

    def keep(self, active: torch.Tensor) -> tuple[torch.Tensor, int, float, bool]:
        """Indices (into ``active``) to keep computing, tokens recomputed, deviation left, gate tripped."""
        deviations = torch.cat(self.parts)
        is_reused = self.reused[active]
        reused_idx = is_reused.nonzero().squeeze(1)
        n_pick = math.ceil(self.config.recompute_ratio * len(reused_idx))
        order = deviations[reused_idx].argsort(descending=True)
        picked, left = reused_idx[order[:n_pick]], reused_idx[order[n_pick:]]
        deviation = float(deviations[left].mean()) if len(left) else 0.0
        if deviation > self.config.max_deviation:
            return torch.arange(len(active), device=active.device), len(reused_idx), deviation, True
        keep = torch.cat((picked, (~is_reused).nonzero().squeeze(1))).sort().values
        return keep, n_pick, deviation, False


@torch.inference_mode()
def blended_prefill(model, prompt: list[int], prefix: DynamicCache | None, n_prefix: int,
                    spans: list[ReusedSpan], config: BlendConfig) -> BlendResult:
    """Prefill ``prompt`` reusing ``prefix`` (its first ``n_prefix`` tokens) and ``spans`` (see module doc).

    ``spans`` must be sorted, disjoint, lie in ``[n_prefix, len(prompt) - 1)``, and be non-empty.
    """
    decoder = model.get_decoder()
    n, device = len(prompt), model.device
    layers = decoder.layers
    reused = torch.zeros(n, dtype=torch.bool, device=device)
    for span in spans:
        reused[span.start:span.end] = True
    n_reused = int(reused.sum())
    check = config.check_layer
    # Selection needs a layer after the check layer to save anything; with none, everything is computed.
    selecting = 0.0 < config.recompute_ratio < 1.0 and check < len(layers) - 1
    recomputed = 0 if selecting or config.recompute_ratio == 0.0 else n_reused
    ids = torch.tensor(prompt, device=device)
    positions = torch.arange(n_prefix, n, device=device)
    if config.recompute_ratio == 0.0:  # naive concatenation: reused tokens are never computed
        positions = positions[~reused[positions]]
    hidden = decoder.embed_tokens(ids[positions])[None]
    active = _Active(positions, hidden, *decoder.rotary_emb(hidden, positions[None]))
    kv = _scatter_kv(prefix, n_prefix, spans, n, kv_spec(model), device)
    selector = _Selector(kv, check, reused, config)
    kv.observe = selector if selecting else None
    deviation, gated = 0.0, False
    for index, layer in enumerate(layers):
        active.hidden = _run_layer(layer, kv, active)
        if selecting and index == check:
            keep, recomputed, deviation, gated = selector.keep(active.positions)
            active, kv.observe = active.keep(keep), None
    hidden = active.hidden
    logits = model.get_output_embeddings()(decoder.norm(hidden[:, -1:]))[0, -1]
    return BlendResult(kv.to_dynamic_cache(model.config), logits, n_reused, recomputed, deviation, gated)
