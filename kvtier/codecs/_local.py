"""Per-thread state of the compressed codecs: reused scratch buffers, zstd contexts, and zstd frames
decompressed into caller-owned memory.

Codecs are stateless and thread-safe to their callers; what they reuse lives here, one per decoding thread:
zstd contexts (not shareable across threads) and scratch memory (reused memory is written far faster than
freshly faulted pages). Each scratch holds about one chunk per thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import zstandard

from kvtier.base.errors import CodecError

T = TypeVar("T")
_LOCAL = threading.local()


def local(name: str, make: Callable[[], T]) -> T:
    """This thread's ``name``, made by ``make`` on first use."""
    value = getattr(_LOCAL, name, None)
    if value is None:
        value = make()
        setattr(_LOCAL, name, value)
    return value


def scratch(name: str, nbytes: int) -> np.ndarray:
    """``nbytes`` of this thread's scratch ``name`` (uint8), grown as needed and kept. Valid until this thread
    next asks for the same name."""
    buf = getattr(_LOCAL, "scratch_" + name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        setattr(_LOCAL, "scratch_" + name, buf)
    return buf[:nbytes]


def inflate_into(decompressor: zstandard.ZstdDecompressor, frame: memoryview, dest: np.ndarray,
                 what: str) -> np.ndarray:
    """Decompress one zstd frame into ``dest`` (a C-contiguous uint8 array), which it must fill exactly and
    end at; CodecError otherwise (zstd's own errors included). Returns ``dest``."""
    try:
        with decompressor.stream_reader(frame, read_size=frame.nbytes, closefd=False) as reader:
            view, filled = memoryview(dest).cast("B"), 0
            while filled < dest.nbytes:
                got = reader.readinto(view[filled:])
                if not got:
                    break
                filled += got
            if filled != dest.nbytes or reader.read(1):
                raise CodecError(f"{what}: a zstd frame decoded to {filled}+ bytes, not {dest.nbytes}")
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: corrupt zstd frame: {exc}") from None
    return dest
