"""Blending (non-prefix reuse) end to end on small random-weight decoders built from configs."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier import CacheConfig, KVCache
from kvtier.base.errors import ConfigError
from kvtier.integrations.blend import BlendConfig, BlendedLM, UnsupportedModel
from kvtier.integrations.blend.lm import check_spans
from kvtier.integrations.blend.rope import Rerotator
from kvtier.integrations.transformers import PrefixCachedLM, kv_spec, model_identity, to_canonical
from harness.blend_models import assemble, tiny_decoder, tokens

CHUNK = 32
SYS, A, B, C, D = tokens(20, 1), tokens(48, 2), tokens(48, 3), tokens(48, 4), tokens(40, 5)
SHORT = tokens(10, 6)  # shorter than one chunk


@pytest.fixture(scope="module")
def model():
    return tiny_decoder()


def blended(model, ratio: float = 0.5, **config) -> BlendedLM:
    cache_config = CacheConfig(chunk_size=CHUNK, tiers=[{"kind": "memory", "capacity_bytes": "64MiB"}])
    cache = KVCache(kv_spec(model), model_identity(model), cache_config)
    return BlendedLM(model, cache, BlendConfig(recompute_ratio=ratio, **config))


def reference(model, ids: list[int], n: int = 12) -> list[int]:
    return PrefixCachedLM(model, None).generate(ids, n).output_ids


def counter(lm: BlendedLM, name: str, **labels) -> float:
    return lm.metrics.get(name, **labels)


@torch.inference_mode()
def kv_at(model, ids: list[int], first_position: int) -> torch.Tensor:
    positions = torch.arange(first_position, first_position + len(ids))[None]
    return to_canonical(model(torch.tensor([ids]), position_ids=positions, use_cache=True).past_key_values)


@pytest.mark.parametrize("rope", ["default", "linear", "llama3", "yarn"])
def test_rerotated_keys_equal_keys_computed_at_the_new_position(rope):
    model = tiny_decoder(rope=rope)
    rotator = Rerotator(model)
    segment = tokens(40, 7)
    at_base = kv_at(model, segment, 0)
    for position in (1, 333, 1500):
        moved, direct = rotator.shift(at_base, position), kv_at(model, segment, position)
        assert torch.allclose(moved[:, 0], direct[:, 0], atol=2e-4, rtol=1e-4), position  # keys, every layer
        assert torch.allclose(moved[:, 1], direct[:, 1], atol=2e-4, rtol=1e-4)  # values carry no position
        assert not torch.allclose(at_base[:, 0], direct[:, 0], atol=1e-2)  # the rotation was needed
        back = rotator.shift(direct, -position)
        assert torch.allclose(back[:, 0], at_base[:, 0], atol=2e-4, rtol=1e-4)


def test_sequence_length_dependent_rope_and_other_architectures_are_refused():
    with pytest.raises(UnsupportedModel, match="dynamic"):
        Rerotator(tiny_decoder(rope="dynamic"))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    with pytest.raises(UnsupportedModel, match="gpt2"):
        Rerotator(gpt2)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_recomputing_every_token_equals_a_full_prefill(arch):
    model = tiny_decoder(arch)
    lm = blended(model, ratio=1.0)
    warm(lm, SYS, A, B, C, tokens(12, 8))  # caches A, B and C as segments
    ids, spans = assemble(SYS, C, A, B, tokens(12, 9))
    stats = lm.generate(ids, 12, segments=spans)
    assert counter(lm, "kvtier_blend_recomputed_tokens_total") == 20 + 3 * 48  # SYS is a cached segment too
    assert stats.blended_tokens == 0
    assert stats.output_ids == reference(model, ids)


def warm(lm: BlendedLM, *parts: list[int], salt: bytes = b"") -> None:
    """Run a prompt made of ``parts`` (the last one the query) so its segments get cached."""
    ids, spans = assemble(*parts)
    lm.generate(ids, 2, segments=spans, salt=salt)


def test_reordered_segments_are_reused_and_only_the_chosen_share_recomputed(model):
    lm = blended(model, ratio=0.5)
    warm(lm, SYS, A, B, C, tokens(12, 10))
    ids, spans = assemble(SYS, C, A, B, tokens(12, 11))
    stats = lm.generate(ids, 8, segments=spans)
    reused = 20 + 3 * 48
    assert counter(lm, "kvtier_blend_recomputed_tokens_total") == reused // 2
    assert stats.blended_tokens == counter(lm, "kvtier_blend_blended_tokens_total") == reused - reused // 2
    assert stats.cached_tokens == 0  # SYS is shorter than a chunk: no prefix hit
    # blended KV never enters the prefix chains: only the exact part before the first reused token does
    assert lm.cache.lookup(ids) == 0
    assert lm.cache.lookup(ids[:20]) == 0


def test_a_repeated_segment_is_reused_at_both_places(model):
    lm = blended(model)
    warm(lm, SYS, A, tokens(12, 12))
    ids, spans = assemble(SYS, B, A, A, tokens(12, 13))
    before = counter(lm, "kvtier_segment_hit_tokens_total", tier="memory")
    stats = lm.generate(ids, 2, segments=spans)
    reused = 20 + 2 * 48  # B is new
    assert stats.blended_tokens == reused - reused // 2
    assert counter(lm, "kvtier_segment_hit_tokens_total", tier="memory") - before == 48 + 20  # A once, SYS


def test_a_missing_segment_is_computed_in_place_then_cached_for_next_time(model):
    lm = blended(model, ratio=1.0)
    warm(lm, SYS, B, A, tokens(12, 14))  # not SYS, A: that would be a cached prefix of the next prompt
    ids, spans = assemble(SYS, A, D, tokens(12, 15))
    stats = lm.generate(ids, 10, segments=spans)
    assert counter(lm, "kvtier_blend_recomputed_tokens_total") == 20 + 48  # SYS and A were reused; D computed
    assert stats.output_ids == reference(model, ids, 10)
    assert lm.segments.retrieve([D])[0] is not None  # stored after the first token, computed alone
    assert torch.allclose(lm.segments.retrieve([D])[0], lm.segment_kv(D))
    again, spans = assemble(SYS, D, A, tokens(12, 16))
    lm.generate(again, 2, segments=spans)
    assert counter(lm, "kvtier_blend_recomputed_tokens_total") == 68 + 20 + 40 + 48


def test_a_segment_shorter_than_a_chunk_is_reused(model):
    lm = blended(model, ratio=1.0)
    warm(lm, SYS, SHORT, A, tokens(12, 17))
    ids, spans = assemble(SYS, A, SHORT, tokens(12, 18))
    stats = lm.generate(ids, 10, segments=spans)
    assert counter(lm, "kvtier_segment_hit_tokens_total", tier="memory") >= 48 + 10
    assert counter(lm, "kvtier_blend_recomputed_tokens_total") == 20 + 48 + 10
    assert stats.output_ids == reference(model, ids, 10)


def test_tenants_never_share_segments(model):
    lm = blended(model)
    warm(lm, SYS, A, B, tokens(12, 19), salt=b"alice")
    assert lm.segments.key(A, salt=b"alice") != lm.segments.key(A, salt=b"bob")
    ids, spans = assemble(SYS, B, A, tokens(12, 20))
    assert lm.generate(ids, 2, segments=spans, salt=b"bob").blended_tokens == 0
    assert counter(lm, "kvtier_blend_blended_tokens_total") == 0
    assert lm.generate(ids, 2, segments=spans, salt=b"alice").blended_tokens > 0


def test_a_corrupt_segment_is_a_miss_and_is_recomputed(model, tmp_path):
    config = CacheConfig(chunk_size=CHUNK, tiers=[{"kind": "disk", "path": str(tmp_path), "o_direct": False,
                                                  "fsync": False}])
    with KVCache(kv_spec(model), model_identity(model), config) as cache:
        lm = BlendedLM(model, cache, BlendConfig(recompute_ratio=0.5))
        warm(lm, SYS, A, B, tokens(12, 21))
        disk = cache.tiers[0]
        disk.flush()
        for segment in (SYS, A, B):
            (path,) = tmp_path.rglob(lm.segments.key(segment).hex())
            with open(path, "r+b") as fh:  # flip one byte of the payload
                fh.seek(-100, 2)
                byte = fh.read(1)
                fh.seek(-100, 2)
                fh.write(bytes([byte[0] ^ 0xFF]))
        ids, spans = assemble(SYS, B, A, tokens(12, 22))
        stats = lm.generate(ids, 10, segments=spans)
        assert counter(lm, "kvtier_corrupt_chunks_total", tier="disk") == 3
        assert stats.blended_tokens == 0
        assert stats.output_ids == reference(model, ids, 10)  # nothing reused: an exact prefill
        disk.flush()
        assert None not in lm.segments.retrieve([SYS, A, B])  # recomputed alone and stored again


def test_the_quality_gate_falls_back_to_a_full_prefill(model, caplog):
    lm = blended(model, ratio=0.25, max_deviation=0.0)  # any deviation left behind is too much
    warm(lm, SYS, A, B, tokens(12, 23))
    ids, spans = assemble(SYS, B, A, tokens(12, 24))
    with caplog.at_level(logging.INFO, logger="kvtier.integrations.blend.lm"):
        stats = lm.generate(ids, 12, segments=spans)
    assert "blending gated" in caplog.text
    assert counter(lm, "kvtier_blend_fallback_tokens_total", reason="deviation") == 20 + 96
    assert stats.blended_tokens == 0
    assert stats.output_ids == reference(model, ids)
    assert lm.cache.lookup(ids) == (len(ids) // CHUNK) * CHUNK  # exact KV: stored as prefix chunks


def test_naive_concatenation_recomputes_no_reused_token(model):
    lm = blended(model, ratio=0.0)
    warm(lm, SYS, A, B, tokens(12, 25))
    ids, spans = assemble(SYS, B, A, tokens(12, 26))
    stats = lm.generate(ids, 4, segments=spans)
    assert stats.blended_tokens == 20 + 96 and counter(lm, "kvtier_blend_recomputed_tokens_total") == 0


def test_the_cached_prefix_is_used_and_segments_inside_it_are_not_fetched(model):
    lm = blended(model, ratio=1.0)
    long_sys = tokens(70, 27)
    warm(lm, long_sys, A, B, tokens(12, 28))
    ids, spans = assemble(long_sys, B, A, tokens(12, 29))
    stats = lm.generate(ids, 10, segments=spans)
    assert stats.cached_tokens == 64  # two chunks of the system segment
    assert counter(lm, "kvtier_blend_recomputed_tokens_total") == 6 + 96  # its tail, then B and A
    assert stats.output_ids == reference(model, ids, 10)


def test_an_unsupported_model_gets_a_full_prefill(caplog):
    model = tiny_decoder(rope="dynamic")
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.blend.lm"):
        lm = blended(model)
    assert "blending is off" in caplog.text and "dynamic" in caplog.text
    warm(lm, SYS, A, B, tokens(12, 30))
    ids, spans = assemble(SYS, B, A, tokens(12, 31))
    stats = lm.generate(ids, 8, segments=spans)
    assert stats.blended_tokens == 0
    assert counter(lm, "kvtier_blend_fallback_tokens_total", reason="unsupported") == 2 * (20 + 96)
    assert stats.output_ids == reference(model, ids, 8)


def test_spans_are_checked_and_cut_before_the_last_token():
    assert check_spans([(0, 5), (5, 10)], 10) == [(0, 5), (5, 9)]
    assert check_spans([(3, 3), (9, 10)], 10) == []
    for bad in ([(0, 5), (4, 8)], [(5, 3)], [(0, 11)]):
        with pytest.raises(ConfigError):
            check_spans(bad, 10)


@pytest.mark.parametrize("field,value", [("recompute_ratio", 1.5), ("recompute_ratio", -0.1), ("check_layer", -1),
                                         ("max_deviation", -1.0), ("base_position", -2)])
def test_blend_config_refuses_nonsense(field, value):
    with pytest.raises(ConfigError, match=field):
        BlendConfig(**{field: value})
