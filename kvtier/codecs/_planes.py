"""Byte planes: a tensor's bytes regrouped by position in the element, and back.

Plane ``j`` of a tensor with ``k``-byte elements holds byte ``j`` (little-endian) of every element, in the
tensor's row-major order. For bf16 KV, plane 1 (sign and exponent) carries ~3 bits per byte and plane 0
(mantissa) is close to random, so the lossless codec compresses planes, not elements.

``join`` writes a tensor (any strides: a token range of the engine's KV) from its planes, ``split`` fills
planes from one. For 2- and 4-byte elements they run a kernel of LLVM IR (``kvtier.native.kernels``): 64 bytes at a
time through one byte permutation (``vpermb`` on AVX-512 VBMI), the joined bytes written with streaming
stores, since a decoded chunk is megabytes headed for memory the engine reads later. Measured on SmolLM2's KV
(5.6 MiB chunks into token ranges, one thread): join 16-17 GB/s, about a torch copy of the same bytes and a
fifth of the lossless decoder's time; split 14 GB/s. Elsewhere, and where the kernel cannot be built, torch
regroups the bytes (a transposed copy: join 3-5 GB/s, split 0.4 GB/s here).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch.autograd.graph import increment_version

from kvtier.native import kernels

#: element sizes the kernel handles (bf16/fp16 and fp32 KV)
KERNEL_ITEMSIZES = (2, 4)
_VECTOR = 64  # bytes of elements per turn of the vector loop

_Fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_lock = threading.Lock()
_built: dict[str, _Fn] | None = None
_tried = False


def _scalar_loop(name: str, k: int, start: str, end: str, after: str, join: bool) -> str:
    """IR of a one-element-at-a-time loop over elements [start, end) of the current run."""
    body = []
    for j in range(k):
        plane, elem = f"%{name}p{j}", f"%{name}e{j}"
        body.append(f"  {plane} = getelementptr i8, ptr %p{j}, i64 %{name}g\n"
                    f"  {elem} = getelementptr i8, ptr %d, i64 %{name}b{j}")
        src, dst = (plane, elem) if join else (elem, plane)
        body.append(f"  %{name}v{j} = load i8, ptr {src}\n  store i8 %{name}v{j}, ptr {dst}")
    offsets = "\n".join(f"  %{name}b{j} = add i64 %{name}k, {j}" for j in range(k))
    return f"""
{name}:
  %{name}i = phi i64 [{start}, %{name}pre], [%{name}next, %{name}body]
  %{name}more = icmp ult i64 %{name}i, {end}
  br i1 %{name}more, label %{name}body, label %{after}
{name}body:
  %{name}g = add i64 %e0, %{name}i
  %{name}k = mul i64 %{name}i, {k}
{offsets}
{chr(10).join(body)}
  %{name}next = add i64 %{name}i, 1
  br label %{name}
"""


def _ir(k: int, join: bool) -> str:
    """``join{k}(tensor_runs, planes, run_elems, runs)`` or ``split{k}(...)``: ``tensor_runs`` is an i64
    array of run start addresses, ``planes`` an i64 array of ``k`` plane base addresses; run ``r`` covers
    elements ``[r * run_elems, (r + 1) * run_elems)`` of every plane. ``join`` assumes 64-byte alignment is
    reachable (run starts are multiples of ``k``) and streams its stores; it ends with a store fence."""
    lanes = _VECTOR // k
    name = f"{'join' if join else 'split'}{k}"
    bases = "\n".join(f"  %pa{j} = getelementptr i64, ptr %planes, i64 {j}\n  %pi{j} = load i64, ptr %pa{j}\n"
                      f"  %p{j} = inttoptr i64 %pi{j} to ptr" for j in range(k))
    # element-major <-> plane-major order of one 64-byte vector
    to_elements = ", ".join(f"i32 {(m % k) * lanes + m // k}" for m in range(_VECTOR))
    to_planes = ", ".join(f"i32 {(m % lanes) * k + m // lanes}" for m in range(_VECTOR))
    plane_ptrs = "\n".join(f"  %vp{j} = getelementptr i8, ptr %p{j}, i64 %vg" for j in range(k))
    if join:
        loads = "\n".join(f"  %vl{j} = load <{lanes} x i8>, ptr %vp{j}, align 1" for j in range(k))
        parts = [f"%vl{j}" for j in range(k)]
        width, steps = lanes, []
        while len(parts) > 1:  # concatenate the planes' vectors pairwise into one of 64 bytes
            merged = []
            for a in range(0, len(parts), 2):
                out = f"%cat{width}_{a}"
                mask = ", ".join(f"i32 {i}" for i in range(2 * width))
                steps.append(f"  {out} = shufflevector <{width} x i8> {parts[a]}, <{width} x i8> {parts[a + 1]}, "
                             f"<{2 * width} x i32> <{mask}>")
                merged.append(out)
            parts, width = merged, 2 * width
        vector = f"""{loads}
{chr(10).join(steps)}
  %vx = shufflevector <64 x i8> {parts[0]}, <64 x i8> poison, <64 x i32> <{to_elements}>
  store <64 x i8> %vx, ptr %vt, align 64, !nontemporal !0"""
        head = f"""  %neg = sub i64 0, %dint
  %misb = and i64 %neg, 63
  %mis = udiv i64 %misb, {k}
  %short = icmp ult i64 %n, %mis
  %head = select i1 %short, i64 %n, i64 %mis"""
    else:
        extracts = []
        for j in range(k):
            mask = ", ".join(f"i32 {j * lanes + i}" for i in range(lanes))
            extracts.append(f"  %vs{j} = shufflevector <64 x i8> %vy, <64 x i8> poison, <{lanes} x i32> <{mask}>\n"
                            f"  store <{lanes} x i8> %vs{j}, ptr %vp{j}, align 1")
        vector = f"""  %vx = load <64 x i8>, ptr %vt, align 1
  %vy = shufflevector <64 x i8> %vx, <64 x i8> poison, <64 x i32> <{to_planes}>
{chr(10).join(extracts)}"""
        head = "  %head = add i64 0, 0"
    body = f"""body:
{head}
  %rest = sub i64 %n, %head
  %bulk = and i64 %rest, -{lanes}
  %vend = add i64 %head, %bulk
  br label %hpre
hpre:
  br label %h
{_scalar_loop("h", k, "0", "%head", "vcheck", join)}
vcheck:
  %hasbulk = icmp ne i64 %bulk, 0
  br i1 %hasbulk, label %vec, label %tlpre
vec:
  %vi = phi i64 [%head, %vcheck], [%vnext, %vec]
  %vg = add i64 %e0, %vi
  %vk = mul i64 %vi, {k}
  %vt = getelementptr i8, ptr %d, i64 %vk
{plane_ptrs}
{vector}
  %vnext = add i64 %vi, {lanes}
  %vmore = icmp ult i64 %vnext, %vend
  br i1 %vmore, label %vec, label %tlpre
tlpre:
  br label %tl
{_scalar_loop("tl", k, "%vend", "%n", "runend", join)}"""
    return kernels.over_runs(f"{name}(ptr %runs, ptr %planes, i64 %n, i64 %count)", body, entry=bases,
                             done="  FENCE" if join else "")


def _kernels() -> dict[str, _Fn] | None:
    global _built, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    fence_decl, fence = kernels.x86_sfence()
                except ImportError:
                    fence_decl = None
                if fence_decl is not None:
                    names = [f"{op}{k}" for k in KERNEL_ITEMSIZES for op in ("join", "split")]
                    ir = fence_decl + "".join(_ir(k, op == "join") for k in KERNEL_ITEMSIZES
                                              for op in ("join", "split")).replace("FENCE", fence)
                    found = kernels.build(ir + "\n!0 = !{i32 1}\n", names, "byte-plane kernels")
                    _built = None if found is None else {n: _Fn(a) for n, a in found.items()}
                _tried = True
    return _built


def available() -> bool:
    """Whether planes are joined and split by the native kernel (else by torch)."""
    return _kernels() is not None


def _kernel_runs(t: torch.Tensor, op: str) -> tuple[_Fn, np.ndarray, int] | None:
    """The kernel for ``op`` on ``t`` and ``t``'s runs, or None where torch must do it: another element size,
    not a plain CPU tensor, autograd or a negative view involved, or runs that repeat or overlap."""
    k = t.element_size()
    plain = t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad and not t.is_neg()
    fns = _kernels() if k in KERNEL_ITEMSIZES and plain else None
    if fns is None or t.numel() == 0:
        return None
    found = kernels.runs([t])
    if found is None or t.data_ptr() % k:  # every run starts element-aligned, as the join's head assumes
        return None
    return fns[f"{op}{k}"], found[0][0], found[1]


def join(dest: torch.Tensor, planes: Sequence[np.ndarray]) -> None:
    """Write ``dest`` (any strides, on the CPU, elements of ``len(planes)`` bytes) from its byte planes, each a
    C-contiguous uint8 array of ``dest.numel()`` bytes. Writes nothing outside ``dest``."""
    k = dest.element_size()
    if len(planes) != k or any(p.dtype != np.uint8 or p.size != dest.numel() or not p.flags.c_contiguous
                               for p in planes):
        raise ValueError(f"join: {dest.numel()} elements of {k} bytes need {k} planes of that many bytes")
    found = _kernel_runs(dest, "join")
    if found is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # planes may view read-only payload bytes: only read
            sources = [torch.from_numpy(p) for p in planes]
        grouped = sources[0] if k == 1 else torch.stack(sources, dim=-1)  # element-major bytes
        dest.copy_(grouped.view(dest.dtype).view(dest.shape))
        return
    fn, starts, run = found
    bases = np.array([p.ctypes.data for p in planes], dtype=np.int64)
    fn(starts.ctypes.data, bases.ctypes.data, run, len(starts))
    increment_version(dest)  # as torch's own copy would: autograd and views see the write


def split(src: torch.Tensor, planes: np.ndarray) -> None:
    """Fill ``planes`` (a C-contiguous uint8 array of shape ``(k, src.numel())``) with the byte planes of
    ``src`` (any strides, on the CPU, ``k``-byte elements)."""
    k = src.element_size()
    if planes.dtype != np.uint8 or planes.shape != (k, src.numel()) or not planes.flags.c_contiguous:
        raise ValueError(f"split: {src.numel()} elements of {k} bytes need a ({k}, {src.numel()}) uint8 array")
    found = _kernel_runs(src, "split")
    if found is None:
        grouped = src.detach().contiguous().view(-1).view(torch.uint8).view(-1, k)
        torch.from_numpy(planes).copy_(grouped.t())
        return
    fn, starts, run = found
    bases = np.array([planes[j].ctypes.data for j in range(k)], dtype=np.int64)
    fn(starts.ctypes.data, bases.ctypes.data, run, len(starts))
