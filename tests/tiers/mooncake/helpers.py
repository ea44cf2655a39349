"""Shared by the Mooncake tier's tests: caches and tiers on a test master, and prompts with their KV."""

from __future__ import annotations

import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.metrics import Metrics
from kvtier.tiers import MooncakeTier, MooncakeTierConfig, TierContext
from harness.mooncake_master import MooncakeMaster

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 16
MiB = 1 << 20


def tier_config(master: MooncakeMaster, **options) -> MooncakeTierConfig:
    """A tier on ``master`` (or anything with its three addresses), contributing Mooncake's smallest segment
    unless told otherwise."""
    values = {"segment_bytes": 16 * MiB, "buffer_bytes": 16 * MiB, "timeout_s": 5.0, **options}
    return MooncakeTierConfig(master_address=master.master_address, metadata_server=master.metadata_url,
                              metrics_url=master.metrics_url, **values)


def make_tier(master: MooncakeMaster, **options) -> MooncakeTier:
    return MooncakeTier(tier_config(master, **options), TierContext(SPEC, Metrics(), "mooncake"))


def make_cache(master: MooncakeMaster, *, model: str = "m@1", **options) -> KVCache:
    return KVCache(SPEC, model, CacheConfig(chunk_size=CHUNK, tiers=(tier_config(master, **options),)))


def prompt(n_chunks: int, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n_chunks * CHUNK,), generator=gen).tolist()
    kv = torch.randn(SPEC.chunk_shape(len(tokens)), generator=gen).to(SPEC.dtype)
    return tokens, kv
