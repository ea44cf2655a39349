"""Helpers shared by the disk tier's test modules."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.codecs import BytesPayload
from kvtier.tiers import DiskTier, DiskTierConfig
from tests.conformance.tier_suite import blob, key, tier_context


def disk_tier(path: str | os.PathLike[str], capacity_bytes: int, clock=None, **options) -> DiskTier:
    """A disk tier named ``disk`` on ``path``, built as a KVCache builds it; ``options`` are DiskTierConfig's,
    ``clock`` the one its entries expire by."""
    return DiskTier(DiskTierConfig(path=Path(path), capacity_bytes=capacity_bytes, **options),
                    tier_context("disk", clock))


def put(tier: DiskTier, ids) -> list[bool]:
    """Store the conformance blobs of ``ids`` and wait until the background writers have written them."""
    result = tier.put([(key(i), BytesPayload(blob(i))) for i in ids])
    tier.flush()
    return result


def read(tier: DiskTier, ids) -> list[bytes | None]:
    with tier.get([key(i) for i in ids]) as views:
        return [None if v is None else bytes(v) for v in views]
