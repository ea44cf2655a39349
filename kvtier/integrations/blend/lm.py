"""BlendedLM: prefix caching plus non-prefix reuse of cached segments (CacheBlend) for a transformers model.

For a prompt ``[prefix][segment A][segment B]...[query]`` whose segments are given as token spans:

1. the longest cached prefix comes from the prefix cache (exact);
2. each segment beyond it is looked up in the segment cache; hits are re-rotated to where they sit now;
3. with at least one hit, ``blended_prefill`` computes the prompt, recomputing only the reused tokens whose
   KV deviates most (or everything, when the quality gate trips); with none, the rest is prefilled normally;
4. after the first token is out: the prompt's exact leading part (up to the first reused token) is stored as
   prefix chunks, never the blended KV after it, and every segment that missed is computed alone at the base
   position and stored, ready for the next prompt that holds it, in any position.

The work one request causes is at most ``WORK_BOUND`` (3) times a plain prefill of the same prompt, counting a
forward pass as ``BlendConfig.pass_tokens`` plus the tokens it computes (a plain prefill of ``n`` tokens:
``pass_tokens + n``):

* its prefill is one pass over at most the prompt's uncached tokens (the blended pass runs each layer over at
  most those, in up to 8 blocks of at least 32 tokens that narrow attention, not add work); a prompt of more
  than ``MAX_SEGMENTS`` segments is not blended (a plain prefill, ``reason="too_many_segments"``);
* the segments computed alone afterwards are the distinct ones no tier holds (one repeated in the prompt, or
  stored meanwhile, is not computed again), longest first, each charged ``pass_tokens`` plus its length against
  what the bound leaves (twice a plain prefill, plus the prompt's cached tokens). One that does not fit is not
  computed (``kvtier_blend_skipped_segment_tokens_total``): a later prompt holding it stores it. Many tiny
  segments are what this stops: 63 one-token segments were 63 passes after a prompt of ~130 tokens, 18x a plain
  prefill's work. Twice, not once: segments cover most of a RAG prompt, so computing them alone costs about
  one more prefill plus their passes, and at first sight a prompt's documents should all be stored.
``kvtier_blend_segment_passes_total`` and ``kvtier_blend_segment_pass_tokens_total`` count that work.

A model blending does not support (see rope.py) gets a full prefill for every prompt: logged once at start,
counted per prompt in ``kvtier_blend_fallback_tokens_total{reason="unsupported"}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.base.errors import ConfigError
from kvtier.base.metrics import declare_counter
from kvtier.core.cache import KVCache
from kvtier.core.segments import MAX_SEGMENTS, SegmentCache
from kvtier.integrations.blend.config import BlendConfig
from kvtier.integrations.blend.prefill import BlendResult, ReusedSpan, blended_prefill
from kvtier.integrations.blend.rope import Rerotator, UnsupportedModel
from kvtier.integrations.transformers import (
    GenerationStats,
    Prefill,
    PrefixCachedLM,
    Span,
    has_recurrent_state,
    to_canonical,
)

log = logging.getLogger(__name__)

BLENDED_TOKENS = declare_counter("kvtier_blend_blended_tokens_total",
                                 "Prompt tokens whose KV came from cached segments and was not recomputed.")
RECOMPUTED_TOKENS = declare_counter("kvtier_blend_recomputed_tokens_total",
                                    "Reused segment tokens recomputed because their KV deviated most.")
FALLBACK_TOKENS = declare_counter("kvtier_blend_fallback_tokens_total",
                                  "Segment tokens given a full prefill instead, by reason (deviation, unsupported).",
                                  ("reason",))
SEGMENT_PASSES = declare_counter("kvtier_blend_segment_passes_total",
                                 "Segments computed alone after the first token, to be stored (a pass each).")
SEGMENT_PASS_TOKENS = declare_counter("kvtier_blend_segment_pass_tokens_total",
                                      "Tokens of the segments computed alone after the first token.")
SKIPPED_TOKENS = declare_counter("kvtier_blend_skipped_segment_tokens_total",
                                 "Tokens of missing segments not computed: past the request's work bound.")

#: One request's work (passes at ``pass_tokens`` each, plus their tokens) against a plain prefill's (module doc).
WORK_BOUND = 3


@dataclass(frozen=True)
class BlendPrefill(Prefill):
    missing: tuple[Span, ...] = ()  #: segments no tier held: computed alone and stored after the first token
    deviation: float = 0.0  #: what the quality gate measured (see BlendResult)
    gated: bool = False  #: the gate found blending unsafe: the prompt got a full prefill


def check_spans(spans: Sequence[Span], n_tokens: int) -> list[Span]:
    """Sorted, disjoint spans inside the prompt, each cut before its last token (always computed, since
    its logits are needed). Raises ConfigError for spans out of order, overlapping or out of range."""
    out: list[Span] = []
    last = 0
    for start, end in spans:
        if not 0 <= start <= end <= n_tokens or start < last:
            raise ConfigError(f"segment span ({start}, {end}) is out of order or outside the {n_tokens}-token prompt")
        last = end
        end = min(end, n_tokens - 1)
        if end > start:
            out.append((start, end))
    return out


class BlendedLM(PrefixCachedLM):
    """Generation (as PrefixCachedLM: greedy or sampled) reusing cached prefixes and cached segments wherever they
    sit in the prompt."""

    def __init__(self, model, cache: KVCache, config: BlendConfig | None = None) -> None:
        if has_recurrent_state(model):  # a segment computed alone has KV to reuse, but no SSM state to start from
            raise ConfigError(f"blending supports attention-only models; {type(model).__name__} has SSM layers "
                              "(serve it without --blend: its prefixes are still cached)")
        super().__init__(model, cache)
        self.config = config if config is not None else BlendConfig()
        self.segments = SegmentCache(cache, self.config.base_position)
        self.metrics = cache.metrics
        try:
            self.rerotator: Rerotator | None = Rerotator(model)
        except UnsupportedModel as exc:
            log.warning("blending is off for this model, every prompt gets a full prefill: %s", exc)
            self.rerotator = None

    def _prefill(self, prompt: list[int], segments: Sequence[Span], salt: bytes, stats: GenerationStats) -> Prefill:
        spans = check_spans(segments, len(prompt))
        if not spans:
            return super()._prefill(prompt, spans, salt, stats)
        if self.rerotator is None or len(spans) > MAX_SEGMENTS:
            reason = "unsupported" if self.rerotator is None else "too_many_segments"
            self.metrics.inc(FALLBACK_TOKENS, sum(e - s for s, e in spans), reason=reason)
            return super()._prefill(prompt, (), salt, stats)
        past, n_prefix = self._cached_prefix(prompt, salt, stats)
        stats.cached_tokens = n_prefix
        start = time.perf_counter()
        reused, missing = self._reuse(prompt, spans, n_prefix, salt)
        stats.retrieve_s += time.perf_counter() - start
        if not reused:
            return BlendPrefill(past, self._forward(prompt[n_prefix:], past), len(prompt), tuple(missing))
        result = blended_prefill(self.model, prompt, past, n_prefix, reused, self.config)
        self._account(result, stats)
        exact = len(prompt) if result.gated or result.recomputed == result.reused else reused[0].start
        return BlendPrefill(result.past, result.logits, exact, tuple(missing), result.deviation, result.gated)

    def _reuse(self, prompt: list[int], spans: list[Span], n_prefix: int, salt: bytes
               ) -> tuple[list[ReusedSpan], list[Span]]:
        """Cached segments beyond the prefix, re-rotated to their positions; and the spans no tier holds
        (those inside the prefix too: they are not needed now, but will be where they sit elsewhere)."""
        todo = [(s, e) for s, e in spans if e > n_prefix]
        inside = [(s, e) for s, e in spans if e <= n_prefix]
        held = self.segments.contains([prompt[s:e] for s, e in inside], salt=salt)
        missing = [span for span, hit in zip(inside, held) if not hit]
        found = self.segments.retrieve([prompt[s:e] for s, e in todo], salt=salt)
        reused = []
        for (s, e), kv in zip(todo, found):
            if kv is None:
                missing.append((s, e))
                continue
            first = max(s, n_prefix)  # a segment partly inside the cached prefix reuses only its tail
            tail = kv[:, :, first - s :].to(self.device)  # ours to modify (see SegmentCache.retrieve)
            delta = s - self.config.base_position
            reused.append(ReusedSpan(first, e, self.rerotator.shift(tail, delta, inplace=True)))
        return reused, missing

    def _account(self, result: BlendResult, stats: GenerationStats) -> None:
        if result.gated:
            log.info("blending gated: deviation %.4f > %.4f, %d reused tokens recomputed", result.deviation,
                     self.config.max_deviation, result.reused)
            self.metrics.inc(FALLBACK_TOKENS, result.reused, reason="deviation")
            return
        stats.blended_tokens = result.reused - result.recomputed
        self.metrics.inc(BLENDED_TOKENS, stats.blended_tokens)
        self.metrics.inc(RECOMPUTED_TOKENS, result.recomputed)

    def _store(self, prompt: list[int], prefill: Prefill, salt: bytes, stats: GenerationStats,
               ttl_s: float | None = None) -> None:
        super()._store(prompt, prefill, salt, stats, ttl_s)  # segments keep no retention time
        if not isinstance(prefill, BlendPrefill) or not prefill.missing:
            return
        start = time.perf_counter()
        distinct = sorted(dict.fromkeys(tuple(prompt[s:e]) for s, e in prefill.missing), key=len, reverse=True)
        held = self.segments.contains(distinct, salt=salt)  # stored meanwhile (by another request): not again
        budget = self.segment_budget(len(prompt), stats.cached_tokens)
        for tokens, hit in zip(distinct, held):
            if hit:
                continue
            cost = self.config.pass_tokens + len(tokens)
            if cost > budget:
                self.metrics.inc(SKIPPED_TOKENS, len(tokens))
                continue
            budget -= cost
            self.segments.store(tokens, self.segment_kv(list(tokens)), salt=salt)
            self.metrics.inc(SEGMENT_PASSES)
            self.metrics.inc(SEGMENT_PASS_TOKENS, len(tokens))
        stats.store_s += time.perf_counter() - start

    def segment_budget(self, n_tokens: int, n_cached: int) -> int:
        """What segments computed alone may cost (passes and tokens) after a prefill of an ``n_tokens`` prompt
        whose first ``n_cached`` came from the cache: the bound less what the prefill computed."""
        plain = self.config.pass_tokens + n_tokens
        return WORK_BOUND * plain - (self.config.pass_tokens + n_tokens - n_cached)

    @torch.inference_mode()
    def segment_kv(self, tokens: list[int]) -> torch.Tensor:
        """Canonical KV of ``tokens`` computed alone, the first at the base position (what segments cache)."""
        base = self.config.base_position
        ids = torch.tensor([tokens], device=self.device)
        positions = torch.arange(base, base + len(tokens), device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1)
        return to_canonical(out.past_key_values).cpu()
