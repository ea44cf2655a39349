"""vLLM's paged KV cache seen as kvtier's canonical chunks, and back.

vLLM hands the connector one tensor per attention layer, logically ``[blocks, kv_heads, block_size, C]``.
Backends differ in what the content holds:

* the CPU backend keeps, per block and head, ``block_size`` K rows followed by ``block_size`` V rows
  (``C = 2 * head_dim`` is only the allocation's shape);
* CUDA backends keep K and V side by side in each token's content (``C = [K | V]``).

:func:`kv_view` turns either into one strided view ``[blocks, kv_heads, 2, block_size, head_dim]``; the
rest of the module only speaks that view. :class:`PagedKV` gathers a token range of one request into a
canonical ``[layers, 2, tokens, kv_heads, head_dim]`` tensor (a ``KVSource``) and scatters canonical chunks
into a request's blocks (a ``KVSink``). On a GPU, loads go through pinned host buffers and non-blocking
copies on a side stream, and saves gather on that stream, so neither waits on the model's stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError
from kvtier.layout import KVSpec


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


class PagedKV:
    """The paged caches of one worker, in layer order, with the block geometry of the scheduler.

    ``block_size`` is the scheduler's block size; a backend with smaller kernel blocks splits each of them
    into ``block_size // kernel_block_size`` consecutive kernel blocks, which block ids are mapped to.
    """

    def __init__(self, layers: Sequence[torch.Tensor], block_size: int, *, rows_split: bool) -> None:
        self.views = [kv_view(t, rows_split=rows_split) for t in layers]
        first = self.views[0]
        kernel_block = first.shape[3]
        if block_size % kernel_block:
            raise ConfigError(f"block size {block_size} is not a multiple of the kernel's {kernel_block}")
        self.split = block_size // kernel_block
        self.block_size = block_size
        self.device = first.device
        self.spec = KVSpec(len(self.views), first.shape[1], first.shape[4], first.dtype)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # loads
        self._save_stream = torch.cuda.Stream(self.device) if cuda else None  # the saving thread's gathers
        self._staging: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._turn = 0

    # -- block ids -----------------------------------------------------------------------------------------
    def kernel_blocks(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Kernel block indices holding tokens ``[start, end)`` (both multiples of the block size)."""
        ids = torch.as_tensor(block_ids[start // self.block_size : end // self.block_size], dtype=torch.long)
        if self.split > 1:
            ids = (ids[:, None] * self.split + torch.arange(self.split)).reshape(-1)
        return ids.to(self.device, non_blocking=True)

    # -- gather (save) -------------------------------------------------------------------------------------
    def gather(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Canonical KV of tokens ``[start, end)`` as a new host tensor (on a GPU: gathered on a side stream)."""
        if self._save_stream is None:
            return self._gather(block_ids, start, end)
        self._save_stream.wait_stream(torch.cuda.default_stream(self.device))  # blocks fully written
        with torch.cuda.stream(self._save_stream):
            host = self._gather(block_ids, start, end).to("cpu", non_blocking=True)
        self._save_stream.synchronize()
        return host

    def _gather(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        ids = self.kernel_blocks(block_ids, start, end)
        spec, kb = self.spec, self.views[0].shape[3]
        out = torch.empty(spec.chunk_shape(end - start), dtype=spec.dtype, device=self.device)
        for view, layer in zip(self.views, out):
            # [blocks, H, 2, bs, D] -> [2, blocks, bs, H, D], the canonical [2, n, H, D] in blocks
            layer.view(2, len(ids), kb, spec.num_kv_heads, spec.head_dim).copy_(view[ids].permute(2, 0, 3, 1, 4))
        return out

    # -- scatter (load) ------------------------------------------------------------------------------------
    def scatter(self, block_ids: Sequence[int], start: int, chunk: torch.Tensor) -> None:
        """Write canonical ``chunk`` (tokens from ``start``, whole blocks) into the request's blocks.

        ``chunk`` may be a view the caller reuses after this returns: on a GPU it is first copied into a
        pinned staging buffer, from which the device copy runs asynchronously (see :meth:`synchronize`).
        """
        end = start + chunk.shape[2]
        ids = self.kernel_blocks(block_ids, start, end)
        if self._stream is None:
            self._scatter(ids, chunk)
            return
        staged = self._stage(chunk)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # earlier users of the blocks are done
        with torch.cuda.stream(self._stream):
            self._scatter(ids, staged.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[self._turn] = event

    def _scatter(self, ids: torch.Tensor, chunk: torch.Tensor) -> None:
        kb = self.views[0].shape[3]
        for view, layer in zip(self.views, chunk):
            # [2, n, H, D] -> [2, blocks, bs, H, D] -> [blocks, H, 2, bs, D]
            view[ids] = layer.reshape(2, -1, kb, *layer.shape[2:]).permute(1, 3, 0, 2, 4)

    def _stage(self, chunk: torch.Tensor) -> torch.Tensor:
        """Copy ``chunk`` into one of two pinned buffers, waiting until that buffer's last copy is done."""
        if not self._staging or self._staging[0].shape != chunk.shape:
            self._staging = [torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=True) for _ in range(2)]
            self._events = [None, None]
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        return self._staging[self._turn].copy_(chunk)

    def synchronize(self) -> None:
        """Block until every scatter issued so far has landed in the paged cache."""
        if self._stream is not None:
            self._stream.synchronize()


class PagedSource:
    """One request's computed tokens as a kvtier ``KVSource``."""

    def __init__(self, paged: PagedKV, block_ids: Sequence[int]) -> None:
        self.paged, self.block_ids = paged, block_ids

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
