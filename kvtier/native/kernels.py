"""Small native kernels: what they share.

Most of kvtier's CPU kernels are numba functions (``kvtier.native.jit``): the byte-plane split and join of the
lossless codec (``kvtier.codecs._plane_kernels``) and int8 dequantisation (``kvtier.codecs._dequant_kernels``).
Two are LLVM IR, kept where numba measured slower (docs/kernels.md): the streaming-store copy
(``kvtier.native.bulkcopy``) and the Hadamard-rotating dequantisation of int4 and cachegen
(``kvtier.codecs._dequant``). The IR is compiled for this CPU by llvmlite (numba's compiler) at first use and
called through ctypes; ctypes and numba's ``nogil`` kernels both release the GIL, so the pool threads that load
chunks run them in parallel.

``build`` compiles IR and returns its functions' addresses, or None where llvmlite is missing or cannot build
for this target (callers then use torch). ``runs`` turns tensors of one shape into the addresses of their common
contiguous runs, which is what every kernel loops over; ``span`` gives a numba kernel the same runs as element
offsets into one flat array over a tensor's memory.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_engines: list = []  # keeps compiled code alive for the life of the process


def x86_sfence() -> tuple[str, str]:
    """The declaration and the call that order streaming stores before later stores, for this target."""
    import llvmlite.binding as llvm  # noqa: PLC0415

    if llvm.get_default_triple().startswith(("x86_64", "i386", "i686")):
        return "declare void @llvm.x86.sse.sfence()", "call void @llvm.x86.sse.sfence()"
    return "", "fence seq_cst"


def build(ir: str, names: Sequence[str], what: str) -> dict[str, int] | None:
    """Compile ``ir`` for the host CPU (all its features, -O3) and return ``{name: address}`` for ``names``;
    None, logged, where llvmlite is missing or LLVM rejects the module or the target."""
    try:
        import llvmlite.binding as llvm  # noqa: PLC0415 (a dependency, but only paid for on first use)

        with _lock:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            module = llvm.parse_assembly(ir)
            module.verify()
            machine = llvm.Target.from_triple(llvm.get_default_triple()).create_target_machine(
                cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
            engine = llvm.create_mcjit_compiler(module, machine)
            engine.finalize_object()
            _engines.append(engine)
            return {name: engine.get_function_address(name) for name in names}
    except Exception as error:  # ImportError, or LLVM rejecting this target: the caller falls back to torch
        log.info("%s unavailable (%s); using torch instead", what, error)
        return None


def over_runs(signature: str, body: str, *, entry: str = "", done: str = "") -> str:
    """IR of ``define void @<signature> nounwind``: a loop over runs, the shape every kernel here shares.

    ``signature`` takes ``ptr %runs`` (an i64 array of run start addresses), ``i64 %n`` (elements per run)
    and ``i64 %count`` (runs). For each run the loop sets ``%r`` (its index), ``%dint`` / ``%d`` (its address
    as an integer / a pointer) and ``%e0`` (``%r * %n``, its first element) and branches to ``body``, IR that
    starts with the label ``body:`` and branches to ``%runend`` when the run is done. ``entry`` runs once
    first (straight-line IR), ``done`` once before returning."""
    return f"""
define void @{signature} nounwind {{
entry:
{entry}
  %none = icmp eq i64 %count, 0
  br i1 %none, label %done, label %run
run:
  %r = phi i64 [0, %entry], [%rnext, %runend]
  %rp = getelementptr i64, ptr %runs, i64 %r
  %dint = load i64, ptr %rp
  %d = inttoptr i64 %dint to ptr
  %e0 = mul i64 %r, %n
  br label %body
{body}
runend:
  %rnext = add i64 %r, 1
  %again = icmp ult i64 %rnext, %count
  br i1 %again, label %run, label %done
done:
{done}
  ret void
}}
"""


def broadcast(name: str, scalar: str, lanes: int = 16, kind: str = "float") -> str:
    """IR that sets ``name`` to a ``<lanes x kind>`` vector of ``scalar`` in every lane."""
    vector = f"<{lanes} x {kind}>"
    return (f"  {name}.0 = insertelement {vector} poison, {kind} {scalar}, i64 0\n"
            f"  {name} = shufflevector {vector} {name}.0, {vector} poison, <{lanes} x i32> zeroinitializer")


def runs(tensors: Sequence[torch.Tensor]) -> tuple[list[np.ndarray], int] | None:
    """The runs that ``tensors`` (one shape, one element size, strided, on the CPU) share: the start address
    of each run in each tensor, in row-major order of the elements, and the elements per run. A run is the
    innermost dimensions that are contiguous in every tensor. None where a tensor repeats elements (a zero
    stride) or its runs overlap one another. The runs' offsets depend only on the shape and the strides, so
    they are worked out once per layout (``_relative_runs``) and only the tensors' addresses are added here:
    a copy of many equally laid-out pieces (an SGLang host pool's pages) pays the layout's arithmetic once."""
    found = _relative_runs(tuple(tensors[0].shape), tensors[0].element_size(), tuple(t.stride() for t in tensors))
    if found is None:
        return None
    offsets, run = found
    return [o + t.data_ptr() for o, t in zip(offsets, tensors)], run


def span(tensor: torch.Tensor, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, int] | None:
    """``tensor``'s memory as one flat numpy array of ``dtype`` (the tensor's element size), from its first
    element to the end of its last run, with the element at which each run starts in it (read-only, shared by
    every caller with this layout) and the elements per run: ``runs`` as a numba kernel takes them. None where
    ``runs`` is None. The array views the tensor's memory without owning it: the caller keeps the tensor alive
    while it is used, and writes only inside the runs."""
    found = _relative_span(tuple(tensor.shape), tensor.element_size(), tuple(tensor.stride()))
    if found is None:
        return None
    starts, count, run = found
    return np.asarray(_Memory(tensor.data_ptr(), count, dtype)), starts, run


@functools.lru_cache(maxsize=256)
def _relative_span(shape: tuple[int, ...], item: int, strides: tuple[int, ...]
                   ) -> tuple[np.ndarray, int, int] | None:
    """``span`` of a tensor with this layout: its runs' first elements, the elements from its first to the end
    of its last run, the elements per run."""
    found = _relative_runs(shape, item, (strides,))
    if found is None:
        return None
    (offsets,), run = found
    starts = offsets // item
    starts.flags.writeable = False
    return starts, int(starts.max()) + run, run


class _Memory:
    """``count`` elements of ``dtype`` at ``address``, for ``np.asarray`` (numpy's array interface: no copy)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, count: int, dtype: np.dtype) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (count,), "typestr": np.dtype(dtype).str,
                                    "version": 3}


@functools.lru_cache(maxsize=256)
def _relative_runs(shape: tuple[int, ...], item: int, strides: tuple[tuple[int, ...], ...]
                   ) -> tuple[tuple[np.ndarray, ...], int] | None:
    """``runs`` relative to each tensor's first element (arrays shared by every caller: never modified)."""
    dims = [(size, [s[d] for s in strides]) for d, size in enumerate(shape) if size != 1]
    run = 1
    while dims and all(s == run for s in dims[-1][1]):
        run *= dims.pop()[0]
    offsets = [np.zeros(1, np.int64) for _ in strides]
    for size, dim_strides in dims:  # outer dimensions, outermost first
        if 0 in dim_strides:
            return None
        steps = np.arange(size, dtype=np.int64)
        offsets = [(o[:, None] + steps * (s * item)).ravel() for o, s in zip(offsets, dim_strides)]
    if len(offsets[0]) > 1 and any(int(np.diff(np.sort(o)).min()) < run * item for o in offsets):
        return None
    for o in offsets:
        o.flags.writeable = False
    return tuple(offsets), run
