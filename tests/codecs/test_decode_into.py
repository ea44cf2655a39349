"""Decoding straight into caller memory (``decode_into``): the retrieve pipeline's path into an engine's
tensor. Into any destination it gives the same bits as ``decode``, writes nothing outside it, and rejects
what ``decode`` rejects."""

from __future__ import annotations

import pytest
import torch

import kvtier.codecs._blocks
import kvtier.codecs.quant
from kvtier.base.errors import CodecError
from kvtier.codecs import get_codec
from kvtier.codecs._blocks import destination_blocks
from kvtier.codecs.base import decode_into
from tests.codecs.conftest import kv_like, roundtrip
from tests.codecs.test_codecs import ALL


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaNs compare equal by their bits)."""
    return t.contiguous().view(-1).view(torch.uint8)


def decoded_both_ways(name: str, chunk: torch.Tensor,
                      margin: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(decode's result, the wider tensor decode_into wrote a token range of, that range)``."""
    codec = get_codec(name)
    ref, buf = roundtrip(codec, chunk)
    layers, two, tokens, heads, dim = chunk.shape
    wide = torch.full((layers, two, tokens + 2 * margin, heads, dim), 7.0, dtype=chunk.dtype)
    dest = wide[:, :, margin : margin + tokens]
    decode_into(codec, memoryview(buf), tuple(chunk.shape), chunk.dtype, dest)
    return ref, wide, dest


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(3, 2, 20, 2, 64), (2, 2, 7, 3, 48), (1, 2, 1, 1, 32), (1, 2, 0, 2, 64)])
def test_a_token_range_of_a_larger_tensor_gets_decodes_bits_and_nothing_else(name: str, shape) -> None:
    chunk = kv_like(shape[0], shape[2], shape[3], shape[4])
    ref, wide, dest = decoded_both_ways(name, chunk)
    assert torch.equal(bits_of(dest), bits_of(ref))
    outside = torch.cat([wide[:, :, :3], wide[:, :, 3 + shape[2] :]], dim=2)
    assert bool((outside == 7.0).all()), "decode_into wrote outside its destination"


@pytest.mark.parametrize("name", ["int8", "int4", "lossless"])
def test_blocks_inside_a_slab_and_destinations_without_contiguous_slabs(name: str, monkeypatch) -> None:
    """Slabs larger than a block are cut inside the slab; a destination whose slabs are not contiguous (here
    head-major) is decoded through a contiguous tensor. Both give decode's bits."""
    monkeypatch.setattr(kvtier.codecs._blocks, "BLOCK_ELEMS", 256)
    monkeypatch.setattr(kvtier.codecs.quant, "BLOCK_ELEMS", 256)
    chunk = kv_like(layers=2, tokens=24, heads=2, dim=64)
    ref, _, dest = decoded_both_ways(name, chunk)
    assert torch.equal(dest, ref)
    head_major = torch.zeros(2, 2, 2, 24, 64, dtype=chunk.dtype).transpose(2, 3)  # [L, 2, T, H, D] view
    assert destination_blocks(head_major, 64) is None
    _, buf = roundtrip(get_codec(name), chunk)
    decode_into(get_codec(name), memoryview(buf), tuple(chunk.shape), chunk.dtype, head_major)
    assert torch.equal(head_major, ref)


def test_destination_blocks_cover_every_item_once_in_canonical_order(monkeypatch) -> None:
    monkeypatch.setattr(kvtier.codecs._blocks, "BLOCK_ELEMS", 100)
    wide = torch.arange(2 * 2 * 10 * 3 * 8, dtype=torch.float32).view(2, 2, 10, 3, 8)
    for dest in (wide, wide[:, :, 2:5], wide[:, :, 4:10]):  # slabs of 240, 72 and 144 values
        seen = []
        for start, end, part in destination_blocks(dest, 4, 2):
            assert part.numel() == (end - start) * 4
            seen.append((start, end, part.reshape(-1).clone()))
        assert [s for s, _, _ in seen] == [0] + [e for _, e, _ in seen[:-1]]
        assert torch.equal(torch.cat([p for _, _, p in seen]), dest.reshape(-1))


@pytest.mark.parametrize("name", ALL)
def test_a_destination_of_another_shape_or_device_is_refused(name: str) -> None:
    codec = get_codec(name)
    chunk = kv_like(layers=2, tokens=4, heads=2, dim=64)
    _, buf = roundtrip(codec, chunk)
    for wrong in (torch.empty(2, 2, 5, 2, 64, dtype=chunk.dtype), torch.empty(2, 2, 4, 2, 64, device="meta")):
        with pytest.raises(CodecError):
            decode_into(codec, memoryview(buf), tuple(chunk.shape), chunk.dtype, wrong)
