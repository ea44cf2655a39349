"""Copies between host memory and a GPU that stay off the engine's stream.

kvtier moves KV between host memory and GPUs in three places: the vLLM connector's paged blocks, a CUDA tensor
handed to ``KVCache.store``, and the memory tier when its buffer lives on a GPU (``device: cuda:N``). Those
copies run on one side stream per device (:func:`side_stream`), never on the current stream: on the default
stream a copy would queue behind the forward pass the engine has already launched, and the next forward pass
behind the copy.

Contract of :func:`copy_pairs`: a copy from a source that carries an event (:func:`ready_after`, as
``PagedKV.gather`` marks what it gathers on its own stream) starts after that event, on the GPU, so the copy of
one chunk overlaps the gather of the next; any other copy starts after the work queued so far on the calling
thread's current stream. A source produced on any other stream must be ready before the call
(``KVCache.store`` synchronises its caller's current stream for a source on a GPU). The call returns once
every copy has landed, so the host memory it read or wrote may be reused at once. Pinned host memory (the
memory tier's buffer, kvtier's staging buffers) is copied by DMA at the link's speed; pageable memory goes
through the driver's own staging buffers at a fraction of it. torch is the only dependency; nothing here runs
without a GPU source or destination.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}
_lock = threading.Lock()


def on_gpu(tensor: torch.Tensor) -> bool:
    """True for a tensor in a GPU's memory (anything but the host's)."""
    return tensor.device.type != "cpu"


def side_stream(device: torch.device | str) -> torch.cuda.Stream:
    """This process's stream for kvtier's copies to and from ``device`` (created on first use)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
        return stream


def ready_after(tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    """Mark ``tensor`` as ready once the work queued on ``stream`` so far is done (:func:`copy_pairs` waits for
    that on the GPU, not on the host). Returns ``tensor``."""
    event = torch.cuda.Event()
    event.record(stream)
    tensor._kvtier_ready = event  # torch tensors take attributes; copies and views do not inherit it
    return tensor


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dest.copy_(src)`` for every pair, each with a GPU on at least one side, issued back to back on the
    GPU's side stream; returns when all have landed."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dest, src in pairs:
        device = src.device if on_gpu(src) else dest.device
        by_device.setdefault(device, []).append((dest, src))
    for device, group in by_device.items():
        stream = side_stream(device)
        if any(getattr(src, "_kvtier_ready", None) is None for _, src in group):
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for dest, src in group:
                ready = getattr(src, "_kvtier_ready", None)
                if ready is not None:
                    stream.wait_event(ready)
                dest.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into new pinned host memory (the caching host allocator reuses it once freed)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    copy_pairs([(out, tensor)])
    return out

