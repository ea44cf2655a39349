"""Byte planes: a tensor's bytes regrouped by position in the element, and back.

Plane ``j`` of a tensor with ``k``-byte elements holds byte ``j`` (little-endian) of every element, in the
tensor's row-major order. For bf16 KV, plane 1 (sign and exponent) carries ~3 bits per byte and plane 0
(mantissa) is close to random, so the lossless codec compresses planes, not elements.

``join`` writes a tensor (any strides: a token range of the engine's KV) from its planes, ``split`` fills
planes from one. For 2- and 4-byte elements they run numba kernels (``kvtier.codecs._plane_kernels``), compiled
for this CPU at first use and cached on disk, vectorised by LLVM, without the GIL; they replaced kernels of LLVM
IR (with streaming stores for the join) after measuring as fast (docs/kernels.md). Elsewhere, and where numba is
missing, torch regroups the bytes (a transposed copy, several times slower).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch.autograd.graph import increment_version

from kvtier.native import kernels

#: element sizes the kernel handles (bf16/fp16 and fp32 KV)
KERNEL_ITEMSIZES = (2, 4)
_ELEMENTS = {2: np.uint16, 4: np.uint32}

_lock = threading.Lock()
_built: dict | None = None
_tried = False


def _kernels() -> dict | None:
    """``{"join2": ..., "split4": ...}``, the numba kernels (imported, and numba with them, on first use), or
    None where numba is missing."""
    global _built, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    from kvtier.codecs import _plane_kernels as found  # noqa: PLC0415 (numba: 0.5 s to import)
                except ImportError as error:
                    kernels.log.info("byte-plane kernels unavailable (%s); using torch instead", error)
                else:
                    _built = {f"{op}{k}": getattr(found, f"{op}{k}") for op in ("join", "split")
                              for k in KERNEL_ITEMSIZES}
                _tried = True
    return _built


def available() -> bool:
    """Whether planes are joined and split by the native kernel (else by torch)."""
    return _kernels() is not None


def _kernel_runs(t: torch.Tensor, op: str) -> tuple | None:
    """The kernel for ``op`` on ``t`` and ``t``'s ``kernels.span``, or None where torch must do it: another
    element size, not a plain CPU tensor, autograd or a negative view involved, or runs that repeat or overlap."""
    k = t.element_size()
    plain = t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad and not t.is_neg()
    fns = _kernels() if k in KERNEL_ITEMSIZES and plain else None
    if fns is None or t.numel() == 0 or t.data_ptr() % k:  # element-aligned, as the kernel's arrays need
        return None
    found = kernels.span(t, _ELEMENTS[k])
    return None if found is None else (fns[f"{op}{k}"], *found)


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
    fn, memory, starts, run = found
    fn(memory, starts, run, *(_read_only(p.reshape(-1)) for p in planes))
    increment_version(dest)  # as torch's own copy would: autograd and views see the write


def _read_only(plane: np.ndarray) -> np.ndarray:
    """A read-only view of ``plane``: planes come writable (scratch) or not (payload bytes), and one type for
    all of them means one compiled kernel."""
    view = plane.view()
    view.flags.writeable = False
    return view


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
    fn, memory, starts, run = found
    fn(memory, starts, run, planes)
