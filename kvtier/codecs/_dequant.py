"""int8, int4 and cachegen dequantisation in one pass, straight into the destination: ``out = (code - zero) *
scale`` per group (cachegen: ``symbol * step`` per vector), and for int4 and cachegen each head vector
rotated back by the Hadamard transform.

torch does it in passes over an L2-sized float32 scratch (codes to float, minus the zero point, times the
scale, for the rotating codecs a 64x64 matrix product per head vector, converted into place), each a call
that holds the GIL between its kernels. These kernels read each code once and write each value once, without
the GIL. int8 is a numba kernel (``kvtier.codecs._dequant_kernels``): float32 arithmetic in torch's order,
rounded to the destination dtype as torch rounds (to nearest, ties to even), so the bytes are identical to the
torch path's. int4 and cachegen are LLVM IR (``kvtier.native.kernels``), kept because the same loops in numba
ran at a fraction of its speed (docs/kernels.md): the rotation is the fast Walsh-Hadamard transform
(butterflies: log2(dim) additions per value instead of dim multiply-adds), whose strides 1, 2, 4 and 8 the IR
does as shuffles inside one 16-lane vector register, which LLVM's vectoriser does not find in loops; the rest
across a stack buffer of the head vector, scaled by 1/sqrt(dim) at the end. It agrees with torch's matrix
product to float32 rounding (on SmolLM2's 64-dim heads, to the bit).

Handled: bf16, fp16 and fp32 destinations whose runs hold whole groups (int8) or head vectors (int4,
cachegen; dim a power of two from 16 to 1024) of a token range of canonical KV, groups a multiple of 16
values. Otherwise the codec uses torch.
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np
import torch
from torch.autograd.graph import increment_version

from kvtier.native import kernels

_LANES = 16
_OUT_TYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
# the numba kernel's destination: bits of these widths, converted as _dequant_kernels' F32, F16, BF16 say
_BITS = {torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.float32: np.uint32}
_KINDS = {torch.bfloat16: 2, torch.float16: 1, torch.float32: 0}
_Fn4 = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float)
_lock = threading.Lock()
_built: dict[str, ctypes._CFuncPtr] | None = None
_tried = False


def _store(kind: str, first: str) -> str:
    """IR that converts ``%v`` (<16 x float>) and stores it at element ``first`` (an i64 value) of the run
    ``%d`` starts."""
    size = {"f32": 4, "f16": 2, "bf16": 2}[kind]
    at = f"""  %off = mul i64 {first}, {size}
  %dp = getelementptr i8, ptr %d, i64 %off
"""
    if kind == "f32":
        return at + "  store <16 x float> %v, ptr %dp, align 4"
    if kind == "f16":
        return at + "  %h = fptrunc <16 x float> %v to <16 x half>\n  store <16 x half> %h, ptr %dp, align 2"
    splat = lambda x: "<" + ", ".join([f"i32 {x}"] * _LANES) + ">"  # noqa: E731
    return at + f"""  %bits = bitcast <16 x float> %v to <16 x i32>
  %sh = lshr <16 x i32> %bits, {splat(16)}
  %lsb = and <16 x i32> %sh, {splat(1)}
  %bias = add <16 x i32> %lsb, {splat(0x7FFF)}
  %rounded = add <16 x i32> %bits, %bias
  %top = lshr <16 x i32> %rounded, {splat(16)}
  %b16 = trunc <16 x i32> %top to <16 x i16>
  store <16 x i16> %b16, ptr %dp, align 2"""


def _in_register_butterflies(src: str) -> tuple[str, str]:
    """IR of the Hadamard butterflies of strides 1, 2, 4 and 8 inside one <16 x float> (the Sylvester order:
    lane ``i`` with the stride's bit clear becomes ``v[i] + v[i + h]``, with it set ``v[i - h] - v[i]``),
    and the name of the result."""
    lines, cur = [], src
    for h in (1, 2, 4, 8):
        first = ", ".join(f"i32 {i if not i & h else i - h}" for i in range(_LANES))
        second = ", ".join(f"i32 {i + h if not i & h else i}" for i in range(_LANES))
        clear = ", ".join("i1 true" if not i & h else "i1 false" for i in range(_LANES))
        lines.append(f"""  %fa{h} = shufflevector <16 x float> {cur}, <16 x float> poison, <16 x i32> <{first}>
  %fb{h} = shufflevector <16 x float> {cur}, <16 x float> poison, <16 x i32> <{second}>
  %fs{h} = fadd <16 x float> %fa{h}, %fb{h}
  %fd{h} = fsub <16 x float> %fa{h}, %fb{h}
  %fw{h} = select <16 x i1> <{clear}>, <16 x float> %fs{h}, <16 x float> %fd{h}""")
        cur = f"%fw{h}"
    return "\n".join(lines), cur


def _ir_rotated(kind: str, codes: str) -> str:
    """``dequant4r_<kind>(runs, codes, scales, zeros, run_elems, count, group, dim, norm)`` (``codes`` "u4":
    two codes per byte, low nibble first, minus a zero point) or ``dequants8r_<kind>`` (``codes`` "s8": one
    signed byte per value, no zero point; ``zeros`` unused): as int8's, then each head vector of ``dim``
    values (a power of two, 16 to 1024) rotated back by the Sylvester-Hadamard transform (butterflies, not a
    matrix product) times ``norm`` (1/sqrt(dim)), in a stack buffer of 1024 floats."""
    interleave = ", ".join(f"i32 {i // 2 + (8 if i % 2 else 0)}" for i in range(_LANES))
    splat = lambda x: "<" + ", ".join([f"i8 {x}"] * 8) + ">"  # noqa: E731
    if codes == "u4":
        name = f"dequant4r_{kind}"
        load = f"""  %byte = lshr i64 %a, 1
  %bp = getelementptr i8, ptr %codes, i64 %byte
  %packed = load <8 x i8>, ptr %bp, align 1
  %low = and <8 x i8> %packed, {splat(15)}
  %high = lshr <8 x i8> %packed, {splat(4)}
  %nib = shufflevector <8 x i8> %low, <8 x i8> %high, <16 x i32> <{interleave}>
  %cf = uitofp <16 x i8> %nib to <16 x float>
  %zp = getelementptr float, ptr %zeros, i64 %q
  %z = load float, ptr %zp
{kernels.broadcast("%zv", "%z")}
  %diff = fsub <16 x float> %cf, %zv"""
    else:
        name = f"dequants8r_{kind}"
        load = """  %bp = getelementptr i8, ptr %codes, i64 %a
  %packed = load <16 x i8>, ptr %bp, align 1
  %diff = sitofp <16 x i8> %packed to <16 x float>"""
    butterflies, rotated = _in_register_butterflies("%v0")
    body = f"""body:
  br label %vector
vector:
  %e = phi i64 [0, %body], [%enext, %vectorend]
  %abs = add i64 %e0, %e
  br label %unpack
unpack:
  %c = phi i64 [0, %vector], [%cnext, %unpack]
  %c16 = shl i64 %c, 4
  %a = add i64 %abs, %c16
  %q = udiv i64 %a, %g
  %sp = getelementptr float, ptr %scales, i64 %q
  %s = load float, ptr %sp
{kernels.broadcast("%sv", "%s")}
{load}
  %v0 = fmul <16 x float> %diff, %sv
{butterflies}
  %slot = getelementptr float, ptr %buf, i64 %c16
  store <16 x float> {rotated}, ptr %slot, align 64
  %cnext = add i64 %c, 1
  %cmore = icmp ult i64 %cnext, %chunks
  br i1 %cmore, label %unpack, label %stage
stage:
  %hs = phi i64 [1, %unpack], [%hsnext, %stageend]
  %hsmore = icmp ult i64 %hs, %chunks
  br i1 %hsmore, label %pairs, label %out
pairs:
  %p = phi i64 [0, %stage], [%pnext, %pairend]
  %bit = and i64 %p, %hs
  %lower = icmp eq i64 %bit, 0
  br i1 %lower, label %fly, label %pairend
fly:
  %p16 = shl i64 %p, 4
  %o = add i64 %p, %hs
  %o16 = shl i64 %o, 4
  %pa = getelementptr float, ptr %buf, i64 %p16
  %pb = getelementptr float, ptr %buf, i64 %o16
  %va = load <16 x float>, ptr %pa, align 64
  %vb = load <16 x float>, ptr %pb, align 64
  %vs = fadd <16 x float> %va, %vb
  %vd = fsub <16 x float> %va, %vb
  store <16 x float> %vs, ptr %pa, align 64
  store <16 x float> %vd, ptr %pb, align 64
  br label %pairend
pairend:
  %pnext = add i64 %p, 1
  %pmore = icmp ult i64 %pnext, %chunks
  br i1 %pmore, label %pairs, label %stageend
stageend:
  %hsnext = shl i64 %hs, 1
  br label %stage
out:
  %k = phi i64 [0, %stage], [%knext, %out]
  %k16 = shl i64 %k, 4
  %wp = getelementptr float, ptr %buf, i64 %k16
  %w = load <16 x float>, ptr %wp, align 64
  %v = fmul <16 x float> %w, %nv
  %local = add i64 %e, %k16
{_store(kind, "%local")}
  %knext = add i64 %k, 1
  %kmore = icmp ult i64 %knext, %chunks
  br i1 %kmore, label %out, label %vectorend
vectorend:
  %enext = add i64 %e, %dim
  %emore = icmp ult i64 %enext, %n
  br i1 %emore, label %vector, label %runend"""
    entry = f"""  %buf = alloca [1024 x float], align 64
  %chunks = lshr i64 %dim, 4
{kernels.broadcast("%nv", "%norm")}"""
    return kernels.over_runs(f"{name}(ptr %runs, ptr %codes, ptr %scales, ptr %zeros, i64 %n, i64 %count, i64 %g, "
                             "i64 %dim, float %norm)", body, entry=entry)


def _kernels() -> dict | None:
    """``{"dequant8": numba kernel, "dequant4r_bf16": compiled IR, ...}``, built on first use (numba imported
    then): the int8 kernel where numba imports, the rotating ones where llvmlite builds them; None where
    neither (the codecs then use torch)."""
    global _built, _tried
    if not _tried:
        with _lock:
            if not _tried:
                kinds = list(_OUT_TYPES.values())
                names = [f"{op}_{k}" for op in ("dequant4r", "dequants8r") for k in kinds]
                ir = "".join(_ir_rotated(k, c) for c in ("u4", "s8") for k in kinds)
                found = {n: _Fn4(a) for n, a in (kernels.build(ir, names, "dequantisation kernels") or {}).items()}
                try:
                    from kvtier.codecs import _dequant_kernels as jitted  # noqa: PLC0415 (numba: 0.5 s to import)
                except ImportError as error:
                    kernels.log.info("int8 dequantisation kernel unavailable (%s); using torch instead", error)
                else:
                    found["dequant8"] = jitted.dequant8
                _built = found or None
                _tried = True
    return _built


def available() -> bool:
    """Whether int8 chunks are dequantised by the native kernel (else by torch)."""
    return "dequant8" in (_kernels() or {})


def dequantise_int8(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: int) -> bool:
    """``out`` (canonical order, any strides) = ``(codes - zero) * scale`` per group of ``g`` values, and True;
    or False, having written nothing, where the kernel does not fit (see the module docstring). ``codes``:
    uint8, one per value; ``scale``/``zero``: float32, one per group, contiguous."""
    kind = _OUT_TYPES.get(out.dtype)
    if (kind is None or g % _LANES or out.device.type != "cpu" or out.layout != torch.strided or out.requires_grad
            or out.is_neg() or out.numel() == 0 or codes.dtype != torch.uint8 or codes.numel() != out.numel()
            or scale.dtype != torch.float32 or zero.dtype != torch.float32 or not scale.is_contiguous()
            or not zero.is_contiguous() or not codes.is_contiguous() or scale.numel() * g != out.numel()
            or zero.numel() != scale.numel()):
        return False
    fns = _kernels()
    found = kernels.span(out, _BITS[out.dtype]) if fns is not None and "dequant8" in fns else None
    if found is None or found[2] % g:
        return False
    memory, starts, run = found
    fns["dequant8"](memory, starts, run, codes.numpy(), scale.numpy(), zero.numpy(), g, _KINDS[out.dtype])
    increment_version(out)  # as torch's own copy would
    return True


def dequantise_int4_rotated(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: int,
                            dim: int) -> bool:
    """``out`` = each head vector of ``(codes - zero) * scale`` (two codes per byte, low nibble first) rotated
    back by the ``dim``-point orthonormal Hadamard transform, and True; or False, having written nothing,
    where the kernel does not fit (``dim`` not a power of two from 16 to 1024, groups not a multiple of 16
    values, or as for int8). Agrees with torch's matrix product to float32 rounding, not bit for bit."""
    if (codes.numel() * 2 != out.numel() or zero.dtype != torch.float32 or not zero.is_contiguous()
            or zero.numel() != scale.numel()):
        return False
    return _rotated("dequant4r", out, codes, scale, zero, g, dim)


def dequantise_symbols_rotated(out: torch.Tensor, symbols: torch.Tensor, steps: torch.Tensor, dim: int) -> bool:
    """``out`` = each head vector of ``symbols * step`` (signed bytes, one step per vector) rotated back by the
    ``dim``-point Hadamard transform (cachegen), and True; or False, having written nothing, where the kernel
    does not fit (as ``dequantise_int4_rotated``)."""
    if symbols.numel() != out.numel() or symbols.dtype != torch.int8:
        return False
    return _rotated("dequants8r", out, symbols, steps, None, dim, dim)


def _rotated(op: str, out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, g: int,
             dim: int) -> bool:
    kind = _OUT_TYPES.get(out.dtype)
    if (kind is None or g % _LANES or dim < _LANES or dim > 1024 or dim & (dim - 1) or dim % g
            or out.device.type != "cpu" or out.layout != torch.strided or out.requires_grad or out.is_neg()
            or out.numel() == 0 or scale.dtype != torch.float32 or not scale.is_contiguous()
            or not codes.is_contiguous() or scale.numel() * g != out.numel()):
        return False
    fns = _kernels()
    found = kernels.runs([out]) if fns is not None and f"{op}_{kind}" in fns else None
    if found is None or found[1] % dim:
        return False
    starts, run = found[0][0], found[1]
    fns[f"{op}_{kind}"](starts.ctypes.data, codes.data_ptr(), scale.data_ptr(), 0 if zero is None else zero.data_ptr(),
                        run, len(starts), g, dim, 1.0 / math.sqrt(dim))
    increment_version(out)
    return True
