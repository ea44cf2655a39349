"""int8 dequantisation in one pass: ``out = (code - zero) * scale`` per group, straight into the destination.

torch does it in four passes over an L2-sized float32 scratch (codes to float, minus the zero point, times
the scale, converted into place), each a call that holds the GIL between its kernels; on two cores two
decoding threads got 1.2-1.6x one. This kernel of LLVM IR (``kvtier.kernels``) reads each code once and
writes each value once, 16 at a time, in float32 arithmetic in the same order as torch's, and rounds to the
destination dtype as torch does (to nearest, ties to even), so its output is bit-identical to the torch
path's. It handles bf16, fp16 and fp32 destinations whose groups lie whole inside contiguous runs (a token
range of canonical KV) with groups of a multiple of 16 values; otherwise the codec uses torch.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch.autograd.graph import increment_version

from kvtier import kernels

_LANES = 16
_OUT_TYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_Fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
_lock = threading.Lock()
_built: dict[str, _Fn] | None = None
_tried = False


def _store(kind: str) -> str:
    """IR that converts ``%v`` (<16 x float>) and stores it at ``%dp``."""
    if kind == "f32":
        return "  store <16 x float> %v, ptr %dp, align 4"
    if kind == "f16":
        return "  %h = fptrunc <16 x float> %v to <16 x half>\n  store <16 x half> %h, ptr %dp, align 2"
    splat = lambda x: "<" + ", ".join([f"i32 {x}"] * _LANES) + ">"  # noqa: E731
    return f"""  %bits = bitcast <16 x float> %v to <16 x i32>
  %sh = lshr <16 x i32> %bits, {splat(16)}
  %lsb = and <16 x i32> %sh, {splat(1)}
  %bias = add <16 x i32> %lsb, {splat(0x7FFF)}
  %rounded = add <16 x i32> %bits, %bias
  %top = lshr <16 x i32> %rounded, {splat(16)}
  %b16 = trunc <16 x i32> %top to <16 x i16>
  store <16 x i16> %b16, ptr %dp, align 2"""


def _ir(kind: str) -> str:
    """``dequant8_<kind>(runs, codes, scales, zeros, run_elems, count, group)``: ``runs`` holds ``count``
    destination run addresses; run ``r`` takes values ``[r * run_elems, (r + 1) * run_elems)``; value ``i``
    is ``(codes[i] - zeros[i / group]) * scales[i / group]`` (float32 scales and zeros)."""
    size = {"f32": 4, "f16": 2, "bf16": 2}[kind]
    return f"""
define void @dequant8_{kind}(ptr %runs, ptr %codes, ptr %scales, ptr %zeros, i64 %n, i64 %count, i64 %g) nounwind {{
entry:
  %none = icmp eq i64 %count, 0
  br i1 %none, label %done, label %run
run:
  %r = phi i64 [0, %entry], [%rnext, %runend]
  %rp = getelementptr i64, ptr %runs, i64 %r
  %dint = load i64, ptr %rp
  %d = inttoptr i64 %dint to ptr
  %e0 = mul i64 %r, %n
  br label %group
group:
  %e = phi i64 [0, %run], [%enext, %groupend]
  %abs = add i64 %e0, %e
  %q = udiv i64 %abs, %g
  %sp = getelementptr float, ptr %scales, i64 %q
  %zp = getelementptr float, ptr %zeros, i64 %q
  %s = load float, ptr %sp
  %z = load float, ptr %zp
  %s0 = insertelement <16 x float> poison, float %s, i64 0
  %sv = shufflevector <16 x float> %s0, <16 x float> poison, <16 x i32> zeroinitializer
  %z0 = insertelement <16 x float> poison, float %z, i64 0
  %zv = shufflevector <16 x float> %z0, <16 x float> poison, <16 x i32> zeroinitializer
  br label %lanes
lanes:
  %i = phi i64 [0, %group], [%inext, %lanes]
  %at = add i64 %abs, %i
  %cp = getelementptr i8, ptr %codes, i64 %at
  %c = load <16 x i8>, ptr %cp, align 1
  %cf = uitofp <16 x i8> %c to <16 x float>
  %diff = fsub <16 x float> %cf, %zv
  %v = fmul <16 x float> %diff, %sv
  %local = add i64 %e, %i
  %off = mul i64 %local, {size}
  %dp = getelementptr i8, ptr %d, i64 %off
{_store(kind)}
  %inext = add i64 %i, {_LANES}
  %imore = icmp ult i64 %inext, %g
  br i1 %imore, label %lanes, label %groupend
groupend:
  %enext = add i64 %e, %g
  %emore = icmp ult i64 %enext, %n
  br i1 %emore, label %group, label %runend
runend:
  %rnext = add i64 %r, 1
  %again = icmp ult i64 %rnext, %count
  br i1 %again, label %run, label %done
done:
  ret void
}}
"""


def _kernels() -> dict[str, _Fn] | None:
    global _built, _tried
    if not _tried:
        with _lock:
            if not _tried:
                names = [f"dequant8_{k}" for k in _OUT_TYPES.values()]
                found = kernels.build("".join(_ir(k) for k in _OUT_TYPES.values()), names, "int8 dequantisation kernel")
                _built = None if found is None else {n: _Fn(a) for n, a in found.items()}
                _tried = True
    return _built


def available() -> bool:
    """Whether int8 chunks are dequantised by the native kernel (else by torch)."""
    return _kernels() is not None


def dequantise_int8(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: int) -> bool:
    """``out`` (canonical order, any strides) = ``(codes - zero) * scale`` per group of ``g`` values, and True;
    or False, having written nothing, where the kernel does not fit (see the module docstring). ``codes``:
    uint8, one per value; ``scale``/``zero``: float32, one per group, contiguous."""
    kind = _OUT_TYPES.get(out.dtype)
    if (kind is None or g % _LANES or out.device.type != "cpu" or out.layout != torch.strided or out.requires_grad
            or out.is_neg() or out.numel() == 0 or codes.numel() != out.numel()
            or scale.dtype != torch.float32 or zero.dtype != torch.float32 or not scale.is_contiguous()
            or not zero.is_contiguous() or not codes.is_contiguous() or scale.numel() * g != out.numel()
            or zero.numel() != scale.numel()):
        return False
    fns = _kernels()
    found = kernels.runs([out]) if fns is not None else None
    if found is None or found[1] % g:
        return False
    starts, run = found[0][0], found[1]
    fns[f"dequant8_{kind}"](starts.ctypes.data, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), run,
                             len(starts), g)
    increment_version(out)  # as torch's own copy would
    return True

