"""Worker side of prefill/decode disaggregation (kvtier.integrations.vllm.pd): the prompt's partial last chunk.

A kvtier chunk is always ``chunk_size`` tokens, so the tail of a prompt (``r`` tokens after its last full chunk)
is stored as one chunk whose first ``r`` token rows are the tail's KV and whose other rows are zeros, with the
token ids padded by zeros alike; the blob records those ids and every read checks them, as for any chunk. Its
key, ``tail_key``, hashes a domain of its own, the key of the chunk before it (the namespace's root with the
tenant salt for a prompt shorter than a chunk), the tail's length and tokens, the request's extra keys and the
request's nonce: no prompt's full chunks and no other request's tail can have it.

A load writes back only the blocks that hold the tail (the rows after the tail in its last block are positions
vLLM computes next; they are zeros here, never another request's KV).
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
from kvtier.integrations.vllm.pd import TAIL_TTL_S

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
    """Store ``spec``'s prompt (full chunks, then the tail); returns the tokens newly written. Never raises for
    tier failures (a chunk not stored is a miss the decode instance recomputes)."""
    tokens, extras, size = unpack_tokens(spec.tokens), unpack_extras(spec.extras), cache.chunk_size
    written = cache.store(tokens, PagedSource(paged, spec.block_ids), salt=spec.salt, ttl_s=spec.ttl_s,
                          extras=extras)
    full = len(tokens) - len(tokens) % size
    if full == len(tokens):
        return written
    bs = paged.block_size
    rows = paged.gather(spec.block_ids, full, -(-len(tokens) // bs) * bs)
    paged.synchronize_saves()  # on a GPU the gather runs on a side stream
    chunk = torch.zeros(cache.spec.chunk_shape(size), dtype=rows.dtype, device=rows.device)
    chunk[:, :, : len(tokens) - full] = rows[:, :, : len(tokens) - full]
    parent = cache.keys(tokens[:full], salt=spec.salt, extras=extras)[-1] if full else None
    key = tail_key(cache, parent, tokens[full:], spec.salt, extras, spec.nonce)
    ttl = TAIL_TTL_S if spec.ttl_s is None else min(spec.ttl_s, TAIL_TTL_S)
    done = cache.store_keyed([key], padded_tokens(tokens[full:], size), TensorSource(chunk), salt=spec.salt,
                             ttl_s=ttl, extras=extras)
    return written + (len(tokens) - full if done[0] else 0)


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


def load_tail(cache: KVCache, tokens: np.ndarray, parent: ChunkHash | None, salt: bytes, extras: ExtraKeys,
              nonce: bytes, sink, block_size: int) -> bool:
    """Load the tail of the prompt ``tokens`` into ``sink`` (absolute token positions, whole blocks); whether it
    arrived verified. Never raises for tier failures; a sink's error (a closed load) propagates."""
    size = cache.chunk_size
    full = len(tokens) - len(tokens) % size
    key = tail_key(cache, parent, tokens[full:], salt, extras, nonce)
    rows = min(-(-(len(tokens) - full) // block_size) * block_size, size)
    return cache.retrieve_keyed([key], padded_tokens(tokens[full:], size), _TailSink(sink, full, rows),
                                salt=salt) == 1
