"""``int8`` and ``int4``: per-group affine quantisation of KV along head_dim, per token and head.

Each group of ``g`` consecutive head_dim channels of one (layer, K/V, token, head) gets a float16 scale and
an integer zero point (uint8)::

    q = clamp(round(x / scale) + zero, 0, 2**bits - 1)        x' = (q - zero) * scale

The range [min(x, 0), max(x, 0)] of the group spans ``2**bits - 1`` steps and the scale is rounded *up* to
float16, so every quantised element is within ``scale / 2`` of its decoded value (the tests check this).

``int4`` first rotates each head vector by an orthonormal Hadamard matrix (QuaRot-style; head_dim a power of
two): KV has a few outlier channels that would otherwise set every group's scale, and the rotation spreads
them over all channels. The error bound then holds in the rotated basis, i.e. per head vector in L2 norm.
int8 is not rotated; channels are not centred per chunk (docs/benchmarks/codecs.md has the measurements
behind both choices).

Storage per group of g values: g*bits/8 bytes + 2 (scale) + 1 (zero point), so with the default g = 64 a
bf16 chunk shrinks by 2 * 64 / (64 * bits / 8 + 3). Names: ``int8``, ``int4`` (g = 64), ``int4-g32`` etc.;
a group size that does not divide head_dim falls back to gcd(g, head_dim), recorded in the payload.

Decoding into a bf16, fp16 or fp32 destination with groups of a multiple of 16 values takes one pass through
a native kernel (``kvtier.codecs._dequant``): int8 bit-identical to the blocks of torch ops below, int4 with
the rotation done by butterflies; everything else is dequantised block by block here.

Payload: ``u8 version, u8 bits, u16 group, u8 flags (bit 0: rotated)`` then fp16 scales, u8 zero points
(one per group, in canonical order) and the codes (int4: two per byte, low nibble first).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from kvtier.base.errors import CodecError
from kvtier.codecs._blocks import BLOCK_ELEMS, blocks, destination_blocks
from kvtier.codecs._dequant import dequantise_int4_rotated, dequantise_int8
from kvtier.codecs._wire import PartsPayload, PayloadReader, can_rotate, check_canonical, fp16_scale, hadamard
from kvtier.codecs.base import check_destination

_VERSION = 1
_HEAD = struct.Struct("<BBHB")
_ROTATED = 1
DEFAULT_GROUP = 64


class GroupQuantCodec:
    """Per-group affine quantisation to ``bits`` (8 or 4) bits with group size ``group`` along head_dim."""

    exact = False

    def __init__(self, bits: int, group: int = DEFAULT_GROUP, rotate: bool | None = None) -> None:
        if bits not in (4, 8) or not 2 <= group <= 4096 or group % 2:
            raise CodecError(f"int{bits}: group size must be an even number in [2, 4096], got {group}")
        self.bits, self.group = bits, group
        self.rotate = bits == 4 if rotate is None else rotate
        self.codec_id = 2 if bits == 8 else 3
        self.name = f"int{bits}" if group == DEFAULT_GROUP else f"int{bits}-g{group}"

    def variant(self, params: str) -> GroupQuantCodec:
        """``g<N>``: group size N, from names like ``int4-g32``."""
        if params.startswith("g") and params[1:].isdigit():
            return GroupQuantCodec(self.bits, int(params[1:]), self.rotate)
        raise CodecError(f"int{self.bits}: unknown variant {params!r} (use g<group size>)")

    def encode(self, chunk: torch.Tensor) -> PartsPayload:
        check_canonical(tuple(chunk.shape), self.name)
        if not chunk.is_floating_point():
            raise CodecError(f"{self.name} encodes floating-point KV only, got {chunk.dtype}")
        dim = chunk.shape[-1]
        if self.bits == 4 and dim % 2:  # two codes per byte, and a (layer, K/V) slab must start on a byte
            raise CodecError(f"{self.name} needs an even head_dim, got {dim}")
        g = math.gcd(self.group, dim)
        rotated = self.rotate and can_rotate(dim)
        x = chunk.detach().to("cpu").contiguous().view(-1, g)
        scale = torch.empty(x.shape[0], dtype=torch.float16)
        zero = torch.empty(x.shape[0], dtype=torch.uint8)
        codes = torch.empty(x.numel() * self.bits // 8, dtype=torch.uint8)
        scratch = torch.empty(min(BLOCK_ELEMS + dim, x.numel()), dtype=torch.float32)
        rot = torch.empty_like(scratch) if rotated else None
        per_vector = dim // g
        for g0, g1 in blocks(x.shape[0], g, per_vector):
            block = scratch[: (g1 - g0) * g].view(-1, g)
            block.copy_(x[g0:g1])
            if rot is not None:
                torch.matmul(block.view(-1, dim), hadamard(dim), out=rot[: block.numel()].view(-1, dim))
                block = rot[: block.numel()].view(-1, g)
            self._quantise(block, scale[g0:g1], zero[g0:g1], codes[g0 * g * self.bits // 8 : g1 * g * self.bits // 8])
        head = _HEAD.pack(_VERSION, self.bits, g, _ROTATED if rotated else 0)
        return PartsPayload([head, scale.numpy(), zero.numpy(), codes.numpy()])

    def _quantise(self, x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, codes: torch.Tensor) -> None:
        """Quantise the float32 groups ``x`` (overwritten) into ``scale``, ``zero`` and packed ``codes``."""
        levels = (1 << self.bits) - 1
        lo, hi = x.amin(dim=1), x.amax(dim=1)  # not torch.aminmax: far slower on these shapes
        if not bool(torch.isfinite(hi - lo).all()):  # a NaN or inf anywhere in a group reaches its min or max
            raise CodecError(f"{self.name} cannot encode non-finite values")
        lo.clamp_(max=0.0)
        s16 = fp16_scale((hi.clamp_(min=0.0) - lo) / levels, self.name)
        scale.copy_(s16)
        s = s16.float()
        z = torch.round(-lo / s).clamp_(0, levels)
        zero.copy_(z)
        q = x.div_(s[:, None]).round_().add_(z[:, None]).clamp_(0, levels)
        if self.bits == 4:
            pairs = q.view(-1, 2)
            q = torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=pairs[:, 0])  # low nibble first; exact
        # numpy's float -> uint8 cast is ~5x torch's here (values are whole numbers in [0, 255])
        np.copyto(codes.numpy(), q.contiguous().view(-1).numpy(), casting="unsafe")

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        parts = self._parts(payload, shape, dtype)  # every check, before anything is allocated
        out = torch.empty(shape, dtype=dtype)
        self._dequantise(*parts, out)
        return out

    def decode_into(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor) -> None:
        """Decode straight into ``out`` (see ``Codec``): each block of groups is dequantised in an L2-sized
        float32 scratch and converted into its place in ``out``, with no chunk-sized temporary."""
        check_destination(out, shape, self.name)
        if not out.dtype.is_floating_point:
            raise CodecError(f"{self.name}: cannot decode into {out.dtype}")
        self._dequantise(*self._parts(payload, shape, dtype), out)

    def _parts(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
        """``(codes, scale, zero, group, rotate_dim)`` of a payload, checked to fit ``shape``/``dtype``."""
        layers, two, tokens, heads, dim = check_canonical(shape, self.name)
        if not dtype.is_floating_point:
            raise CodecError(f"{self.name}: cannot decode into {dtype}")
        reader = PayloadReader(payload, self.name)
        version, bits, g, flags = reader.unpack(_HEAD)
        rotated = bool(flags & _ROTATED)
        bad_dim = g < 1 or dim % g or (bits == 4 and dim % 2) or (rotated and not can_rotate(dim))
        if version != _VERSION or bits != self.bits or bad_dim or flags & ~_ROTATED:
            raise CodecError(f"{self.name}: payload v{version}, {bits} bits, group {g}, flags {flags} "
                             f"does not fit {shape}")
        numel = layers * two * tokens * heads * dim
        groups = numel // g
        scale = reader.tensor(groups, "<f2").float()  # per group: 1/g of the chunk, converted once
        if not bool(torch.isfinite(scale).all()):
            raise CodecError(f"{self.name}: non-finite scales")
        zero = reader.tensor(groups, np.uint8).float()
        codes = reader.tensor((numel * bits + 7) // 8, np.uint8)
        reader.finish()
        return codes, scale, zero, g, dim if rotated else 0

    def _dequantise(self, codes, scale, zero, g: int, rotate_dim: int, out: torch.Tensor) -> None:
        """``out`` (canonical) = (codes - zero) * scale, rotated back when ``rotate_dim``, block by block."""
        if out.numel() == 0:
            return
        if self.bits == 8 and not rotate_dim and dequantise_int8(out, codes, scale, zero, g):
            return  # one pass, bit-identical to the blocks below
        if self.bits == 4 and rotate_dim and dequantise_int4_rotated(out, codes, scale, zero, g, rotate_dim):
            return  # one pass, butterflies instead of a matrix product
        dim = rotate_dim or g
        scratch = torch.empty(min(BLOCK_ELEMS + dim, out.numel()), dtype=torch.float32)
        rot = torch.empty_like(scratch) if rotate_dim else None
        parts = destination_blocks(out, g, dim // g)
        flat = None
        if parts is None:  # slabs not contiguous: decode into a contiguous tensor, then one copy
            flat = torch.empty(out.shape, dtype=out.dtype)
            parts = destination_blocks(flat, g, dim // g)
        for g0, g1, dest in parts:
            block = scratch[: (g1 - g0) * g].view(-1, g)
            if self.bits == 8:
                block.copy_(codes[g0 * g : g1 * g].view(-1, g))
            else:
                packed = codes[g0 * g // 2 : g1 * g // 2]
                pairs = block.view(-1, 2)
                pairs[:, 0].copy_(packed & 0x0F)
                pairs[:, 1].copy_(packed >> 4)
            block.sub_(zero[g0:g1, None]).mul_(scale[g0:g1, None])
            if rot is not None:
                rotated = rot[: block.numel()].view(-1, dim)
                torch.matmul(block.view(-1, dim), hadamard(dim), out=rotated)  # H is its own inverse
                block = rotated
            dest.copy_(block.view(dest.shape))
        if flat is not None:
            out.copy_(flat)
