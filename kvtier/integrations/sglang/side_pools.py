"""A hybrid model's pools beside its KV (SGLang's v2 interface): Mamba state, sliding-window KV, indexer pages.

SGLang moves such a pool's pages as the pool's flat bytes: ``get_data_page(i, flat=True)`` to store one,
``set_from_flat_data_page(i, page)`` to restore it (the calls SGLang's own file backend makes). Contracts:

* **Storage.** Each pool has a cache of its own over tiers of the same kinds as the KV cache's: one page is one
  chunk holding the page's bytes (``KVSpec(1, 1, nbytes // 2, uint8)``, one 'token' a chunk), keyed by SGLang's
  page key in a namespace that adds the pool's name to the KV cache's. Memory and disk capacities are the KV
  tiers' scaled by the pool's page bytes over a KV page's (at least ``MIN_CAPACITY``, or the KV tier's whole
  capacity where that is smaller), a disk tier keeps its
  files in a ``pool-<name>`` subdirectory, shared tiers (Redis, Valkey, Mooncake) are the same servers.
* **Verification.** A page is checked as a KV page is (checksum where the tier seals, the key-derived ids in
  its blob, its shape and dtype) before ``set_from_flat_data_page`` sees it; one that fails is a miss.
* **Hits.** ``ALL_PAGES``: every page up to the prefix length must be stored. ``TRAILING_PAGES``: the last
  ``len(transfer.keys)`` pages before the prefix length must be. A prefix is restorable when the KV and every
  pool allow it (``restorable`` lists the lengths); ``BLOCK_GROUPS`` is not supported and makes nothing
  restorable, so SGLang recomputes rather than restore a prefix without its state.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier.base.errors import ConfigError
from kvtier.base.keys import ChunkHash
from kvtier.base.layout import KVSpec
from kvtier.core.cache import KVCache
from kvtier.core.config import CacheConfig
from kvtier.integrations.sglang.pages import key_token_ids

#: the smallest memory or disk capacity a pool's scaled tier gets
MIN_CAPACITY = 64 << 20


def page_bytes(pool: Any) -> int:
    """Bytes of one of ``pool``'s flat pages (``get_dummy_flat_data_page``), checked even (ConfigError)."""
    try:
        dummy = pool.get_dummy_flat_data_page()
    except AttributeError as exc:
        raise ConfigError(f"an SGLang host pool without flat pages cannot be stored: {exc}") from None
    nbytes = dummy.numel() * dummy.element_size()
    if nbytes <= 0 or nbytes % 2:
        raise ConfigError(f"a host pool page of {nbytes} bytes cannot be stored (kvtier needs an even size)")
    return nbytes


def scaled_config(config: CacheConfig, name: str, ratio: float) -> CacheConfig:
    """``config``'s tiers for a side pool whose pages are ``ratio`` times a KV page (module docstring)."""
    tiers = []
    for tier in config.tiers:
        changes: dict[str, Any] = {}
        if tier.kind in ("memory", "disk"):
            floor = min(tier.capacity_bytes, MIN_CAPACITY)
            changes["capacity_bytes"] = max(floor, int(tier.capacity_bytes * ratio))
        if tier.kind == "disk":
            changes["path"] = Path(tier.path) / f"pool-{name}"
        tiers.append(dataclasses.replace(tier, **changes))
    return dataclasses.replace(config, chunk_size=1, tiers=tuple(tiers))


class _FlatPages:
    """One pool's pages at ``offsets`` as a KVSource and KVSink: chunk ``i`` is page ``offsets[i]``'s bytes."""

    def __init__(self, pool: Any, offsets: Sequence[int], spec: KVSpec) -> None:
        self.pool, self.offsets, self.spec = pool, offsets, spec

    def chunk(self, start: int, end: int) -> torch.Tensor:
        page = self.pool.get_data_page(self.offsets[start], flat=True)
        return page.contiguous().view(torch.uint8).reshape(self.spec.chunk_shape(1))

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self.pool.set_from_flat_data_page(self.offsets[start], chunk.reshape(-1).clone())


class SidePool:
    """One registered side pool and its cache (module docstring)."""

    def __init__(self, name: str, pool: Any, kv_cache: KVCache, kv_page_bytes: int, root: bytes) -> None:
        nbytes = page_bytes(pool)
        self.name, self.pool = str(getattr(name, "value", name)), pool
        self.spec = KVSpec(1, 1, nbytes // 2, torch.uint8)
        ns = kv_cache.namespace
        self.cache = KVCache(self.spec, ns.model, scaled_config(kv_cache.config, self.name, nbytes / kv_page_bytes),
                             tp_rank=ns.tp_rank, tp_size=ns.tp_size, adapter=f"{ns.adapter};pool={self.name}")
        self._owner = root  #: the KV pages' owner (the backend's namespace and tenant): one clear covers both
        self._root = root + b"pool=" + self.name.encode() + b";"
        self.page_size = int(getattr(pool, "page_size", 1) or 1)

    def close(self) -> None:
        self.cache.close()

    def keys(self, keys: Sequence[str]) -> list[ChunkHash]:
        return [ChunkHash(hashlib.sha256(self._root + key.encode()).digest()) for key in keys]

    def held(self, keys: Sequence[str]) -> list[bool]:
        return [t is not None for t in self.cache.locate(self.keys(keys))]

    def offsets(self, keys: Sequence[str], host_indices: torch.Tensor | None) -> list[int] | None:
        """The first host slot of each page, or None unless there is one whole page of slots per key."""
        if host_indices is None:
            return None
        idx = torch.as_tensor(host_indices).reshape(-1).to("cpu", torch.int64)
        if idx.numel() != len(keys) * self.page_size:
            return None
        return idx[:: self.page_size].tolist()

    def store(self, keys: Sequence[str], host_indices: torch.Tensor | None) -> list[bool]:
        offsets = self.offsets(keys, host_indices)
        if offsets is None:
            return [False] * len(keys)
        ids = self.keys(keys)
        written = self.cache.store_keyed(ids, key_token_ids(ids, 1), _FlatPages(self.pool, offsets, self.spec),
                                         salt=self._owner)
        return [w or t is not None for w, t in zip(written, self.cache.locate(ids))]

    def load(self, keys: Sequence[str], host_indices: torch.Tensor | None) -> list[bool]:
        """Each page on its own: one that fails is a miss for it alone (which pages a prefix needs is the hit
        policy's, and ``batch_exists_v2`` has answered it)."""
        offsets = self.offsets(keys, host_indices)
        if offsets is None:
            return [False] * len(keys)
        ids = self.keys(keys)
        sink = _FlatPages(self.pool, offsets, self.spec)
        return [self.cache.retrieve_keyed([key], key_token_ids([key], 1), _Shifted(sink, i), salt=self._owner) == 1
                for i, key in enumerate(ids)]


class _Shifted:
    """``sink`` seen from page ``first`` on (a one-page load writes its chunk 0 to page ``first``)."""

    def __init__(self, sink: _FlatPages, first: int) -> None:
        self.sink, self.first = sink, first

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self.sink.write(start + self.first, end + self.first, chunk)


def restorable(kv_pages: int, transfers: Sequence[Any], held: Callable[[Any], list[bool]], policies: Any
               ) -> tuple[list[int], dict[str, int]]:
    """The prefix lengths (in pages, within ``kv_pages``) that every side pool allows, and each pool's own
    boundary, by SGLang's hit policies (``policies``: its ``PoolHitPolicy``; module docstring).
    ``held(transfer)`` tells which of the first ``kv_pages`` pages the transfer's pool holds."""
    lengths = set(range(1, kv_pages + 1))
    boundaries: dict[str, int] = {}
    for transfer in transfers:
        if not lengths:
            break
        have = held(transfer)
        if transfer.hit_policy == policies.ALL_PAGES:
            first_missing = next((i for i in range(kv_pages) if not have[i]), kv_pages)
            allowed = set(range(1, first_missing + 1))
        elif transfer.hit_policy == policies.TRAILING_PAGES:
            trailing = max(1, len(transfer.keys or []))
            allowed = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - trailing) : n])}
        else:
            allowed = set()
        if allowed:
            boundaries[str(getattr(transfer.name, "value", transfer.name))] = max(allowed)
        lengths &= allowed
    return sorted(lengths), boundaries
