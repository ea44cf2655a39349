"""The byte-plane kernels of ``kvtier.codecs._planes`` in numba (``kvtier.native.jit``).

Every kernel walks the runs of a strided tensor: ``tensor`` is a flat array over the tensor's memory,
``starts[r]`` the element at which run ``r`` starts in it, ``run`` the elements per run; run ``r`` holds
elements ``[r * run, (r + 1) * run)`` of every plane, in the tensor's row-major order. Plane ``j`` holds
byte ``j`` (little-endian) of every element. The loops index slices from 0, so numba's compiler (LLVM) sees
indices that cannot be negative and vectorises them.
"""

from __future__ import annotations

import numpy as np

from kvtier.native.jit import kernel


@kernel
def join2(tensor, starts, run, p0, p1):
    """Write 2-byte elements (``tensor``: uint16) from planes ``p0``, ``p1``."""
    for r in range(starts.size):
        out = tensor[starts[r] : starts[r] + run]
        b0, b1 = p0[r * run : (r + 1) * run], p1[r * run : (r + 1) * run]
        for i in range(run):
            out[i] = np.uint16(b0[i]) | np.uint16(b1[i]) << 8


@kernel
def join4(tensor, starts, run, p0, p1, p2, p3):
    """Write 4-byte elements (``tensor``: uint32) from planes ``p0`` .. ``p3``."""
    for r in range(starts.size):
        out = tensor[starts[r] : starts[r] + run]
        b0, b1 = p0[r * run : (r + 1) * run], p1[r * run : (r + 1) * run]
        b2, b3 = p2[r * run : (r + 1) * run], p3[r * run : (r + 1) * run]
        for i in range(run):
            out[i] = np.uint32(b0[i]) | np.uint32(b1[i]) << 8 | np.uint32(b2[i]) << 16 | np.uint32(b3[i]) << 24


@kernel
def split2(tensor, starts, run, planes):
    """Fill ``planes`` (uint8, shape ``(2, elements)``) from 2-byte elements (``tensor``: uint16)."""
    for r in range(starts.size):
        src = tensor[starts[r] : starts[r] + run]
        b0, b1 = planes[0, r * run : (r + 1) * run], planes[1, r * run : (r + 1) * run]
        for i in range(run):
            x = src[i]
            b0[i] = x & 0xFF
            b1[i] = x >> 8


@kernel
def split4(tensor, starts, run, planes):
    """Fill ``planes`` (uint8, shape ``(4, elements)``) from 4-byte elements (``tensor``: uint32)."""
    for r in range(starts.size):
        src = tensor[starts[r] : starts[r] + run]
        b0, b1 = planes[0, r * run : (r + 1) * run], planes[1, r * run : (r + 1) * run]
        b2, b3 = planes[2, r * run : (r + 1) * run], planes[3, r * run : (r + 1) * run]
        for i in range(run):
            x = src[i]
            b0[i] = x & 0xFF
            b1[i] = (x >> 8) & 0xFF
            b2[i] = (x >> 16) & 0xFF
            b3[i] = x >> 24
