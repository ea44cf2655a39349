"""``cachegen``: a CacheGen-style (SIGCOMM'24) codec: rotate, quantise finely per layer, delta, entropy-code.

Per (layer, K/V, token, head) vector ``x`` of length head_dim:

1. rotate by an orthonormal Hadamard matrix (head_dim a power of two), which spreads KV's outlier channels
   so one step size fits the whole vector;
2. quantise with step ``c * rms(x)`` (never below ``max|x| / 127``, so every symbol fits in int8), stored
   as float16 rounded up. ``c`` depends on the layer and on K/V: it grows linearly from the first to the
   last layer (deeper layers coarser, as in CacheGen), separately for keys and values. Each element is
   within ``step / 2`` of its decoded value in the rotated basis (so within that bound in L2 per vector).
   Measured on SmolLM2 (benchmarks/codecs.py): keys are more sensitive than values, and this model's
   deeper layers are *not* less sensitive than its early ones (coarsening the second half costs more
   agreement than coarsening the first), so the default slope is mild: K 0.22 -> 0.26, V 0.32 -> 0.38;
3. per (layer, K/V) slab, replace the symbols of non-anchor tokens by their difference (mod 256) to the
   symbols of the anchor token that starts their group of ``anchor`` tokens, *when that lowers the slab's
   empirical entropy* (one flag per slab; on SmolLM2's KV over LooGLE text it does for half of the slabs
   and saves 5 % of the bytes: nearby tokens' KV is only partly correlated);
4. entropy-code each slab's symbols with zstd level 1, whose Huffman stage stores the probability tables
   inside each slab's frame (so per layer and K/V). ANS with per-slab tables (the ``constriction`` package)
   was measured too: 3 % smaller but decoding at ~14 M symbols/s, far below the 100 M/s that 200 MB/s
   of bf16 needs, so zstd's Huffman coder is used.

Names: ``cachegen`` (anchor 16), ``cachegen-a<N>`` (anchor interval N).

Payload: ``u8 version, u8 flags (bit 0: rotated), u16 anchor, 4 x f32 (K first/last, V first/last c)``,
fp16 steps
``[L, 2, T, H]``, then per slab ``u8 delta_coded, u32 length, zstd frame of T*H*D int8 symbols``.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import torch
import zstandard

from kvtier.codecs._wire import (
    PartsPayload,
    PayloadReader,
    can_rotate,
    check_canonical,
    float_chunk,
    fp16_scale,
    hadamard,
)
from kvtier.errors import CodecError

_VERSION = 1
_HEAD = struct.Struct("<BBHffff")
_SLAB = struct.Struct("<BI")
_ROTATED = 1
_LOCAL = threading.local()


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """Per-thread (de)compressors: zstandard contexts are reusable but not shareable across threads."""
    pair = getattr(_LOCAL, "pair", None)
    if pair is None:
        pair = _LOCAL.pair = (zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor())
    return pair


class CacheGenCodec:
    codec_id = 4

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
        for slab in sym.view(layers * two, tokens, heads * dim):
            delta = _delta(slab, self.anchor)
            use_delta = _entropy(delta) < _entropy(slab)
            frame = compress((delta if use_delta else slab).numpy())
            parts += [_SLAB.pack(int(use_delta), len(frame)), frame]
        return PartsPayload(parts)

    def symbols(self, chunk: torch.Tensor) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """Steps 1-2: ``(rotated, fp16 steps [L, 2, T, H], symbols as uint8 [L, 2, T, H, D])``."""
        layers, _, _, _, dim = check_canonical(tuple(chunk.shape), self.name)
        x = float_chunk(chunk, self.name)
        rotated = can_rotate(dim)
        if rotated:
            x = x @ hadamard(dim)
        rms = x.pow(2).mean(-1).sqrt_()
        amax = x.abs().amax(-1)
        c = self.step_factors(layers).view(layers, 2, 1, 1)
        step = fp16_scale(torch.maximum(c * rms, amax / 127), self.name)
        sym = torch.round(x / step.float().unsqueeze(-1)).to(torch.int8).view(torch.uint8)
        return rotated, step, sym

    # -- decode ----------------------------------------------------------------------------------------------
    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
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
        slab_len = tokens * heads * dim
        out = torch.empty(shape, dtype=dtype)
        flat_out = out.view(layers * two, tokens * heads, dim)
        scratch = torch.empty(tokens * heads, dim)
        back = torch.empty(tokens * heads, dim)
        sym_buf = torch.empty(slab_len, dtype=torch.uint8)
        sym_np = sym_buf.numpy()
        decompress = _zstd()[1].decompress
        rows = None
        for b in range(layers * two):
            delta_coded, length = reader.unpack(_SLAB)
            frame = reader.take(length)
            if delta_coded > 1:
                raise CodecError(f"{self.name}: slab {b} has mode {delta_coded}")
            sym_np[:] = np.frombuffer(_inflate(decompress, frame, slab_len), dtype=np.uint8)
            sym = sym_buf.view(tokens, heads * dim)
            if delta_coded:
                if rows is None:
                    rows = _anchor_rows(tokens, anchor)
                _undelta(sym, rows, anchor)
            scratch.view(-1).copy_(sym.view(-1).view(torch.int8))
            scratch.mul_(steps[b * tokens * heads : (b + 1) * tokens * heads, None])
            if rotated:
                torch.matmul(scratch, hadamard(dim), out=back)  # the Hadamard matrix is its own inverse
                flat_out[b].copy_(back)
            else:
                flat_out[b].copy_(scratch)
        reader.finish()
        return out


def _inflate(decompress, frame: memoryview, size: int) -> bytes:
    try:
        if zstandard.frame_content_size(frame) != size:
            raise CodecError("cachegen: a slab's frame declares another size than the shape implies")
        data = decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CodecError(f"cachegen: corrupt slab: {exc}") from None
    if len(data) != size:
        raise CodecError(f"cachegen: slab decompressed to {len(data)} bytes, expected {size}")
    return data


def _anchor_rows(tokens: int, anchor: int) -> torch.Tensor:
    return torch.arange(tokens) // anchor * anchor


def _delta(slab: torch.Tensor, anchor: int) -> torch.Tensor:
    """Symbols of non-anchor tokens minus their anchor's (uint8, wrapping); anchor rows unchanged."""
    base = slab[_anchor_rows(slab.shape[0], anchor)]
    base[::anchor] = 0
    return slab - base


def _undelta(sym: torch.Tensor, rows: torch.Tensor, anchor: int) -> None:
    base = sym[rows]
    base[::anchor] = 0
    sym.add_(base)


def _entropy(sym: torch.Tensor) -> float:
    counts = torch.bincount(sym.reshape(-1).to(torch.int64), minlength=256).double()
    p = counts[counts > 0] / sym.numel()
    return float(-(p * p.log2()).sum())
