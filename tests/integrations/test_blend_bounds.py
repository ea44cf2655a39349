"""Issue 29, B-1: what one blended request can cost is bounded (segment count, repeated and stored segments, and
the work it causes against a plain prefill of the same prompt, counted in what the model runs, not in time)."""

from __future__ import annotations

import pytest

import kvtier.integrations.blend.lm as blend_lm
from kvtier import CacheConfig, KVCache
from kvtier.core.segments import MAX_SEGMENTS
from kvtier.integrations.blend import BlendConfig, BlendedLM
from kvtier.integrations.transformers import PrefixCachedLM, kv_spec, model_identity
from harness.blend_models import assemble, tiny_decoder, tokens

SYS, DOC, QUERY = tokens(20, 1), tokens(48, 2), tokens(12, 7)


class CountingLM(BlendedLM):
    """A BlendedLM that counts the segments it computes alone (each a forward pass of its own)."""

    computed = 0

    def segment_kv(self, tokens):
        self.computed += 1
        return super().segment_kv(tokens)


def counting_lm(model, lm_class=CountingLM):
    config = CacheConfig(chunk_size=32, tiers=[{"kind": "memory", "capacity_bytes": "64MiB"}])
    return lm_class(model, KVCache(kv_spec(model), model_identity(model), config), BlendConfig(recompute_ratio=0.5))


class Work:
    """What the model runs, counted by hooks on the real model: passes (a forward of the whole model, or one
    blended prefill, which runs the layers itself) and the tokens its first decoder layer computes in them."""

    def __init__(self, model, monkeypatch) -> None:
        self.passes = self.tokens = 0
        model.register_forward_pre_hook(self._pass)
        model.get_decoder().layers[0].register_forward_pre_hook(self._layer)
        blended = blend_lm.blended_prefill

        def counted(*args, **kwargs):
            self.passes += 1
            return blended(*args, **kwargs)

        monkeypatch.setattr(blend_lm, "blended_prefill", counted)

    def _pass(self, module, args) -> None:
        self.passes += 1

    def _layer(self, module, args) -> None:
        self.tokens += args[0].shape[1]

    def cost(self, pass_tokens: int) -> int:
        return self.passes * pass_tokens + self.tokens


def plain_cost(prompt: list[int], pass_tokens: int, monkeypatch) -> int:
    """The work of a plain prefill of ``prompt`` (no cache, no segments), counted the same way."""
    model = tiny_decoder()
    work = Work(model, monkeypatch)
    PrefixCachedLM(model, None).generate(prompt, 1)
    assert work.passes == 1
    return work.cost(pass_tokens)


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


def distinct_pieces(count: int, size: int) -> list[list[int]]:
    return [list(range(i * size, (i + 1) * size)) for i in range(count)]  # no two alike


@pytest.mark.parametrize("pieces", [distinct_pieces(MAX_SEGMENTS - 1, 1), distinct_pieces(MAX_SEGMENTS - 1, 3),
                                    [DOC, *distinct_pieces(MAX_SEGMENTS - 2, 1)], distinct_pieces(7, 40)],
                         ids=["63x1", "63x3", "doc+62x1", "7x40"])  # with SYS: MAX_SEGMENTS segments at most
def test_one_request_costs_a_bounded_multiple_of_a_plain_prefill_of_the_same_prompt(pieces, monkeypatch):
    """Counted in what the model runs: 63 one-token segments used to be 63 passes after the first token, 18x a
    plain prefill's work."""
    prompt, spans = assemble(SYS, *pieces, QUERY)
    assert len(spans) <= MAX_SEGMENTS  # blended, not a plain prefill
    model = tiny_decoder()
    lm = counting_lm(model, BlendedLM)
    pass_tokens = lm.config.pass_tokens
    work = Work(model, monkeypatch)
    lm.generate(prompt, 1, segments=spans)
    assert work.cost(pass_tokens) <= blend_lm.WORK_BOUND * plain_cost(prompt, pass_tokens, monkeypatch)
    assert lm.metrics.get("kvtier_blend_segment_passes_total") == work.passes - 1  # the counters say the same
    assert lm.metrics.get("kvtier_blend_segment_pass_tokens_total") + len(prompt) == work.tokens
    # with its longest segments stored, the same prompt blends: still within the bound, and storing the rest
    again = Work(model, monkeypatch)
    lm.generate(prompt, 1, segments=spans)
    assert again.cost(pass_tokens) <= blend_lm.WORK_BOUND * plain_cost(prompt, pass_tokens, monkeypatch)


def test_the_longest_segments_are_stored_first_and_the_rest_skipped_is_counted():
    lm = counting_lm(tiny_decoder())
    tiny = distinct_pieces(MAX_SEGMENTS - 2, 1)
    prompt, spans = assemble(SYS, *tiny, DOC, QUERY)
    lm.generate(prompt, 1, segments=spans)
    assert lm.segments.contains([DOC]) == [True]  # last in the prompt, first to be stored
    stored = lm.computed - 2  # DOC and SYS
    assert lm.segments.contains([SYS]) == [True]
    assert 0 < stored < len(tiny)  # some one-token segments fit what is left of the bound, not all
    assert lm.metrics.get("kvtier_blend_skipped_segment_tokens_total") == len(tiny) - stored
