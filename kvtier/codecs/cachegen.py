"""``cachegen``: a CacheGen-style (SIGCOMM'24) codec: rotate, quantise finely per layer, delta, entropy-code.

Per (layer, K/V, token, head) vector ``x`` of length head_dim:

1. rotate by an orthonormal Hadamard matrix (head_dim a power of two), which spreads KV's outlier channels
   so one step size fits the whole vector;
2. quantise with step ``c * rms(x)`` (never below ``max|x| / 127``, so every symbol fits in int8), stored
   as float16 rounded up. ``c`` depends on the layer and on K/V: it grows linearly from the first to the
   last layer (deeper layers coarser, as in CacheGen), separately for keys and values. Each element is
   within ``step / 2`` of its decoded value in the rotated basis (so within that bound in L2 per vector).
   Keys get finer steps than values and the slope is mild: K 0.22 -> 0.26, V 0.32 -> 0.38 (why:
   docs/benchmarks/codecs.md, from benchmarks/codecs.py);
3. per (layer, K/V) slab, replace the symbols of non-anchor tokens by their difference (mod 256) to the
   symbols of the anchor token that starts their group of ``anchor`` tokens, *when that lowers the slab's
   empirical entropy* (one flag per slab: nearby tokens' KV is only partly correlated, so some slabs gain
   and others do not);
4. entropy-code each slab's symbols with zstd level 1, whose Huffman stage stores the probability tables
   inside each slab's frame (so per layer and K/V). ANS with per-slab tables (the ``constriction`` package)
   packs slightly tighter but decodes far too slowly to keep up with a load, so zstd's Huffman coder is used.

Decoding inflates each slab into a per-thread scratch, undoes the delta coding in place and dequantises and
rotates back in one pass of a native kernel (``kvtier.codecs._dequant``: the Hadamard transform by
butterflies) straight into the destination; the torch path remains where the kernel does not fit.

Names: ``cachegen`` (anchor 16), ``cachegen-a<N>`` (anchor interval N).

Payload: ``u8 version, u8 flags (bit 0: rotated), u16 anchor, 4 x f32 (K first/last, V first/last c)``,
fp16 steps
``[L, 2, T, H]``, then per slab ``u8 delta_coded, u32 length, zstd frame of T*H*D int8 symbols``.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

from kvtier.base.errors import CodecError
from kvtier.codecs._blocks import BLOCK_ELEMS, blocks
from kvtier.codecs._dequant import dequantise_symbols_rotated
from kvtier.codecs._local import inflate_into, local, scratch
from kvtier.codecs._wire import PartsPayload, PayloadReader, can_rotate, check_canonical, fp16_scale, hadamard
from kvtier.codecs.base import check_destination

_VERSION = 1
_HEAD = struct.Struct("<BBHffff")
_SLAB = struct.Struct("<BI")
_ROTATED = 1


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """Per-thread (de)compressors: zstandard contexts are reusable but not shareable across threads."""
    return local("cachegen_zstd", lambda: (zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()))


class CacheGenCodec:
    codec_id = 4
    exact = False

    def __init__(self, anchor: int = 16, k_steps: tuple[float, float] = (0.22, 0.26),
                 v_steps: tuple[float, float] = (0.32, 0.38)) -> None:
        if not 1 <= anchor <= 65535 or not all(0.01 <= c <= 4 for c in (*k_steps, *v_steps)):
            raise CodecError(f"cachegen: bad anchor {anchor} or steps {k_steps}, {v_steps}")
        self.anchor, self.k_steps, self.v_steps = anchor, tuple(k_steps), tuple(v_steps)
        self.name = "cachegen" if anchor == 16 else f"cachegen-a{anchor}"

    def variant(self, params: str) -> CacheGenCodec:
        """``a<N>``: anchor interval N tokens, from names like ``cachegen-a8``."""
        if params.startswith("a") and params[1:].isdigit():
            return CacheGenCodec(int(params[1:]), self.k_steps, self.v_steps)
        raise CodecError(f"cachegen: unknown variant {params!r} (use a<anchor interval>)")

    def step_factors(self, layers: int) -> torch.Tensor:
        """``c`` per (layer, K/V): ``[layers, 2]``, linear from the first to the last layer."""
        t = torch.linspace(0, 1, layers) if layers > 1 else torch.zeros(1)
        k0, k1 = self.k_steps
        v0, v1 = self.v_steps
        return torch.stack([k0 + (k1 - k0) * t, v0 + (v1 - v0) * t], dim=1)

    # -- encode ----------------------------------------------------------------------------------------------
    def encode(self, chunk: torch.Tensor) -> PartsPayload:
        layers, two, tokens, heads, dim = check_canonical(tuple(chunk.shape), self.name)
        rotated, step, sym = self.symbols(chunk)
        head = _HEAD.pack(_VERSION, _ROTATED if rotated else 0, self.anchor, *self.k_steps, *self.v_steps)
        parts: list[bytes | np.ndarray] = [head, step.numpy()]
        compress = _zstd()[0].compress
        slabs = sym.view(layers * two, tokens, heads * dim)
        delta = _delta(slabs, self.anchor)
        use_delta = (_entropy(delta) < _entropy(slabs)).tolist()
        for b in range(layers * two):  # one zstd frame per slab (its own Huffman table)
            frame = compress((delta[b] if use_delta[b] else slabs[b]).numpy())
            parts += [_SLAB.pack(int(use_delta[b]), len(frame)), frame]
        return PartsPayload(parts)

    def symbols(self, chunk: torch.Tensor) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """Steps 1-2: ``(rotated, fp16 steps [L, 2, T, H], symbols as uint8 [L, 2, T, H, D])``."""
        layers, two, tokens, heads, dim = check_canonical(tuple(chunk.shape), self.name)
        if not chunk.is_floating_point():
            raise CodecError(f"{self.name} encodes floating-point KV only, got {chunk.dtype}")
        rotated = can_rotate(dim)
        x = chunk.detach().to("cpu").contiguous().view(-1, dim)
        # c per vector: the (layer, K/V) factor repeated over the slab's tokens and heads (1/dim of the chunk)
        c = self.step_factors(layers).view(-1, 1).expand(-1, tokens * heads).reshape(-1)
        step = torch.empty(x.shape[0], dtype=torch.float16)
        sym = torch.empty(x.shape, dtype=torch.int8)
        scratch = torch.empty(min(BLOCK_ELEMS + dim, x.numel()), dtype=torch.float32)
        rot = torch.empty_like(scratch) if rotated else None
        for v0, v1 in blocks(x.shape[0], dim):
            block = scratch[: (v1 - v0) * dim].view(-1, dim)
            block.copy_(x[v0:v1])
            if rot is not None:
                block = torch.matmul(block, hadamard(dim), out=rot[: block.numel()].view(-1, dim))
            self._quantise(block, c[v0:v1], step[v0:v1], sym[v0:v1])
        shape = (layers, two, tokens, heads)
        return rotated, step.view(shape), sym.view(torch.uint8).view(*shape, dim)

    def _quantise(self, x: torch.Tensor, c: torch.Tensor, step: torch.Tensor, sym: torch.Tensor) -> None:
        """Vectors ``x`` (float32, overwritten) -> fp16 ``step`` per vector and int8 ``sym``."""
        rms = torch.linalg.vector_norm(x, dim=-1).div_(x.shape[-1] ** 0.5)
        amax = torch.maximum(x.amax(-1), x.amin(-1).neg_())
        if not bool(torch.isfinite(rms).all()):  # a NaN or inf in a vector makes its norm non-finite
            raise CodecError(f"{self.name} cannot encode non-finite values")
        s16 = fp16_scale(torch.maximum(c * rms, amax / 127), self.name)
        step.copy_(s16)
        x.div_(s16.float().unsqueeze(-1)).round_()
        np.copyto(sym.numpy(), x.numpy(), casting="unsafe")  # whole numbers in [-127, 127]; ~5x torch's cast

    # -- decode ----------------------------------------------------------------------------------------------
    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        parts = self._parts(payload, shape, dtype)  # every check, before the output is allocated
        out = torch.empty(shape, dtype=dtype)
        _dequantise_into(*parts, out)
        return out

    def decode_into(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor) -> None:
        """Decode straight into ``out`` (see ``Codec``; a token range of a larger tensor) where the rotation
        kernel fits it, else through one chunk-sized temporary."""
        check_destination(out, shape, self.name)
        if not out.dtype.is_floating_point:
            raise CodecError(f"{self.name}: cannot decode into {out.dtype}")
        _dequantise_into(*self._parts(payload, shape, dtype), out)

    def _parts(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
        """``(symbols as int8 [L, 2, T, H, D], float32 steps per vector, rotated)``, checked against ``shape``."""
        layers, two, tokens, heads, dim = check_canonical(shape, self.name)
        if not dtype.is_floating_point:
            raise CodecError(f"{self.name}: cannot decode into {dtype}")
        reader = PayloadReader(payload, self.name)
        version, flags, anchor, *_steps = reader.unpack(_HEAD)
        rotated = bool(flags & _ROTATED)
        if version != _VERSION or flags & ~_ROTATED or anchor < 1 or (rotated and not can_rotate(dim)):
            raise CodecError(f"{self.name}: payload v{version}, flags {flags}, anchor {anchor} does not fit {shape}")
        steps = reader.tensor(layers * two * tokens * heads, "<f2").float()
        if not bool(torch.isfinite(steps).all()):
            raise CodecError(f"{self.name}: non-finite step sizes")
        sym = self._inflate_slabs(reader, layers * two, tokens, heads * dim, anchor)
        reader.finish()
        return sym.view(torch.int8).view(shape), steps, rotated

    def _inflate_slabs(self, reader: PayloadReader, slabs: int, tokens: int, row: int, anchor: int) -> torch.Tensor:
        """Every slab's symbols, ``[slabs, tokens, row]`` uint8 in this thread's scratch (valid until its next
        decode), delta coding undone."""
        flat = scratch("cachegen_symbols", slabs * tokens * row).reshape(slabs, tokens * row)
        decompressor = _zstd()[1]
        delta_coded = []
        for b in range(slabs):  # one zstd frame per slab: the loop is the format's, the work is zstd's
            mode, length = reader.unpack(_SLAB)
            frame = reader.take(length)
            if mode > 1:
                raise CodecError(f"{self.name}: slab {b} has mode {mode}")
            try:
                declared = zstandard.frame_content_size(frame)
            except zstandard.ZstdError as exc:
                raise CodecError(f"{self.name}: corrupt slab: {exc}") from None
            if declared != flat.shape[1]:
                raise CodecError(f"{self.name}: a slab's frame declares {declared} bytes, the shape {flat.shape[1]}")
            inflate_into(decompressor, frame, flat[b], self.name)
            if mode:
                delta_coded.append(b)
        sym = torch.from_numpy(flat).view(slabs, tokens, row)
        for b in delta_coded:
            _undelta_(sym[b], anchor)
        return sym


def _dequantise_into(sym: torch.Tensor, steps: torch.Tensor, rotated: bool, out: torch.Tensor) -> None:
    """``out`` (canonical, any strides) from int8 symbols and float32 steps: one pass of the native kernel
    (``kvtier.codecs._dequant``: butterflies instead of the matrix product, ~3x) where it fits, else the
    blocks of torch ops below, through a temporary where ``out``'s vectors are not one contiguous run."""
    if out.numel() == 0 or rotated and dequantise_symbols_rotated(out, sym, steps, out.shape[-1]):
        return
    dim = out.shape[-1]
    if out.is_contiguous():
        _dequantise(sym.view(-1, dim), steps, rotated, out.view(-1, dim))
        return
    flat = torch.empty(out.shape, dtype=out.dtype)
    _dequantise(sym.view(-1, dim), steps, rotated, flat.view(-1, dim))
    out.copy_(flat)


def _dequantise(sym: torch.Tensor, steps: torch.Tensor, rotated: bool, out: torch.Tensor) -> None:
    """``out`` (``[vectors, dim]``) = sym * step per vector, rotated back, block by block."""
    dim = sym.shape[1]
    scratch = torch.empty(min(BLOCK_ELEMS + dim, sym.numel()), dtype=torch.float32)
    back = torch.empty_like(scratch) if rotated else None
    for v0, v1 in blocks(sym.shape[0], dim):
        block = scratch[: (v1 - v0) * dim].view(-1, dim)
        block.copy_(sym[v0:v1]).mul_(steps[v0:v1, None])
        if back is not None:  # the Hadamard matrix is its own inverse
            block = torch.matmul(block, hadamard(dim), out=back[: block.numel()].view(-1, dim))
        out[v0:v1].copy_(block)


def _anchor_rows(tokens: int, anchor: int) -> torch.Tensor:
    return torch.arange(tokens) // anchor * anchor


def _delta(slabs: torch.Tensor, anchor: int) -> torch.Tensor:
    """``[slabs, tokens, row]`` symbols of non-anchor tokens minus their anchor's (uint8, wrapping); anchor
    rows unchanged."""
    base = slabs[:, _anchor_rows(slabs.shape[1], anchor)]
    base[:, ::anchor] = 0
    return slabs - base


def _undelta_(slab: torch.Tensor, anchor: int) -> None:
    """The inverse of ``_delta`` on one ``[tokens, row]`` slab, in place: each group's anchor row (stored as it
    is) added to the rows after it, wrapping like the subtraction did."""
    tokens = slab.shape[0]
    whole = tokens // anchor * anchor
    if whole:
        groups = slab[:whole].view(-1, anchor, slab.shape[1])
        groups[:, 1:] += groups[:, :1]
    if whole + 1 < tokens:  # a last, shorter group
        slab[whole + 1 :] += slab[whole]


def _entropy(slabs: torch.Tensor) -> torch.Tensor:
    """Empirical entropy in bits per symbol of each ``[slabs, ...]`` slab's uint8 symbols."""
    n = slabs.shape[0]
    offsets = torch.arange(n, dtype=torch.int32).mul_(256).view(n, 1)
    counts = torch.bincount((slabs.reshape(n, -1).to(torch.int32) + offsets).view(-1), minlength=256 * n)
    p = counts.view(n, 256).double() / slabs[0].numel()
    return -(p * p.clamp_min(1e-300).log2()).sum(1)
