"""The int8 dequantisation kernel of ``kvtier.codecs._dequant`` in numba (``kvtier.native.jit``).

The kernel walks the runs of a strided destination: ``out`` is a flat array over its memory (uint32 for
float32 values, uint16 for float16 and bfloat16: the kernel stores bits), ``starts[r]`` the element at which
run ``r`` starts in it, ``run`` the elements per run; run ``r`` takes values ``[r * run, (r + 1) * run)``.
``kind`` (``F32``, ``F16``, ``BF16``) says how a float32 value becomes the destination's bits: as is, rounded
to float16, or rounded to bfloat16 (to nearest, ties to even). Values are computed in float32 in the order the
docstring gives, without fused multiply-adds, so they are the bits torch's float32 arithmetic gives.
"""

from __future__ import annotations

import numpy as np

from kvtier.native.jit import bf16_bits, f16_bits, f32_bits, kernel

F32, F16, BF16 = 0, 1, 2


@kernel
def dequant8(out, starts, run, codes, scales, zeros, g, kind):
    """Value ``i`` = ``(float32(codes[i]) - zeros[i // g]) * scales[i // g]`` (uint8 codes; float32 scales and
    zeros, one per group of ``g`` values; ``run`` a multiple of ``g``). Every index runs from 0 over a slice
    or a reshaped view, so LLVM knows none is negative and vectorises the inner loops; ``kind`` is tested once
    per group, outside them, so that each loop does one conversion."""
    groups = run // g
    for r in range(starts.size):
        c = codes[r * run : (r + 1) * run].reshape(groups, g)
        dest = out[starts[r] : starts[r] + run].reshape(groups, g)
        s, z = scales[r * groups : (r + 1) * groups], zeros[r * groups : (r + 1) * groups]
        for q in range(groups):
            if kind == BF16:
                for i in range(g):
                    dest[q, i] = bf16_bits((np.float32(c[q, i]) - z[q]) * s[q])
            elif kind == F16:
                for i in range(g):
                    dest[q, i] = f16_bits((np.float32(c[q, i]) - z[q]) * s[q])
            else:
                for i in range(g):
                    dest[q, i] = f32_bits((np.float32(c[q, i]) - z[q]) * s[q])
