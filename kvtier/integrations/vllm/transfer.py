"""Worker side of prefill/decode disaggregation (kvtier.integrations.vllm.pd): the prompt's partial last chunk.

What travels is whole vLLM blocks only, never a block's first rows. A paged block's bytes are not token rows in
every backend: vLLM's CPU kernels keep a block's K transposed (``[head_dim, block_size]`` per head), so the
first ``r`` "rows" of a partly filled block hold a few dimensions of every token, and copying them with zeros
after them ruins the K of every token in that block. So the decode side is promised the prompt's whole blocks
before the block of its last token (``pd.loadable_tokens``) and computes that last block itself (at least one
token, as vLLM needs to sample): every block it loads was copied whole, whatever the backend's layout.

A kvtier chunk is always ``chunk_size`` tokens, so the tail (the whole blocks after the prompt's last full
chunk, up to ``pd.loadable_tokens``) is stored as one chunk whose first rows are those blocks and whose other
rows are zeros, with the token ids padded by zeros alike; the blob records those ids and every read checks
them, as for any chunk. Its key, ``tail_key``, hashes a domain of its own, the key of the chunk before it (the
namespace's root with the tenant salt for a prompt shorter than a chunk), the tail's length and tokens, the
request's extra keys and the request's nonce: no prompt's full chunks and no other request's tail can have it.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from kvtier.base.keys import ChunkHash, ExtraKeys
from kvtier.core.cache import KVCache, TensorSource
from kvtier.integrations.vllm.metadata import TransferSpec, unpack_extras, unpack_tokens
from kvtier.integrations.vllm.paged import PagedKV, PagedSource
from kvtier.integrations.vllm.pd import TAIL_TTL_S, loadable_tokens

TAIL_DOMAIN = b"kvtier/vllm-pd-tail\0"
_U32 = struct.Struct("<I")


def tail_key(cache: KVCache, parent: ChunkHash | None, tail: np.ndarray, salt: bytes, extras: ExtraKeys,
             nonce: bytes) -> ChunkHash:
    """The key of a prompt's tail (module docstring); ``parent``: the key of its last full chunk, None if none."""
    h = hashlib.sha256(TAIL_DOMAIN)
    h.update(parent if parent is not None else cache.namespace.with_salt(salt).root)
    h.update(_U32.pack(len(tail)))
    h.update(memoryview(np.ascontiguousarray(tail, dtype="<u4")).cast("B"))
    h.update(extras.encode() if extras else b"")
    h.update(nonce)
    return ChunkHash(h.digest())


def padded_tokens(tail: np.ndarray, chunk_size: int) -> np.ndarray:
    out = np.zeros(chunk_size, dtype="<u4")
    out[: len(tail)] = tail
    return out


def store_transfer(cache: KVCache, paged: PagedKV, spec: TransferSpec) -> int:
    """Store ``spec``'s prompt (full chunks, then the tail's whole blocks, module docstring); returns the tokens
    newly written. Never raises for tier failures (a chunk not stored is a miss the decode instance recomputes)."""
    tokens, extras, size = unpack_tokens(spec.tokens), unpack_extras(spec.extras), cache.chunk_size
    written = cache.store(tokens, PagedSource(paged, spec.block_ids), salt=spec.salt, ttl_s=spec.ttl_s,
                          extras=extras)
    full = len(tokens) - len(tokens) % size
    end = loadable_tokens(len(tokens), paged.block_size)
    if end <= full:
        return written
    rows = paged.gather(spec.block_ids, full, end)
    paged.synchronize_saves()  # on a GPU the gather runs on a side stream
    chunk = torch.zeros(cache.spec.chunk_shape(size), dtype=rows.dtype, device=rows.device)
    chunk[:, :, : end - full] = rows
    parent = cache.keys(tokens[:full], salt=spec.salt, extras=extras)[-1] if full else None
    key = tail_key(cache, parent, tokens[full:end], spec.salt, extras, spec.nonce)
    ttl = TAIL_TTL_S if spec.ttl_s is None else min(spec.ttl_s, TAIL_TTL_S)
    # a shared tier that cannot expire entries (the Mooncake pool) keeps the tail until its own eviction: without
    # it there, the decode instance would recompute up to a chunk of every prompt
    done = cache.store_keyed([key], padded_tokens(tokens[full:end], size), TensorSource(chunk), salt=spec.salt,
                             ttl_s=ttl, extras=extras, ttl_required=False)
    return written + (end - full if done[0] else 0)


class _TailSink:
    """Writes the first ``rows`` token rows of the tail chunk (whole blocks) at token ``base`` of ``sink``."""

    def __init__(self, sink, base: int, rows: int) -> None:
        self.sink, self.base, self.rows = sink, base, rows

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self.sink.write(self.base + start, self.base + start + self.rows, chunk[:, :, : self.rows])

    def settle(self) -> None:
        settle = getattr(self.sink, "settle", None)
        if settle is not None:
            settle()


def load_tail(cache: KVCache, tail: np.ndarray, base: int, parent: ChunkHash | None, salt: bytes,
              extras: ExtraKeys, nonce: bytes, sink) -> bool:
    """Load the tail ``tail`` (the prompt's tokens from ``base``, the end of its last full chunk; whole blocks)
    into ``sink`` (absolute token positions); whether it arrived verified. Never raises for tier failures; a
    sink's error (a closed load) propagates."""
    size = cache.chunk_size
    if not 0 < len(tail) <= size:
        return False
    key = tail_key(cache, parent, tail, salt, extras, nonce)
    return cache.retrieve_keyed([key], padded_tokens(tail, size), _TailSink(sink, base, len(tail)),
                                salt=salt) == 1
