"""One simulated replica: a real ``KVCache`` over real memory tiers, with a tiny KV spec.

The simulator exercises kvtier's own code: the cache hashes the prompt, looks its chunks up tier by tier,
loads the prefix (parsing every blob header and checking its token ids), promotes hits from slower tiers,
stores what was missing, and the tiers evict through their policies. Only the KV is tiny: one layer, one
head, head_dim 1, uint8, so a chunk of ``t`` tokens is a blob of a ``t``-token header plus ``2t`` bytes, and
100,000 chunks of 512 tokens fit in about 300 MiB.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.apps.sim.fleet import FleetConfig, SimTier, TierKind
from kvtier.base.keys import ChunkHash
from kvtier.base.layout import KVSpec
from kvtier.base.metrics import Metrics
from kvtier.codecs.blob import header_length
from kvtier.core.cache import KVCache
from kvtier.core.config import CacheConfig
from kvtier.core.metrics import ADMISSION_REFUSED, HIT_TOKENS
from kvtier.native.allocator import Allocator
from kvtier.policy.admission import Refusal
from kvtier.tiers import TIER_KINDS, MemoryTier, MemoryTierConfig, Tier, TierConfig, TierContext
from kvtier.tiers.metrics import WRITTEN_BYTES

SIM_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.uint8)
SIM_MODEL = "kvtier-sim"
_ALIGN = 64  # the memory tier's allocator alignment


def chunk_blob_bytes(chunk_tokens: int) -> int:
    """Bytes of one stored chunk's blob (what a tier counts as written)."""
    return header_length(5, chunk_tokens) + SIM_SPEC.bytes_per_token * chunk_tokens


def written_chunks(metrics: Metrics, tier: str, chunk_tokens: int) -> int:
    """Chunks a simulated tier named ``tier`` counted as written in ``metrics``."""
    return int(metrics.get(WRITTEN_BYTES, tier=tier)) // chunk_blob_bytes(chunk_tokens)


def chunk_slot_bytes(chunk_tokens: int) -> int:
    """Bytes one stored chunk takes in a memory tier: blob header with token ids, payload, alignment."""
    return Allocator(0, align=_ALIGN).rounded(chunk_blob_bytes(chunk_tokens))


@dataclass(frozen=True)
class _ModelledDisk(MemoryTierConfig):
    """A disk tier's capacity and eviction order, held in RAM (see kvtier.apps.sim.fleet): named ``disk`` in
    the fleet's reports, built as a memory tier (the registry would build the real disk tier for ``disk``)."""

    kind = "disk"

    def build(self, ctx: TierContext) -> Tier:
        return MemoryTier(self, ctx)


@dataclass(frozen=True)
class _Existing(TierConfig):
    """A tier built once and placed in several caches' chains (the shared tier)."""

    kind = "shared"
    tier: Tier | None = None

    def build(self, ctx: TierContext) -> Tier:
        assert self.tier is not None
        return self.tier


def admission_fields(tier: SimTier, kind: str, chunk_tokens: int, chunk_kv_bytes: int,
                     first: bool = False) -> dict[str, Any]:
    """The tier config's admission options for ``tier``, standing for a real tier of ``kind`` (``first``: its
    cache's first tier): its policy (or what the real tier would default to there) and its rate cap, converted
    from the served model's KV bytes to the simulator's."""
    scale = SIM_SPEC.bytes_per_token * chunk_tokens / chunk_kv_bytes

    def scaled(n: int | None) -> int | None:
        return None if n is None else max(1, math.ceil(n * scale))

    default = "always" if first else TIER_KINDS[kind].default_admission
    return {"admission": tier.admission or default,
            "admission_max_bytes_per_s": scaled(tier.admission_max_bytes_per_s),
            "admission_burst_bytes": scaled(tier.admission_burst_bytes)}


def tier_config(tier: SimTier, chunk_tokens: int, chunk_kv_bytes: int, first: bool = False) -> MemoryTierConfig:
    capacity = tier.capacity_chunks(chunk_kv_bytes) * chunk_slot_bytes(chunk_tokens)
    cls = MemoryTierConfig if tier.kind is TierKind.MEMORY else _ModelledDisk
    return cls(capacity_bytes=capacity, policy=tier.policy, write=tier.write, prefault=False,
               **admission_fields(tier, tier.kind.value, chunk_tokens, chunk_kv_bytes, first))


def build_shared(fleet: FleetConfig, chunk_tokens: int, chunk_kv_bytes: int,
                 metrics: Metrics | None = None) -> MemoryTier | None:
    """The shared tier (admission is the replicas' business: each chain gets its own policy for it)."""
    if fleet.shared is None:
        return None
    config = tier_config(fleet.shared, chunk_tokens, chunk_kv_bytes)
    return config.build(TierContext(SIM_SPEC, metrics if metrics is not None else Metrics(), "shared"))


class _Discard:
    """A KVSink that drops what it is given: the simulator needs hits, not KV."""

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        return None


class _Zeros:
    """A KVSource of zeros (the stored bytes do not matter, their count and headers do)."""

    def __init__(self, chunk_tokens: int) -> None:
        self._kv = SIM_SPEC.empty(chunk_tokens).zero_()

    def chunk(self, start: int, end: int) -> torch.Tensor:
        return self._kv  # the cache asks for whole chunks only


class Replica:
    """A KVCache built from a fleet's tier chain (plus the shared tier), serving requests one at a time."""

    def __init__(self, fleet: FleetConfig, chunk_tokens: int, chunk_kv_bytes: int, shared: Tier | None,
                 model: str = SIM_MODEL, clock: Callable[[], float] = time.monotonic) -> None:
        tiers: list[TierConfig] = [tier_config(t, chunk_tokens, chunk_kv_bytes, first=i == 0)
                                   for i, t in enumerate(fleet.tiers)]
        if shared is not None and fleet.shared is not None:
            tiers.append(_Existing(write=fleet.shared.write, tier=shared,
                                   **admission_fields(fleet.shared, "redis", chunk_tokens, chunk_kv_bytes)))
        self.cache = KVCache(SIM_SPEC, model, CacheConfig(chunk_size=chunk_tokens, tiers=tuple(tiers)), clock=clock)
        #: the tiers' names (kinds, numbered when repeated: memory, disk, shared), as reports show them
        self.labels = [tier.name for tier in self.cache.tiers]
        self._hits_seen = [0.0] * len(self.labels)
        self._sink = _Discard()
        self._source = _Zeros(chunk_tokens)

    def located(self, keys: Sequence[ChunkHash]) -> list[str]:
        """The longest held prefix of ``keys``: for each of its chunks, the label of the fastest tier holding it."""
        out: list[str] = []
        for t in self.cache.locate(keys):
            if t is None:
                break
            out.append(self.labels[t])
        return out

    def serve(self, tokens: np.ndarray) -> list[int]:
        """Load the prompt's cached prefix and store the rest, as an engine would; hit chunks per tier."""
        self.cache.retrieve(tokens, self._sink)
        self.cache.store(tokens, self._source)
        hits = []
        size = self.cache.chunk_size
        for i, name in enumerate(self.labels):
            total = self.cache.metrics.get(HIT_TOKENS, tier=name)
            hits.append(int(total - self._hits_seen[i]) // size)
            self._hits_seen[i] = total
        return hits

    def written_chunks(self) -> dict[str, int]:
        """Chunks written into each of this replica's own tiers so far (stores, promotions, demotions); the shared
        tier counts its writes in its own metrics (``build_shared``)."""
        return {tier.name: written_chunks(self.cache.metrics, tier.name, self.cache.chunk_size)
                for tier in self.cache.tiers if tier.name != "shared"}

    def refused_chunks(self) -> dict[str, int]:
        """Writes each tier's admission policy refused so far (every reason together)."""
        return {tier.name: int(sum(self.cache.metrics.get(ADMISSION_REFUSED, tier=tier.name, reason=r.value)
                                   for r in Refusal)) for tier in self.cache.tiers}

    def close(self) -> None:
        self.cache.close()
