"""vLLM's paged KV cache seen as kvtier's canonical chunks, and back.

vLLM 0.32 hands the connector one tensor per attention layer, logically ``[blocks, kv_heads, block_size, C]``
(vLLM's ``[B, H, N, C]``). Its physical order is one of vLLM's ``KVCacheLayout`` stride orders, and the layers
of a group are views of one allocation at one layer stride: each layer's blocks together (``LBNHC``, ...) or
every layer's page of a block together (``BLNHC``, ..., the cross-layer layouts). Backends differ in what the
content holds:

* the CPU backend keeps, per block and head, ``block_size`` K rows followed by ``block_size`` V rows
  (``C = 2 * head_dim`` is only the allocation's shape);
* CUDA backends keep K and V side by side in each token's content (``C = [K | V]``).

:func:`kv_view` turns either into one strided view ``[blocks, kv_heads, 2, block_size, head_dim]``; the
rest of the module only speaks that view. :class:`PagedKV` gathers a token range of one request into a
canonical ``[layers, 2, tokens, kv_heads, head_dim]`` tensor (a ``KVSource``) and scatters canonical chunks
into a request's blocks (a ``KVSink``).

On a GPU the blocks are gathered and scattered by indexed copies (``fused``): one for all layers where they
share an allocation at one layer stride, as vLLM 0.32 lays them out, else one per layer. Two kernels per layer
and chunk, as on the CPU, would cost more launches than a 32-layer chunk's copy over PCIe takes. Every copy
runs off the model's stream:

* a save gathers a chunk on a side stream into GPU memory and marks it ready there; the raw codec's payload
  then copies it straight into the tier's (pinned) memory, waiting on the GPU, not the host, so the copy of
  one chunk overlaps the gather of the next (``kvtier.native.gpu``);
* a load copies each chunk to the GPU on one stream, straight out of pinned memory (the memory tier's buffer)
  or else through one of two pinned staging buffers, into one of two GPU buffers that a second stream scatters
  into the blocks: one chunk's scatter overlaps the next one's copy. :meth:`PagedKV.settle` returns when the
  copies out of the caller's memory are done (the retrieve calls it before it releases a tier's pins),
  :meth:`PagedKV.synchronize` when every chunk has landed in the blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.base.errors import ConfigError
from kvtier.base.layout import KVSpec
from kvtier.native import gpu


def kv_view(layer: torch.Tensor, *, rows_split: bool) -> torch.Tensor:
    """``[blocks, kv_heads, 2, block_size, head_dim]`` view of one layer's paged tensor (no copy)."""
    if layer.dim() != 4 or layer.shape[-1] % 2:
        raise ConfigError(f"unsupported paged KV tensor shape {tuple(layer.shape)}")
    blocks, heads, block_size, content = layer.shape
    head_dim = content // 2
    if rows_split:  # the CPU backend reinterprets each [block_size, 2 * D] head slab as [2 * block_size, D]
        if layer[0, 0].stride() != (content, 1):
            raise ConfigError("the CPU paged KV layout needs each block's head slab contiguous")
        return layer.view(blocks, heads, 2, block_size, head_dim)
    return layer.unflatten(-1, (2, head_dim)).permute(0, 1, 3, 2, 4)


def stack_layers(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Every layer's view as one ``[layers, blocks, H, 2, bs, D]`` view, where they are views of one allocation
    at one positive layer stride, with one shape, dtype and strides (vLLM 0.32's KV cache groups); else None."""
    first = views[0]
    step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else 1
    storage = first.untyped_storage().data_ptr()
    for i, view in enumerate(views):
        if (view.shape != first.shape or view.stride() != first.stride() or view.dtype != first.dtype
                or view.device != first.device or view.untyped_storage().data_ptr() != storage
                or view.storage_offset() != first.storage_offset() + i * step):
            return None
    if step <= 0:
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


class PagedKV:
    """The paged caches of one worker, in layer order, with the block geometry of the scheduler.

    ``block_size`` is the scheduler's block size; a backend with smaller kernel blocks splits each of them
    into ``block_size // kernel_block_size`` consecutive kernel blocks, which block ids are mapped to.
    ``fused``: gather and scatter with indexed copies (the default on a GPU; on the CPU the per-layer copies
    of whole blocks are kept, which torch's CPU kernels run faster).
    """

    def __init__(self, layers: Sequence[torch.Tensor], block_size: int, *, rows_split: bool,
                 fused: bool | None = None) -> None:
        self.views = [kv_view(t, rows_split=rows_split) for t in layers]
        first = self.views[0]
        kernel_block = first.shape[3]
        if block_size % kernel_block:
            raise ConfigError(f"block size {block_size} is not a multiple of the kernel's {kernel_block}")
        self.split = block_size // kernel_block
        self.block_size = block_size
        self.device = first.device
        self.spec = KVSpec(len(self.views), first.shape[1], first.shape[4], first.dtype)
        self.fused = self.device.type == "cuda" if fused is None else fused
        #: all layers as one [L, 2, blocks, bs, H, D] view, where they allow it (``fused`` only)
        self.stacked = None
        if self.fused and (stacked := stack_layers(self.views)) is not None:
            self.stacked = stacked.permute(0, 3, 1, 4, 2, 5)
        self._gpu = _Transfers(self.device) if self.device.type == "cuda" else None

    # -- block ids -----------------------------------------------------------------------------------------
    def kernel_blocks(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Kernel block indices holding tokens ``[start, end)`` (both multiples of the block size), on the CPU."""
        ids = torch.as_tensor(block_ids[start // self.block_size : end // self.block_size], dtype=torch.long)
        if self.split > 1:
            ids = (ids[:, None] * self.split + torch.arange(self.split)).reshape(-1)
        return ids

    # -- gather (save) -------------------------------------------------------------------------------------
    def gather(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Canonical KV of tokens ``[start, end)`` as a new tensor on the cache's device. On a GPU it is gathered
        on a side stream after everything queued on the default stream (the blocks are fully written) and
        marked ready there (``kvtier.native.gpu.ready_after``): read it through ``kvtier.native.gpu`` or
        synchronise first."""
        ids = self.kernel_blocks(block_ids, start, end)
        if self._gpu is None:
            return self._gather(ids, end - start)
        stream = self._gpu.save
        stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(stream):
            out = self._gather(self._gpu.to_device(ids), end - start)
        return gpu.ready_after(out, stream)

    def _gather(self, ids: torch.Tensor, n_tokens: int) -> torch.Tensor:
        spec, kb = self.spec, self.views[0].shape[3]
        out = torch.empty(spec.chunk_shape(n_tokens), dtype=spec.dtype, device=self.device)
        blocks = out.view(spec.num_layers, 2, len(ids), kb, spec.num_kv_heads, spec.head_dim)
        if self.stacked is not None:
            torch.index_select(self.stacked, 2, ids, out=blocks)
        elif self.fused:
            for view, layer in zip(self.views, blocks):  # [blocks, H, 2, bs, D] -> [2, blocks, bs, H, D]
                torch.index_select(view.permute(2, 0, 3, 1, 4), 1, ids, out=layer)
        else:
            for view, layer in zip(self.views, blocks):
                layer.copy_(view[ids].permute(2, 0, 3, 1, 4))
        return out

    # -- scatter (load) ------------------------------------------------------------------------------------
    def scatter(self, block_ids: Sequence[int], start: int, chunk: torch.Tensor) -> None:
        """Write canonical ``chunk`` (tokens from ``start``, whole blocks) into the request's blocks.

        On the CPU the copy is done when this returns. On a GPU it is queued: a pinned ``chunk`` is copied to
        the GPU straight from its memory, which must stay unchanged until :meth:`settle` returns; any other is
        first copied into a pinned staging buffer and may be reused at once. :meth:`synchronize` waits until
        the blocks hold it.
        """
        end = start + chunk.shape[2]
        ids = self.kernel_blocks(block_ids, start, end)
        if self._gpu is None:
            self._scatter(ids, chunk)
            return
        self._gpu.load(chunk, lambda staged, dev_ids: self._scatter(dev_ids, staged), ids)

    def _scatter(self, ids: torch.Tensor, chunk: torch.Tensor) -> None:
        spec, kb = self.spec, self.views[0].shape[3]
        blocks = chunk.reshape(spec.num_layers, 2, len(ids), kb, spec.num_kv_heads, spec.head_dim)
        if self.stacked is not None:
            self.stacked.index_copy_(2, ids, blocks)
        elif self.fused:
            for view, layer in zip(self.views, blocks):
                view.permute(2, 0, 3, 1, 4).index_copy_(1, ids, layer)
        else:
            for view, layer in zip(self.views, blocks):
                # [2, blocks, bs, H, D] -> [blocks, H, 2, bs, D]
                view[ids] = layer.permute(1, 3, 0, 2, 4)

    def settle(self) -> None:
        """Block until every copy out of a caller's pinned chunk has finished (the chunk may then change)."""
        if self._gpu is not None:
            self._gpu.settle()

    def synchronize(self) -> None:
        """Block until every scatter issued so far has landed in the paged cache."""
        if self._gpu is not None:
            self._gpu.synchronize()

    def synchronize_saves(self) -> None:
        """Block until every gather issued so far has read the paged cache (its blocks may then be reused)."""
        if self._gpu is not None:
            self._gpu.save.synchronize()


class _Transfers:
    """The streams and buffers of one GPU's loads and saves (module docstring).

    Loads come from one thread at a time (the retrieve pipeline serialises a sink's writes, and the connector
    runs one load at a time: on its loading thread, or in ``start_load_kv`` for synchronous loads).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.save = torch.cuda.Stream(device)  # the saving thread's gathers
        self._copy = torch.cuda.Stream(device)  # loads: host -> GPU buffers
        self._scatter = torch.cuda.Stream(device)  # loads: GPU buffers -> blocks
        self._buffers: list[torch.Tensor] = []  # two GPU buffers of one chunk (bytes)
        self._free: list[torch.cuda.Event | None] = [None, None]  # set when a buffer's scatter is done
        self._staging: list[torch.Tensor] = []  # two pinned host buffers (bytes), for chunks that are not pinned
        self._staged: list[torch.cuda.Event | None] = [None, None]  # set when a staging buffer's copy is done
        self._direct: torch.cuda.Event | None = None  # the last copy straight out of a caller's chunk
        self._turn = 0

    def to_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Block indices to the GPU on the current stream, from pinned memory (no wait on other streams)."""
        return ids.pin_memory().to(self.device, non_blocking=True)

    def load(self, chunk: torch.Tensor, scatter, ids: torch.Tensor) -> None:
        """Queue ``chunk``'s copy to the GPU and ``scatter(gpu_chunk, gpu_ids)`` after it."""
        nbytes = chunk.numel() * chunk.element_size()
        if not self._buffers or self._buffers[0].numel() < nbytes:
            self.synchronize()  # the old buffers may still be read
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
            self._staging, self._free, self._staged = [], [None, None], [None, None]
        self._turn ^= 1
        turn = self._turn
        direct = chunk.is_pinned() and chunk.is_contiguous()
        source = chunk if direct else self._stage(chunk, turn, nbytes)
        buffer = _typed(self._buffers[turn], chunk)
        free = self._free[turn]
        if free is not None:
            self._copy.wait_event(free)  # the buffer's last scatter has read it
        with torch.cuda.stream(self._copy):
            buffer.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copy)
        if direct:
            self._direct = copied
        else:
            self._staged[turn] = copied
        self._scatter.wait_event(copied)
        self._scatter.wait_stream(torch.cuda.current_stream(self.device))  # earlier users of the blocks are done
        with torch.cuda.stream(self._scatter):
            scatter(buffer, self.to_device(ids))
            done = torch.cuda.Event()
            done.record(self._scatter)
        self._free[turn] = done

    def _stage(self, chunk: torch.Tensor, turn: int, nbytes: int) -> torch.Tensor:
        """``chunk`` copied into a pinned staging buffer, once that buffer's last copy to the GPU is done."""
        if not self._staging:
            capacity = self._buffers[0].numel()
            self._staging = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        staged = self._staged[turn]
        if staged is not None:
            staged.synchronize()
        return _typed(self._staging[turn], chunk).copy_(chunk)

    def settle(self) -> None:
        if self._direct is not None:
            self._direct.synchronize()
            self._direct = None

    def synchronize(self) -> None:
        self._copy.synchronize()
        self._scatter.synchronize()


def _typed(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The start of byte ``buffer`` as a contiguous tensor of ``like``'s shape and dtype."""
    return buffer[: like.numel() * like.element_size()].view(like.dtype).view(like.shape)


class PagedSource:
    """One request's computed tokens as a kvtier ``KVSource``."""

    def __init__(self, paged: PagedKV, block_ids: Sequence[int]) -> None:
        self.paged, self.block_ids = paged, block_ids
        self.device = paged.device

    def chunk(self, start: int, end: int) -> torch.Tensor:
        return self.paged.gather(self.block_ids, start, end)


class PagedSink:
    """One request's blocks as a kvtier ``KVSink`` that leaves blocks below ``first_token`` alone.

    Those blocks come from vLLM's own prefix cache and may be shared with running requests.
    ``first_token`` is a multiple of the block size.
    """

    def __init__(self, paged: PagedKV, block_ids: Sequence[int], first_token: int) -> None:
        self.paged, self.block_ids, self.first_token = paged, block_ids, first_token

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        skip = max(self.first_token - start, 0)
        if skip < end - start:
            self.paged.scatter(self.block_ids, start + skip, chunk[:, :, skip:])

    def settle(self) -> None:
        self.paged.settle()
