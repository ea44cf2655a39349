"""Shared pieces of the compressed codecs: a payload built from parts, and a bounds-checked payload reader.

Payloads are untrusted: every read goes through ``PayloadReader``, which raises CodecError instead of slicing
past the end, and decoders compute every length from the declared shape before they allocate anything.
"""

from __future__ import annotations

import functools
import math
import struct
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.base.errors import CodecError

#: Largest element count a compressed codec accepts (the blob header already caps decoded bytes).
MAX_NUMEL = 1 << 33


class PartsPayload:
    """A Payload made of byte-like parts written one after the other (codecs that must encode eagerly)."""

    __slots__ = ("_nbytes", "_parts")

    def __init__(self, parts: Sequence[bytes | bytearray | memoryview | np.ndarray]) -> None:
        self._parts = [memoryview(p).cast("B") if not isinstance(p, np.ndarray)
                       else memoryview(p.reshape(-1).view(np.uint8))
                       for p in parts]
        self._nbytes = sum(p.nbytes for p in self._parts)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def write_into(self, out: memoryview) -> None:
        at = 0
        for part in self._parts:
            out[at : at + part.nbytes] = part
            at += part.nbytes


class PayloadReader:
    """Sequential reads over a payload; any read past the end, or bytes left over, is a CodecError."""

    __slots__ = ("_at", "_view", "_what")

    def __init__(self, payload: memoryview, what: str) -> None:
        self._view = payload.cast("B") if payload.format != "B" else payload
        self._at = 0
        self._what = what

    def take(self, n: int) -> memoryview:
        if n < 0 or self._at + n > self._view.nbytes:
            raise CodecError(f"{self._what} payload truncated: needs {n} bytes at {self._at} of {self._view.nbytes}")
        part = self._view[self._at : self._at + n]
        self._at += n
        return part

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack(self.take(fmt.size))

    def array(self, count: int, dtype: np.dtype | str) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(count * dt.itemsize), dtype=dt)

    def tensor(self, count: int, dtype: np.dtype | str) -> torch.Tensor:
        """``count`` items as a tensor viewing the payload (read-only: callers never write to it)."""
        arr = self.array(count, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns about read-only buffers
            return torch.from_numpy(arr)

    def finish(self) -> None:
        if self._at != self._view.nbytes:
            raise CodecError(f"{self._what} payload has {self._view.nbytes - self._at} unexpected trailing bytes")


def numel_of(shape: Sequence[int], what: str) -> int:
    numel = 1
    for dim in shape:
        if dim < 0:
            raise CodecError(f"{what}: negative dimension in {tuple(shape)}")
        numel *= dim
    if numel > MAX_NUMEL:
        raise CodecError(f"{what}: shape {tuple(shape)} is too large")
    return numel


def check_canonical(shape: Sequence[int], what: str) -> tuple[int, int, int, int, int]:
    """The five dims of a canonical chunk shape ``[layers, 2, tokens, kv_heads, head_dim]``, or CodecError."""
    if len(shape) != 5 or shape[1] != 2:
        raise CodecError(f"{what} needs a canonical [layers, 2, tokens, kv_heads, head_dim] chunk, got {tuple(shape)}")
    numel_of(shape, what)
    return tuple(int(d) for d in shape)  # type: ignore[return-value]


def fp16_scale(scale: torch.Tensor, what: str) -> torch.Tensor:
    """``scale`` rounded *up* to float16 (so a quantisation grid built on it still spans its range)."""
    # One fp16 ulp is at most 2**-10 relative; bumping first makes round-to-nearest land at or above scale.
    # A zero scale (a constant group) becomes the smallest fp16 subnormal, so decoding never divides by 0.
    s16 = (scale * (1 + 2.0**-10)).clamp_min(2.0**-24).to(torch.float16)
    if not bool(torch.isfinite(s16).all()):
        raise CodecError(f"{what}: values too large for float16 scales")
    return s16


@functools.lru_cache(maxsize=8)
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal ``n x n`` Sylvester-Hadamard matrix (``n`` a power of two), float32, symmetric."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def can_rotate(dim: int) -> bool:
    return dim >= 2 and dim & (dim - 1) == 0 and dim <= 1024

