"""Cutting reads into gets a ``BoundedGets`` tier can hold (kvtier/tiers/base.py).

Such a tier reads one get's values into a transfer buffer of ``max_get_bytes``: a get asking for more than fits
gives misses for the rest. The cache knows a KV entry's size before reading it (its tokens times the KV bytes
per token, plus the blob header; a codec only makes blobs smaller), so it asks for as many as fit at once; an
entry of unknown size (a state snapshot) is read alone (``UNKNOWN``). Writes are cut by their blobs' sizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvtier.base.layout import KVSpec
from kvtier.codecs.blob import ALIGN, header_length
from kvtier.tiers import BoundedGets, Tier

#: the size to give ``batches`` for an entry whose blob size is not known before reading it: one get each
UNKNOWN = 1 << 62


def aligned(nbytes: int) -> int:
    """``nbytes`` as a bounded tier places it (rounded up to ``ALIGN``)."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def blob_bytes(spec: KVSpec | None, n_tokens: int) -> int:
    """The most bytes the blob of ``n_tokens`` tokens of ``spec``'s KV takes in a bounded get (rounded up to
    ``ALIGN``, as such a tier places values)."""
    if spec is None:
        return ALIGN
    ndim = len(spec.chunk_shape(n_tokens))
    raw = header_length(ndim, n_tokens) + spec.bytes_per_token * n_tokens
    return aligned(raw)


def per_get(tier: Tier, entry_bytes: int) -> int | None:
    """How many entries of ``entry_bytes`` one get of ``tier`` holds (at least 1); None: any number."""
    if not isinstance(tier, BoundedGets):
        return None
    return max(1, tier.max_get_bytes // max(entry_bytes, 1))


def batches(tier: Tier, sizes: Sequence[int]) -> Iterator[list[int]]:
    """Indices of ``sizes`` (each entry's ``blob_bytes``), cut in order into gets that ``tier`` holds: all of
    them at once for a tier without bounded gets; an entry larger than the bound alone."""
    if not isinstance(tier, BoundedGets):
        yield list(range(len(sizes)))
        return
    batch: list[int] = []
    held = 0
    for i, n in enumerate(sizes):
        if batch and held + n > tier.max_get_bytes:
            yield batch
            batch, held = [], 0
        batch.append(i)
        held += n
    if batch:
        yield batch
