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

from kvtier.codecs._blocks import BLOCK_ELEMS, blocks
from kvtier.codecs._wire import PartsPayload, PayloadReader, can_rotate, check_canonical, fp16_scale, hadamard
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
        out = torch.empty(shape, dtype=dtype)
        if out.numel():
            _dequantise(sym.view(torch.int8).view(-1, dim), steps, rotated, out.view(-1, dim))
        return out

    def _inflate_slabs(self, reader: PayloadReader, slabs: int, tokens: int, row: int, anchor: int) -> torch.Tensor:
        """Every slab's symbols, ``[slabs, tokens, row]`` uint8, delta coding undone."""
        sym = torch.empty(slabs, tokens, row, dtype=torch.uint8)
        flat = sym.view(slabs, -1).numpy()
        decompress = _zstd()[1].decompress
        delta_coded = []
        for b in range(slabs):  # one zstd frame per slab: the loop is the format's, the work is zstd's
            mode, length = reader.unpack(_SLAB)
            frame = reader.take(length)
            if mode > 1:
                raise CodecError(f"{self.name}: slab {b} has mode {mode}")
            flat[b] = np.frombuffer(_inflate(decompress, frame, flat.shape[1]), dtype=np.uint8)
            if mode:
                delta_coded.append(b)
        if delta_coded:
            idx = torch.tensor(delta_coded)
            sym[idx] = _undelta(sym[idx], anchor)
        return sym


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


def _delta(slabs: torch.Tensor, anchor: int) -> torch.Tensor:
    """``[slabs, tokens, row]`` symbols of non-anchor tokens minus their anchor's (uint8, wrapping); anchor
    rows unchanged."""
    base = slabs[:, _anchor_rows(slabs.shape[1], anchor)]
    base[:, ::anchor] = 0
    return slabs - base


def _undelta(slabs: torch.Tensor, anchor: int) -> torch.Tensor:
    """The inverse of ``_delta`` (in place; anchor rows are stored as they are, so they come first)."""
    base = slabs[:, _anchor_rows(slabs.shape[1], anchor)]
    base[:, ::anchor] = 0
    return slabs.add_(base)


def _entropy(slabs: torch.Tensor) -> torch.Tensor:
    """Empirical entropy in bits per symbol of each ``[slabs, ...]`` slab's uint8 symbols."""
    n = slabs.shape[0]
    offsets = torch.arange(n, dtype=torch.int32).mul_(256).view(n, 1)
    counts = torch.bincount((slabs.reshape(n, -1).to(torch.int32) + offsets).view(-1), minlength=256 * n)
    p = counts.view(n, 256).double() / slabs[0].numel()
    return -(p * p.clamp_min(1e-300).log2()).sum(1)
