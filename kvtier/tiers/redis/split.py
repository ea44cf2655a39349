"""Split values: how a blob larger than ``max_part_bytes`` is stored as a head and parts, and read back.

A value of ``total`` bytes becomes ``n_parts = ceil(total / part_len)`` pieces. Part 0 travels in the head,
behind a 32-byte split header (magic, version, nonce, total, part length, part count); parts 1.. are stored
under ``<head key>:<nonce hex>:<i>``. Writers send the parts first and the head last, on one connection, with
``SET NX``: a reader sees the head only once every part exists, parts of concurrent writers never mix (each
write has its own nonce), and a value whose part is missing (evicted, expired) is a miss that is cleaned up.

Readers are resp ``Into`` callables: they receive a reply straight into a pooled buffer sized for the whole
value, head first, then each part into its place.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass

import numpy as np

from kvtier.net.buffers import TransferBufferPool
from kvtier.tiers.redis.limits import HEADER_BYTES, MAX_PARTS, MIN_PART_BYTES, REDIS_MAX_BULK
from kvtier.tiers.redis.resp import RespReader

SPLIT_MAGIC = b"KVTS"
SPLIT_VERSION = 1
_HEADER = struct.Struct("<4sHH8sQII")  # magic, version, reserved, nonce, total length, part length, part count
assert _HEADER.size == HEADER_BYTES


@dataclass(frozen=True, slots=True)
class SplitHeader:
    """What a split value's head says about its parts."""

    nonce: bytes
    total: int  #: bytes of the whole value
    part_len: int  #: bytes of every part but the last

    @classmethod
    def new(cls, total: int, part_len: int) -> SplitHeader:
        """A header for a fresh write (its own random nonce)."""
        return cls(os.urandom(8), total, part_len)

    @classmethod
    def parse(cls, header: bytes) -> SplitHeader | None:
        """The header at the start of ``header``, or None if it is not a valid split header of ours (which
        includes one outside MIN_PART_BYTES and MAX_PARTS)."""
        if len(header) < HEADER_BYTES or header[:4] != SPLIT_MAGIC:
            return None
        _magic, version, _reserved, nonce, total, part_len, n_parts = _HEADER.unpack_from(header)
        if version != SPLIT_VERSION or not MIN_PART_BYTES <= part_len < total:
            return None
        if part_len > REDIS_MAX_BULK - HEADER_BYTES or n_parts != -(-total // part_len) or n_parts > MAX_PARTS:
            return None
        return cls(nonce, total, part_len)

    @property
    def n_parts(self) -> int:
        return -(-self.total // self.part_len)

    def pack(self) -> bytes:
        return _HEADER.pack(SPLIT_MAGIC, SPLIT_VERSION, 0, self.nonce, self.total, self.part_len, self.n_parts)

    def part_key(self, head: bytes, i: int) -> bytes:
        return b"%s:%s:%d" % (head, self.nonce.hex().encode(), i)

    def part_keys(self, head: bytes) -> list[bytes]:
        """The keys of parts 1.. (part 0 is in the head)."""
        return [self.part_key(head, i) for i in range(1, self.n_parts)]

    def part_range(self, i: int) -> slice:
        """Where part ``i`` lies in the whole value."""
        start = i * self.part_len
        return slice(start, min(start + self.part_len, self.total))


def part_keys_of(head: bytes, header: bytes) -> list[bytes]:
    """The part keys named by a head's first HEADER_BYTES bytes; [] for a plain (unsplit) value."""
    parsed = SplitHeader.parse(header)
    return [] if parsed is None else parsed.part_keys(head)


class Unusable(enum.Enum):
    """A head reply that yields no value."""

    FOREIGN = "foreign"  #: not a value of ours (a bad split header): a miss, and deleted
    TOO_LARGE = "too_large"  #: valid, but over this replica's max_value_bytes: a miss, left for others


class SplitValue:
    """A split value being received: the view its parts are assembled in, and whether every part arrived."""

    __slots__ = ("header", "ok", "view")

    def __init__(self, view: memoryview, header: SplitHeader) -> None:
        self.view, self.header, self.ok = view, header, True


class HeadReader:
    """The ``Into`` for heads: a plain value lands in a pooled buffer (returned as a memoryview); a split
    head's part 0 lands at the start of a buffer sized for the whole value (returned as a SplitValue), which
    ``PartReader``-s fill later. Buffers taken are appended to ``taken``, for the caller to release."""

    def __init__(self, buffers: TransferBufferPool, max_value_bytes: int, taken: list[np.ndarray]) -> None:
        self._buffers, self._max_value, self._taken = buffers, max_value_bytes, taken

    def __call__(self, n: int, reader: RespReader) -> memoryview | SplitValue | Unusable:
        if n > HEADER_BYTES and reader.peek(4) == SPLIT_MAGIC:
            header = SplitHeader.parse(reader.peek(HEADER_BYTES))
            if header is None or n != HEADER_BYTES + header.part_len:
                reader.skip(n)
                return Unusable.FOREIGN
            if header.total > self._max_value:
                reader.skip(n)
                return Unusable.TOO_LARGE
            view = self._view(header.total)
            reader.skip(HEADER_BYTES)
            reader.read_into(view[: header.part_len])
            return SplitValue(view, header)
        if n > self._max_value:
            reader.skip(n)
            return Unusable.TOO_LARGE
        view = self._view(n)
        reader.read_into(view)
        return view

    def _view(self, n: int) -> memoryview:
        buf = self._buffers.acquire(n)
        self._taken.append(buf)
        return memoryview(buf)[:n]


class PartReader:
    """The ``Into`` for part ``i`` of ``value``: True once it landed in place; False (and ``value.ok`` cleared)
    when the reply has the wrong length or an earlier part already failed."""

    __slots__ = ("_target", "_value")

    def __init__(self, value: SplitValue, i: int) -> None:
        self._value = value
        self._target = value.view[value.header.part_range(i)]

    def __call__(self, n: int, reader: RespReader) -> bool:
        if n != self._target.nbytes or not self._value.ok:
            reader.skip(n)
            return False
        reader.read_into(self._target)
        return True
