"""Shared helpers: synthetic KV that looks like real KV (outlier channels, a heavy first token)."""

from __future__ import annotations

import pytest
import torch

from kvtier.codecs import Codec


def kv_like(layers=3, tokens=20, heads=2, dim=64, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, 2, tokens, heads, dim, generator=gen)
    x[:, 0, :, :, :4] *= 12  # key outlier channels
    x[:, :, :1] *= 8  # an attention-sink-like first token
    return x.to(dtype)


def roundtrip(codec: Codec, chunk: torch.Tensor) -> tuple[torch.Tensor, bytearray]:
    payload = codec.encode(chunk)
    buf = bytearray(payload.nbytes)
    payload.write_into(memoryview(buf))
    return codec.decode(memoryview(buf), tuple(chunk.shape), chunk.dtype).clone(), buf


@pytest.fixture
def kv() -> torch.Tensor:
    return kv_like()
