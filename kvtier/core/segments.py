"""The segment cache: whole segments of KV, each under a key of its own tokens, for non-prefix reuse.

A segment (a retrieved passage, one chat message) is cached as one entry: the canonical KV
``[layers, 2, tokens, kv_heads, head_dim]`` of its tokens computed alone, the first token at a fixed base
position, under ``Namespace.segment_hash`` (its own key domain, salted per tenant like prefix chunks). Entries
go through the KVCache's tiers with their codecs and the same blob format and verification, so a segment
costs no new storage code:

* ``retrieve`` walks the tiers fastest first; every hit is verified (token ids always, checksum where the
  tier seals) and copied out; a hit in a slower tier is promoted into the faster ones. A segment that fails
  verification is deleted and counted (``kvtier_corrupt_chunks_total``) and looked for further down; found
  nowhere, it is a miss (``None``) and the engine recomputes it.
* ``store`` writes to the first tier and every write-through tier; write-back tiers get segments when the
  tier above evicts them, as for chunks.
* A failing tier is a miss or a skipped store plus ``kvtier_tier_errors_total``; nothing is raised.

Segments are not chunked: a segment shorter than a chunk is cached like any other. How an engine blends cached
segments into a prompt is its own configuration (``kvtier.integrations.blend.BlendConfig``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.base.errors import BlobError, ConfigError, KVTierError
from kvtier.base.keys import ChunkHash, Tokens, token_array
from kvtier.codecs.blob import decode_blob
from kvtier.core.cache import KVCache
from kvtier.tiers import Tier, WriteMode

log = logging.getLogger(__name__)

#: Segments one prompt may have: a prompt with more is not blended (a plain prefill; chats with more messages
#: are not even segmented). Each segment that missed costs a forward pass of its own after the first token, so
#: this bounds the passes a request can cause; 64 is far more passages than a RAG prompt carries.
MAX_SEGMENTS = 64


class SegmentCache:
    """Segments of KV in ``cache``'s tiers (a companion of KVCache: same tiers, metrics and tier helpers).

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
        keys = [self.key(seg, salt=salt) for seg in segments]
        present = [False] * len(keys)
        for tier in self.cache.tiers:
            todo = [i for i, hit in enumerate(present) if not hit]
            if not todo:
                break
            try:
                for i, hit in zip(todo, tier.contains([keys[i] for i in todo])):
                    present[i] = hit
            except KVTierError as exc:
                self.cache._tier_failed(tier, "contains", exc)
        return present

    def retrieve(self, segments: Sequence[Tokens], *, salt: bytes = b"") -> list[torch.Tensor | None]:
        """The canonical KV of each segment (a new tensor of its own, the caller's to modify), or None where no
        tier holds a verified copy."""
        metrics = self.cache.metrics
        with metrics.timer("kvtier_segment_retrieve_seconds"):
            arrays = [token_array(seg) for seg in segments]
            keys = [self.key(ids, salt=salt) for ids in arrays]
            tokens = dict(zip(keys, arrays))
            found: dict[ChunkHash, torch.Tensor] = {}
            for t, tier in enumerate(self.cache.tiers):
                todo = [key for key in tokens if key not in found]
                if not todo:
                    break
                found.update(self._load(t, tier, todo, tokens))
            missed = sum(len(ids) for key, ids in tokens.items() if key not in found)
            metrics.inc("kvtier_segment_miss_tokens_total", missed)
        seen: set[ChunkHash] = set()
        out = []
        for key in keys:  # a segment asked for twice gets a copy of its own the second time
            kv = found.get(key)
            out.append(kv.clone() if kv is not None and key in seen else kv)
            seen.add(key)
        return out

    def store(self, tokens: Tokens, kv: torch.Tensor, *, salt: bytes = b"") -> bool:
        """Store the KV of one segment (canonical, computed at ``base_position``); True if a tier took it."""
        ids = token_array(tokens)
        self.cache.spec.check(kv, len(ids))
        key = self.key(ids, salt=salt)
        stored = False
        for tier, cfg in zip(self.cache.tiers, self.cache.config.tiers):
            if tier is not self.cache.tiers[0] and cfg.write is WriteMode.BACK:
                continue
            try:
                if tier.contains([key])[0]:
                    continue
            except KVTierError as exc:
                self.cache._tier_failed(tier, "contains", exc)
                continue
            if self.cache._copy_into(tier, key, ids, kv, "put"):
                stored = True
                self.cache.metrics.inc("kvtier_segment_stored_tokens_total", len(ids), tier=tier.name)
        return stored

    def _load(self, t: int, tier: Tier, keys: list[ChunkHash], tokens: dict[ChunkHash, np.ndarray]
              ) -> dict[ChunkHash, torch.Tensor]:
        """Verified copies of the ``keys`` that ``tier`` (index ``t``) holds; corrupt ones are deleted."""
        found: dict[ChunkHash, torch.Tensor] = {}
        bad: list[ChunkHash] = []
        try:
            present = [key for key, hit in zip(keys, tier.contains(keys)) if hit]
            if not present:
                return found
            with tier.get(present) as blobs:
                for key, blob in zip(present, blobs):
                    if blob is None:
                        continue
                    try:
                        kv = self._decode(tier, key, blob, tokens[key])
                    except BlobError as exc:
                        self.cache.metrics.inc("kvtier_corrupt_chunks_total", tier=tier.name)
                        log.warning("tier %s: segment %s is a miss: %s", tier.name, key.hex()[:16], exc)
                        bad.append(key)
                        continue
                    found[key] = kv
                    self.cache.metrics.inc("kvtier_read_bytes_total", blob.nbytes, tier=tier.name)
        except KVTierError as exc:
            self.cache._tier_failed(tier, "get", exc)
        if bad:
            try:
                tier.delete(bad)
            except KVTierError as exc:
                self.cache._tier_failed(tier, "delete", exc)
        for key, kv in found.items():
            self.cache.metrics.inc("kvtier_segment_hit_tokens_total", len(tokens[key]), tier=tier.name)
            if t > 0:
                self.cache._promote(key, tokens[key], kv, t)
        return found

    def _decode(self, tier: Tier, key: ChunkHash, blob: memoryview, tokens: np.ndarray) -> torch.Tensor:
        """Verify and copy one segment out of ``blob`` (valid only inside the tier's ``get`` block)."""
        kv = decode_blob(blob, key, tokens, codec=tier.codec, verify=tier.verifies)
        try:
            self.cache.spec.check(kv, len(tokens))
        except ConfigError as exc:
            raise BlobError(f"segment of another shape: {exc}") from None
        return kv.clone()
