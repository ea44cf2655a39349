"""The raw codec: the tensor's bytes as they are. Zero-copy decode, one copy on encode.

A chunk on a GPU stays there until the tier writes the payload: its one copy is then the device-to-host copy
straight into the tier's memory (``kvtier.native.gpu``), with no host copy in between.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.base.errors import CodecError
from kvtier.base.layout import tensor_view
from kvtier.codecs.base import copy_tensors
from kvtier.native.bulkcopy import copy_visiting


class _TensorPayload:
    __slots__ = ("_chunk",)

    def __init__(self, chunk: torch.Tensor) -> None:
        self._chunk = chunk

    @property
    def nbytes(self) -> int:
        return self._chunk.numel() * self._chunk.element_size()

    def write_into(self, out: memoryview) -> None:
        copy_tensors(self.deferred_copies(out))

    def write_visiting(self, out: memoryview, visit: Callable[[memoryview], object]) -> bool:
        """``write_into``, calling ``visit`` on the chunk's bytes in order, each piece just before it is copied
        (a seal hashes them in the same pass: ``bulkcopy.copy_visiting``); False, nothing written or visited,
        where that cannot be done (a chunk on a GPU, no streaming-copy kernel)."""
        chunk = self._chunk
        if chunk.numel() == 0 or chunk.device.type != "cpu":
            return False
        return copy_visiting(tensor_view(out, chunk.dtype, tuple(chunk.shape)), chunk, visit)

    def deferred_copies(self, out: memoryview) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The one copy this payload is: the chunk into ``out`` (see ``Payload``)."""
        chunk = self._chunk
        if chunk.numel() == 0:
            return []
        return [(tensor_view(out, chunk.dtype, tuple(chunk.shape)), chunk)]


class RawCodec:
    name = "raw"
    codec_id = 0
    exact = True
    #: encode defers its one copy to the tier (``write_into``) and decode views the payload: the codec itself
    #: does no work, so the pipeline has nothing to spread over threads (see ``Codec``)
    copies_only = True
    #: encode takes a chunk on a GPU as it is (``kvtier.codecs.blob.encode_blob`` copies it to the host for codecs
    #: without this flag)
    device_chunks = True

    def encode(self, chunk: torch.Tensor) -> _TensorPayload:
        return _TensorPayload(chunk)

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        if payload.nbytes != numel * dtype.itemsize:
            raise CodecError(f"raw payload of {payload.nbytes} bytes does not hold {shape} {dtype}")
        if numel == 0:  # torch cannot view an empty buffer
            return torch.empty(shape, dtype=dtype)
        return tensor_view(payload, dtype, shape)
