"""Cache-sized blocks for the quantising codecs' float arithmetic.

A chunk's float32 working copy is 2x its bf16 bytes (a 256-token chunk of an 8B model: 64 MiB), so every
whole-chunk elementwise step would stream it through DRAM and fault in fresh pages. Instead the codecs walk
a contiguous chunk in blocks of whole groups (or head vectors) of about ``BLOCK_ELEMS`` float32 values,
reusing one scratch buffer that stays in cache while a block goes through all of its steps. Each block is a
handful of vectorised torch ops that release the GIL; the Python loop runs a few times per MiB, not per
vector or group. Decoding writes each block straight into its place in the destination
(``destination_blocks``), which may be a token range of a larger tensor. ``BLOCK_ELEMS`` is the block size
that decoded fastest (docs/benchmarks/codecs.md, "Measurements behind the codecs' design").
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: float32 values per block: 2 MiB, with the block's codes and output within a core's L2 and its share of L3.
BLOCK_ELEMS = 1 << 19


def blocks(n_items: int, item_len: int, unit: int = 1) -> Iterator[tuple[int, int]]:
    """``(start, end)`` item ranges of about ``BLOCK_ELEMS`` values, each a multiple of ``unit`` items except
    possibly the last. ``item_len`` values per item; an item larger than a block is a block of its own."""
    per = max(unit, BLOCK_ELEMS // max(item_len, 1) // unit * unit)
    for start in range(0, n_items, per):
        yield start, min(n_items, start + per)


def destination_blocks(out: torch.Tensor, item_len: int,
                       unit: int = 1) -> Iterator[tuple[int, int, torch.Tensor]] | None:
    """Blocks of items (as ``blocks``) paired with the part of ``out`` each decodes into, or None.

    ``out`` is a canonical ``[L, 2, T, H, D]`` destination whose ``[T, H, D]`` slab per (layer, K/V) is
    contiguous, though the slabs need not be adjacent (a token range of a larger tensor, the retrieve
    pipeline's sink). Items are ``item_len`` consecutive values in canonical order (``item_len`` divides
    ``D``). Yields ``(start, end, view)`` where ``view`` holds exactly the values of items ``[start, end)``
    in canonical order (a block never straddles slabs unless it covers them whole), so a caller copies a
    contiguous block into ``view`` reshaped to ``view.shape``. None when ``out``'s slabs are not contiguous
    (the caller then decodes into a contiguous tensor and copies once).
    """
    layers, two, tokens, heads, dim = out.shape
    slab = tokens * heads * dim
    if slab == 0 or dim % item_len:
        return None
    try:
        rows = out.view(layers * two, slab)
    except RuntimeError:  # slabs not contiguous: no view covers them
        return None
    return _slab_blocks(rows, item_len, unit)


def _slab_blocks(rows: torch.Tensor, item_len: int, unit: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    n_rows, slab = rows.shape
    per_row = slab // item_len
    if slab <= BLOCK_ELEMS:  # whole slabs per block
        step = max(1, BLOCK_ELEMS // slab)
        for r0 in range(0, n_rows, step):
            r1 = min(n_rows, r0 + step)
            yield r0 * per_row, r1 * per_row, rows[r0:r1]
        return
    for r in range(n_rows):  # a slab larger than a block: blocks within it
        for s, e in blocks(per_row, item_len, unit):
            yield r * per_row + s, r * per_row + e, rows[r, s * item_len : e * item_len]
