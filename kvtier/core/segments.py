"""The segment cache: whole segments of KV, each under a key of its own tokens, for non-prefix reuse.

A segment (a retrieved passage, one chat message) is cached as one entry: the canonical KV
``[layers, 2, tokens, kv_heads, head_dim]`` of its tokens computed alone, the first token at a fixed base
position, under ``Namespace.segment_hash`` (its own key domain, salted per tenant like prefix chunks). Entries
go through the KVCache's chain of tiers (chain.py) with their codecs and the same blob format and verification,
so a segment costs no new storage code:

* ``retrieve`` walks the tiers fastest first; every hit is verified (token ids always, checksum where the
  tier seals) and copied out; a hit in a slower tier is promoted into the faster ones. A segment that fails
  verification is deleted and counted (``kvtier_corrupt_chunks_total``) and looked for further down; found
  nowhere, it is a miss (``None``) and the engine recomputes it.
* ``store`` writes to the first tier and every write-through tier; write-back tiers get segments when the
  tier above evicts them, as for chunks. Stores and promotions are reported as ``EntryKind.SEGMENT`` events.
* A failing tier is a miss or a skipped store plus ``kvtier_tier_errors_total``; nothing is raised.

Segments are not chunked: a segment shorter than a chunk is cached like any other. How an engine blends cached
segments into a prompt is its own configuration (``kvtier.integrations.blend.BlendConfig``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtier.base.errors import BlobError, ConfigError
from kvtier.base.keys import ChunkHash, Tokens, token_array
from kvtier.codecs.blob import decode_blob
from kvtier.core.cache import KVCache
from kvtier.core.events import EntryKind
from kvtier.core.jobs import Entry
from kvtier.core.metrics import SEGMENT_HIT_TOKENS, SEGMENT_MISS_TOKENS, SEGMENT_RETRIEVE_SECONDS, SEGMENT_STORED_TOKENS
from kvtier.tiers import Tier

#: Segments one prompt may have: a prompt with more is not blended (a plain prefill; chats with more messages
#: are not even segmented). Each segment that missed costs a forward pass of its own after the first token, so
#: this bounds the passes a request can cause; 64 is far more passages than a RAG prompt carries.
MAX_SEGMENTS = 64


class SegmentCache:
    """Segments of KV in ``cache``'s tiers (a companion of KVCache: the same chain of tiers and metrics).

    ``base_position`` is where segments are computed (their first token's position); it is part of the key.
    Thread-safe as far as the tiers are.
    """

    def __init__(self, cache: KVCache, base_position: int = 0) -> None:
        if base_position < 0:
            raise ConfigError(f"base_position must be >= 0, got {base_position}")
        self.cache = cache
        self.base_position = base_position

    def key(self, tokens: Tokens, *, salt: bytes = b"") -> ChunkHash:
        return self.cache.namespace.with_salt(salt).segment_hash(tokens, self.base_position)

    def contains(self, segments: Sequence[Tokens], *, salt: bytes = b"") -> list[bool]:
        """Which segments some tier holds now (no verification, no side effects)."""
        return [t is not None for t in self.cache.chain.locate([self.key(seg, salt=salt) for seg in segments])]

    def retrieve(self, segments: Sequence[Tokens], *, salt: bytes = b"") -> list[torch.Tensor | None]:
        """The canonical KV of each segment (a new tensor of its own, the caller's to modify), or None where no
        tier holds a verified copy."""
        metrics = self.cache.metrics
        with metrics.timer(SEGMENT_RETRIEVE_SECONDS):
            arrays = [token_array(seg) for seg in segments]
            keys = [self.key(ids, salt=salt) for ids in arrays]
            tokens = dict(zip(keys, arrays))
            found = self.cache.chain.read(tokens, self._decode, EntryKind.SEGMENT)
            for key, (_, t) in found.items():
                metrics.inc(SEGMENT_HIT_TOKENS, len(tokens[key]), tier=self.cache.tiers[t].name)
            missed = sum(len(ids) for key, ids in tokens.items() if key not in found)
            metrics.inc(SEGMENT_MISS_TOKENS, missed)
        seen: set[ChunkHash] = set()
        out = []
        for key in keys:  # a segment asked for twice gets a copy of its own the second time
            kv = found[key][0] if key in found else None
            out.append(kv.clone() if kv is not None and key in seen else kv)
            seen.add(key)
        return out

    def store(self, tokens: Tokens, kv: torch.Tensor, *, salt: bytes = b"") -> bool:
        """Store the KV of one segment (canonical, computed at ``base_position``); True if a tier took it."""
        ids = token_array(tokens)
        self.cache.spec.check(kv, len(ids))
        stored = False
        for tier, done in self.cache.chain.store([Entry(self.key(ids, salt=salt), ids, kv)], EntryKind.SEGMENT):
            if done:
                stored = True
                self.cache.metrics.inc(SEGMENT_STORED_TOKENS, len(ids), tier=tier.name)
        return stored

    def _decode(self, tier: Tier, key: ChunkHash, blob: memoryview, tokens: np.ndarray) -> torch.Tensor:
        """Verify and copy one segment out of ``blob`` (valid only inside the tier's ``get`` block)."""
        kv = decode_blob(blob, key, tokens, codec=tier.codec, verify=tier.verifies)
        try:
            self.cache.spec.check(kv, len(tokens))
        except ConfigError as exc:
            raise BlobError(f"segment of another shape: {exc}") from None
        return kv.clone()
