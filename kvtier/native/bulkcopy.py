"""Large host copies with streaming (non-temporal) stores, spread over threads.

torch's ``copy_`` (like glibc's ``memcpy`` below its non-temporal threshold, 3/4 of the last-level cache)
writes through the caches: each destination line is read in before it is overwritten, then written back, so
a copy moves three bytes through memory for each byte copied. A streaming store writes whole lines without
reading them first: two bytes per byte. For a copy far larger than the caches (a KV chunk is 6-32 MiB, a load
hundreds of MiB) that is most of the memory tier's cost (docs/kernels.md has the figures).

The kernel is a loop of LLVM IR (below), compiled for this CPU at first use by llvmlite
(``kvtier.native.kernels``) and called through ctypes, which releases the GIL: the threads of one copy run in
parallel. It stays IR where kvtier's other kernels moved to numba because numba cannot ask for a streaming
store: its copy loop becomes a ``memcpy`` through the caches, measured well below this kernel
(docs/kernels.md); we found no package on PyPI that offers such a copy either. ``copy_pairs`` is all or
nothing: it returns False having copied nothing (the caller copies with torch) when llvmlite is missing or the
kernel cannot be built, when the copy is under ``MIN_BYTES`` in all (smaller copies may still sit in the
caches, where torch's copy is faster), or when a pair does not fit: not both on the CPU, dtypes or shapes
differ, autograd records it, contiguous runs shorter than 4 KiB, a destination that overlaps itself or its
source.

``KVTIER_STREAMING_COPY=0`` in the environment turns it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.autograd.graph import increment_version

from kvtier.native import kernels

#: copies smaller than this in all are left to torch (measured crossover: 4-16 MiB here)
MIN_BYTES = 16 << 20
#: the shortest contiguous run worth a call into the kernel's loop
MIN_RUN_BYTES = 4096
#: a thread gets at least this many bytes; runs are cut into pieces of at most PIECE_BYTES to share them out
BYTES_PER_THREAD = 8 << 20
PIECE_BYTES = 4 << 20
#: memory bandwidth is saturated by a few cores; more threads only contend
MAX_THREADS = 8
#: ``copy_visiting``'s pieces: small enough that a piece just visited is still in the core's cache (L2) when
#: it is copied, large enough that the call per piece is noise
VISIT_PIECE_BYTES = 512 << 10

# copy_runs(dst_addrs, src_addrs, lengths, count): for each run, the bytes up to the first 64-byte aligned
# destination address with llvm.memcpy, then 256-byte blocks (unaligned loads, aligned streaming stores),
# then the tail with llvm.memcpy; one store fence at the end orders the streaming stores before any later
# store of this thread (and so before the thread signals that it is done).
_KERNEL_IR = r"""
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
{fence_decl}
define void @copy_runs(ptr %dsts, ptr %srcs, ptr %lens, i64 %count) nounwind {{
entry:
  %none = icmp eq i64 %count, 0
  br i1 %none, label %done, label %run
run:
  %r = phi i64 [0, %entry], [%rnext, %runend]
  %dp = getelementptr i64, ptr %dsts, i64 %r
  %sp = getelementptr i64, ptr %srcs, i64 %r
  %np = getelementptr i64, ptr %lens, i64 %r
  %dint = load i64, ptr %dp
  %sint = load i64, ptr %sp
  %n = load i64, ptr %np
  %d = inttoptr i64 %dint to ptr
  %s = inttoptr i64 %sint to ptr
  %neg = sub i64 0, %dint
  %mis = and i64 %neg, 63
  %short = icmp ult i64 %n, %mis
  %head = select i1 %short, i64 %n, i64 %mis
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %head, i1 false)
  %rest = sub i64 %n, %head
  %body = and i64 %rest, -256
  %hasbody = icmp ne i64 %body, 0
  br i1 %hasbody, label %block, label %tail
block:
  %i = phi i64 [0, %run], [%inext, %block]
  %off = add i64 %head, %i
  %s0 = getelementptr i8, ptr %s, i64 %off
  %d0 = getelementptr i8, ptr %d, i64 %off
  %s1 = getelementptr i8, ptr %s0, i64 64
  %d1 = getelementptr i8, ptr %d0, i64 64
  %s2 = getelementptr i8, ptr %s0, i64 128
  %d2 = getelementptr i8, ptr %d0, i64 128
  %s3 = getelementptr i8, ptr %s0, i64 192
  %d3 = getelementptr i8, ptr %d0, i64 192
  %v0 = load <64 x i8>, ptr %s0, align 1
  %v1 = load <64 x i8>, ptr %s1, align 1
  %v2 = load <64 x i8>, ptr %s2, align 1
  %v3 = load <64 x i8>, ptr %s3, align 1
  store <64 x i8> %v0, ptr %d0, align 64, !nontemporal !0
  store <64 x i8> %v1, ptr %d1, align 64, !nontemporal !0
  store <64 x i8> %v2, ptr %d2, align 64, !nontemporal !0
  store <64 x i8> %v3, ptr %d3, align 64, !nontemporal !0
  %inext = add i64 %i, 256
  %more = icmp ult i64 %inext, %body
  br i1 %more, label %block, label %tail
tail:
  %copied = add i64 %head, %body
  %left = sub i64 %n, %copied
  %dt = getelementptr i8, ptr %d, i64 %copied
  %st = getelementptr i8, ptr %s, i64 %copied
  call void @llvm.memcpy.p0.p0.i64(ptr %dt, ptr %st, i64 %left, i1 false)
  br label %runend
runend:
  %rnext = add i64 %r, 1
  %again = icmp ult i64 %rnext, %count
  br i1 %again, label %run, label %done
done:
  {fence}
  ret void
}}
!0 = !{{i32 1}}
"""

_KernelFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_build_lock = threading.Lock()
_kernel: _KernelFn | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None


def _build() -> _KernelFn | None:
    fence_decl, fence = kernels.x86_sfence()
    found = kernels.build(_KERNEL_IR.format(fence_decl=fence_decl, fence=fence), ["copy_runs"], "streaming copies")
    return None if found is None else _KernelFn(found["copy_runs"])


def kernel() -> _KernelFn | None:
    """The compiled kernel, built on the first call; None where it is turned off or cannot be built."""
    global _kernel, _tried
    if _tried:
        return _kernel
    with _build_lock:
        if not _tried:
            if os.environ.get("KVTIER_STREAMING_COPY", "1").strip().lower() not in ("0", "false", "no", "off"):
                _kernel = _build()
            _tried = True
    return _kernel


def available() -> bool:
    """Whether large copies go through the streaming kernel."""
    return kernel() is not None


def _runs(dest: torch.Tensor, src: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The destination and source start addresses of one pair's contiguous runs and the runs' length in
    bytes, or None if the pair does not fit the kernel (see the module docstring)."""
    if (dest.device.type != "cpu" or src.device.type != "cpu" or dest.dtype != src.dtype
            or dest.shape != src.shape or dest.layout != torch.strided or src.layout != torch.strided
            or dest.requires_grad or src.requires_grad or dest.is_conj() or src.is_conj()
            or dest.is_neg() or src.is_neg()):
        return None
    found = kernels.runs([dest, src])
    if found is None or found[1] * dest.element_size() < MIN_RUN_BYTES:
        return None  # the destination repeats or overlaps itself, or its runs are too short to pay
    (d_at, s_at), run = found
    run_bytes = run * dest.element_size()
    if int(d_at.min()) < int(s_at.max()) + run_bytes and int(s_at.min()) < int(d_at.max()) + run_bytes:
        return None  # source and destination spans meet: leave it to torch, which checks
    return d_at, s_at, run_bytes


def _pieces(dst: np.ndarray, src: np.ndarray, lens: np.ndarray,
            piece: int = PIECE_BYTES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs cut, in order, into pieces of at most ``piece`` bytes, so threads can share them out evenly."""
    counts = (lens + piece - 1) // piece
    if int(counts.max()) == 1:
        return dst, src, lens
    index = np.repeat(np.arange(len(lens)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(len(index), dtype=np.int64) - first) * piece
    return dst[index] + offset, src[index] + offset, np.minimum(lens[index] - offset, piece)


def _worker_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _build_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="kvtier-copy")
    return _pool


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, min_bytes: int = MIN_BYTES,
               threads: int | None = None) -> bool:
    """``dest.copy_(src)`` for every ``(dest, src)`` pair with streaming stores, and True; or False, having
    copied nothing, where the copies are under ``min_bytes`` in all or do not fit the kernel (module
    docstring). ``threads`` defaults to torch's thread count, at most ``MAX_THREADS`` and one per
    ``BYTES_PER_THREAD``. Destinations must not overlap one another (as for ``torch._foreach_copy_``)."""
    fn = kernel()
    if fn is None or not pairs:
        return False
    total = sum(dest.numel() * dest.element_size() for dest, _ in pairs)
    if total < max(min_bytes, 1):
        return False
    runs = []
    for dest, src in pairs:
        if dest.numel() == 0:
            continue
        found = _runs(dest, src)
        if found is None:
            return False
        runs.append(found)
    dst = np.concatenate([d for d, _, _ in runs])
    src = np.concatenate([s for _, s, _ in runs])
    lens = np.concatenate([np.full(len(d), n, np.int64) for d, _, n in runs])
    dst, src, lens = _pieces(dst, src, lens)
    if threads is None:
        threads = min(torch.get_num_threads(), MAX_THREADS, max(1, total // BYTES_PER_THREAD))
    threads = max(1, min(threads, MAX_THREADS, len(lens)))
    cuts = np.searchsorted(np.cumsum(lens), [total * k // threads for k in range(1, threads)], side="right")
    bounds = [0, *cuts.tolist(), len(lens)]
    parts = [(dst[a:b], src[a:b], lens[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    calls = [(d.ctypes.data, s.ctypes.data, n.ctypes.data, len(n)) for d, s, n in parts]
    futures = []
    for call in calls[1:]:
        try:
            futures.append(_worker_pool().submit(fn, *call))
        except RuntimeError:  # the interpreter is shutting down: no new threads, copy here
            fn(*call)
    fn(*calls[0])
    for future in futures:
        future.result()
    del parts  # the address arrays lived until every call returned
    for dest, _ in pairs:
        increment_version(dest)
    return True


def copy_visiting(dest: torch.Tensor, src: torch.Tensor, visit: Callable[[memoryview], object]) -> bool:
    """``dest.copy_(src)`` with streaming stores in this thread, calling ``visit`` on each piece of ``src``'s
    bytes (a read-only memoryview, valid during the call) just before that piece is copied, and True. The
    pieces are visited in row-major order, so together they are exactly ``src``'s bytes as a contiguous copy
    holds them. A checksum of what is copied then costs one read of the bytes, not two: ``visit`` reads a piece
    from memory and the copy reads it from the cache (``VISIT_PIECE_BYTES``). All or nothing, as
    ``copy_pairs``: False, nothing visited or copied, where the kernel is unavailable or the pair does not fit
    it (module docstring; no size threshold here)."""
    fn = kernel()
    if fn is None or dest.numel() == 0:
        return False
    found = _runs(dest, src)
    if found is None:
        return False
    d_at, s_at, run = found
    dst, srcs, lens = _pieces(d_at, s_at, np.full(len(d_at), run, np.int64), VISIT_PIECE_BYTES)
    dst, srcs, lens = (np.ascontiguousarray(a, dtype=np.int64) for a in (dst, srcs, lens))
    base_d, base_s, base_n = dst.ctypes.data, srcs.ctypes.data, lens.ctypes.data
    for k, (at, n) in enumerate(zip(srcs.tolist(), lens.tolist())):
        visit(memoryview((ctypes.c_char * n).from_address(at)).cast("B").toreadonly())
        fn(base_d + 8 * k, base_s + 8 * k, base_n + 8 * k, 1)  # one piece, while it is in the cache
    increment_version(dest)
    return True
