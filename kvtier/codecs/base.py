"""The Codec protocol: a canonical chunk tensor <-> payload bytes.

A codec never sees keys, tokens or headers (blob.py owns those); it only turns a ``[layers, 2, tokens,
kv_heads, head_dim]`` tensor into bytes and back. ``decode`` receives the shape and dtype recorded in the blob
header and must raise CodecError (never crash, never allocate beyond what the shape implies) when the payload
does not fit them.

A codec may also decode straight into memory the caller owns (``decode_into``; call it through the function
of that name here, which falls back to ``decode`` and one copy): the retrieve pipeline decodes into the
engine's destination or a reused buffer, so loading a chunk allocates nothing and makes no extra pass over
its bytes. Fresh chunk-sized tensors cost the kernel a zeroed page per 4 KiB, which takes longer than
int8's whole decode (docs/benchmarks/codecs.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kvtier.base.errors import CodecError
from kvtier.native import gpu
from kvtier.native.bulkcopy import copy_pairs


@runtime_checkable
class Payload(Protocol):
    """Bytes not yet materialised: ``nbytes`` long, written once into caller-owned memory.

    This lets a tier give the writer its own buffer (a slot of the memory tier, a staging buffer of the disk
    tier), so a chunk is copied once per hop instead of being built, then copied.
    """

    @property
    def nbytes(self) -> int: ...

    def write_into(self, out: memoryview) -> None:
        """Write exactly ``nbytes`` bytes into ``out`` (a writable, C-contiguous byte view of that length)."""

    # Optional: def deferred_copies(self, out: memoryview) -> list[tuple[torch.Tensor, torch.Tensor]]
    #     Write into ``out`` what is cheap now and return the ``(destination, source)`` tensor copies still
    #     to do; once they are done ``out`` holds what ``write_into`` writes. Lets a tier that writes many
    #     payloads do all their bulk copies in one call (``write_payloads``).
    #
    # Optional: def write_visiting(self, out: memoryview, visit) -> bool
    #     ``write_into``, handing ``visit`` the payload's bytes in order as they are written, so a blob's seal
    #     hashes them in the same pass (raw); False, nothing written, where it cannot.


class BytesPayload:
    """A Payload over bytes that already exist."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._data = memoryview(data).cast("B")

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    def write_into(self, out: memoryview) -> None:
        out[: self._data.nbytes] = self._data


class Codec(Protocol):
    """Turns canonical chunk tensors into payload bytes and back. Stateless and thread-safe."""

    #: Registry name, as written in configs ("raw", "lossless", "int8", ...).
    name: str
    #: Stable id written into every blob header. Never reuse an id for a different format.
    codec_id: int
    #: True when decode(encode(t)) is bit-identical to t. Only exact codecs may store recurrent (SSM) state.
    exact: bool

    def encode(self, chunk: torch.Tensor) -> Payload:
        """Encode a canonical chunk (any strides) into a payload. May defer the copy to ``write_into``,
        so ``chunk`` must stay unchanged until the payload is written."""

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode a payload into a tensor of ``shape``/``dtype``. The result may view ``payload`` (no copy),
        so it is valid only while the payload's memory is; copy out of it before releasing that memory."""

    # Optional: copies_only: bool -- see CopiesOnly.
    #
    # Optional: device_chunks: bool -- True for a codec whose encode takes a chunk on a GPU (its payload copies
    # it to the host when written); others are handed a host copy (``kvtier.codecs.blob.encode_blob``).
    #
    # Optional: def decode_into(self, payload, shape, dtype, out: torch.Tensor) -> None -- see DecodesInto.


@runtime_checkable
class CopiesOnly(Protocol):
    """Optional codec capability: ``copies_only`` True for a codec whose encode and decode only copy bytes (raw),
    which the pipeline then runs in the calling thread instead of on its pool."""

    copies_only: bool


@runtime_checkable
class DecodesInto(Protocol):
    """Optional codec capability: decoding into memory the caller owns."""

    def decode_into(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor) -> None:
        """Decode into ``out`` (``shape``, on the CPU, any floating dtype the codec accepts, any strides: a token
        range of a larger tensor). The same checks and errors as ``decode``; on a CodecError ``out`` may hold part
        of the chunk. Never writes outside ``out``."""


def check_destination(out: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """CodecError unless ``out`` can take a decoded chunk of ``shape``: that shape, on the CPU."""
    if tuple(out.shape) != tuple(shape) or out.device.type != "cpu":
        raise CodecError(f"{what}: cannot decode {tuple(shape)} into a {tuple(out.shape)} tensor on {out.device}")


def decode_into(codec: Codec, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype,
                out: torch.Tensor) -> None:
    """Decode ``payload`` into ``out`` with ``codec``'s own ``decode_into`` where it has one, else ``decode``
    and one copy (a codec registered from outside need not implement it; ``copy_tensors``: streaming stores where
    the chunk is large)."""
    if isinstance(codec, DecodesInto):
        codec.decode_into(payload, shape, dtype, out)
        return
    check_destination(out, shape, codec.name)
    copy_tensors([(out, codec.decode(payload, shape, dtype))])  # raw's view of a network tier's buffer: streamed


def copy_tensors(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dest.copy_(src)`` for every pair: with streaming stores over all copy threads where the copies are
    large and fit (kvtier.native.bulkcopy: 1.3-1.5x torch's copy here), else in one call into torch where it has one
    (``_foreach_copy_``, which torch's optimizers use; a loop otherwise). Python work between large copies
    slowed them by 5-10% here (the memory tier's retrieve: 0.85-0.88 of one flat copy in a loop, 0.91-0.94 in
    one call). Pairs with a GPU on either side go to ``gpu.copy_pairs`` (its side stream, back to back)."""
    on_gpu = [(d, s) for d, s in pairs if gpu.on_gpu(d) or gpu.on_gpu(s)]
    if on_gpu:
        gpu.copy_pairs(on_gpu)
        pairs = [(d, s) for d, s in pairs if not (gpu.on_gpu(d) or gpu.on_gpu(s))]
    if not pairs or copy_pairs(pairs):
        return
    copy_all = getattr(torch, "_foreach_copy_", None)
    if copy_all is not None:
        copy_all([d for d, _ in pairs], [s for _, s in pairs])
    else:
        for dest, src in pairs:
            dest.copy_(src)


def write_payloads(items: Sequence[tuple[memoryview, Payload]]) -> None:
    """``payload.write_into(out)`` for every item, with the bulk copies of payloads that can defer them
    (``deferred_copies``) done together at the end in one call."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for out, payload in items:
        defer = getattr(payload, "deferred_copies", None)
        if defer is not None:
            pairs += defer(out)
        else:
            payload.write_into(out)
    copy_tensors(pairs)
