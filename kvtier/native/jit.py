"""numba for kvtier's CPU kernels: the one decorator they share, and the float conversions numba lacks.

Imported only by the modules that hold kernels (``kvtier.codecs._dequant_kernels``,
``kvtier.codecs._plane_kernels``), and those only on a kernel's first use, so ``import kvtier`` never pays for
numba (about half a second).

``kernel`` is ``numba.njit(nogil=True, cache=True)``: compiled for this CPU on the first call with each
combination of argument types, without the GIL (the pool threads that decode chunks run kernels in
parallel), and kept on disk so later processes load the machine code instead of compiling it. numba writes
that cache in ``NUMBA_CACHE_DIR`` where it is set, else next to the module (``__pycache__``), else (a
read-only install) in the user's cache directory; where none is writable the kernels still work, compiled
once per process. The cache is keyed by the kernel's own source file: numba does not see a change to an
intrinsic here, so after editing one, clear ``kvtier/codecs/__pycache__/*.nb*`` (or touch the kernel modules).

numba has no float16 or bfloat16 type on the CPU and no way to reinterpret a float's bits, so three
intrinsics (a few LLVM instructions each) give a float32 value's bits as the kernels store them:
``f32_bits`` as is, ``f16_bits`` rounded to IEEE half precision (to nearest, ties to even, overflowing to
infinity, as torch and numpy convert: one ``fptrunc``, ``vcvtps2ph`` with F16C) and ``bf16_bits`` rounded to
bfloat16 (to nearest, ties to even, on the integer bits: torch's rounding of finite values).
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

__all__ = ["bf16_bits", "f16_bits", "f32_bits", "kernel"]


def kernel(fn):
    """``fn`` compiled by numba without the GIL and cached on disk where a cache directory is writable."""
    try:
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # numba found no writable cache directory: compile in every process instead
        return numba.njit(nogil=True)(fn)


@intrinsic
def f16_bits(typingctx, value):
    """The float16 bits (uint16) of a float32 value (see the module docstring)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def f32_bits(typingctx, value):
    """The bits (uint32) of a float32 value."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bf16_bits(typingctx, value):
    """The bfloat16 bits (uint16) of a float32 value: rounded to nearest, ties to even, on 32-bit integers
    (numba would widen the same arithmetic written in Python to 64 bits, which halves the vector width)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(bits, i32(16)), i32(1))
        rounded = builder.add(bits, builder.add(lsb, i32(0x7FFF)))
        return builder.trunc(builder.lshr(rounded, i32(16)), ir.IntType(16))

    return types.uint16(types.float32), codegen
