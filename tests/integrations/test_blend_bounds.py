"""Issue 29, B-1: what one blended request can cost is bounded (segment count, repeated and stored segments)."""

from __future__ import annotations

from kvtier import CacheConfig, KVCache
from kvtier.core.segments import MAX_SEGMENTS
from kvtier.integrations.blend import BlendConfig, BlendedLM
from kvtier.integrations.transformers import kv_spec, model_identity
from tests.integrations.blend_models import tiny_decoder, tokens

SYS, DOC, QUERY = tokens(20, 1), tokens(48, 2), tokens(12, 7)


class CountingLM(BlendedLM):
    """A BlendedLM that counts the segments it computes alone (each a forward pass of its own)."""

    computed = 0

    def segment_kv(self, tokens):
        self.computed += 1
        return super().segment_kv(tokens)


def counting_lm(model) -> CountingLM:
    config = CacheConfig(chunk_size=32, tiers=[{"kind": "memory", "capacity_bytes": "64MiB"}])
    return CountingLM(model, KVCache(kv_spec(model), model_identity(model), config), BlendConfig(recompute_ratio=0.5))


def repeated(copies: int, doc: list[int] = DOC) -> tuple[list[int], list[tuple[int, int]]]:
    prompt, spans = list(SYS), []
    for _ in range(copies):
        spans.append((len(prompt), len(prompt) + len(doc)))
        prompt += doc
    return prompt + QUERY, spans


def test_a_segment_repeated_in_a_prompt_or_already_stored_is_computed_once():
    lm = counting_lm(tiny_decoder())
    prompt, spans = repeated(5)
    lm.generate(prompt, 1, segments=spans)
    assert lm.computed == 1  # five copies of one document: one segment to store
    lm.generate(SYS + QUERY + DOC + QUERY, 1, segments=[(len(SYS) + len(QUERY), len(SYS) + len(QUERY) + len(DOC))])
    assert lm.computed == 1  # stored already: reused, not computed again
    assert lm.metrics.get("kvtier_blend_blended_tokens_total") > 0


def test_a_prompt_of_too_many_segments_gets_a_plain_prefill():
    lm = counting_lm(tiny_decoder())
    short = tokens(3, 9)
    prompt, spans = repeated(MAX_SEGMENTS + 1, short)
    lm.generate(prompt, 1, segments=spans)
    assert lm.computed == 0
    assert lm.metrics.get("kvtier_blend_fallback_tokens_total", reason="too_many_segments") == 3 * (MAX_SEGMENTS + 1)
