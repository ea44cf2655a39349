"""``KVTierStorage``: SGLang's ``HiCacheStorage`` over a kvtier ``KVCache`` (its tier chain, codecs, verification).

SGLang hands the backend pages of its host KV pool under its own chained page hashes (hex strings). Contracts:

* **Keys.** A page's kvtier key is ``SHA-256(root || SGLang key)``, where ``root`` is the namespace of the
  cache: the model (``model_id``, default SGLang's model name), the pool's KV geometry (layers, heads,
  head_dim, dtype; MLA's latent width), the page size, the tensor-parallel rank and size (MLA KV is the same
  on every rank: rank 0 of 1), pipeline / context-parallel shard and MLA flag (the adapter field) and the
  ``tenant`` salt. Two servers share a page only when all of these agree. What a request adds is inside
  SGLang's page hash already (a SHA-256 chain over whole 64-bit token ids, ``get_storage_hash_str``): the
  chain is seeded by the request's ``extra_key`` (with the LoRA adapter's id appended) and ``cache_salt``, and
  images, audio and video are their placeholder tokens, which SGLang replaces by values derived from each
  item's content hash. SGLang refuses prompt embeddings (``input_embeds``) unless its radix cache is off, and
  then no storage backend is used. The backend sees page keys only, never the request.
* **Owner.** Every page is stored owned by the namespace-and-tenant root, so ``clear`` removes this backend's
  pages only, even from a disk path other models, ranks or tenants left pages in.
* **Pages.** Stored as kvtier's canonical chunk (``pages.py``), so any of the supported host layouts reads any
  page. Reads decode straight into the host pool's page (``batch_get_v1``: no copy beyond what a tier
  needs); writes read straight out of it.
* **Verification.** Every page read is checked before it reaches the host pool: blob checksum over key and
  bytes (tiers whose bytes leave the process), the key-derived token ids recorded in the blob, and its
  shape and dtype against the registered pool. A page that fails is deleted from its tier and is a miss
  for it and every later page of the batch (``KVCache.retrieve_keyed``).
* **Failures.** Nothing raises into SGLang from the data path: a tier failure or an unexpected error is a miss
  (``False`` / ``None`` / 0 hits), logged. A configuration kvtier cannot serve (unknown tier option, host
  layout it cannot read) raises ``ConfigError`` when SGLang builds the backend or registers its pool, so
  the server fails at start instead of running without its L3.
* **v2 (hybrid pools).** KV transfers go through the same path; every other registered pool (Mamba state,
  sliding-window KV, indexer pages) is stored beside it, page by page, with SGLang's hit policies deciding
  which prefix lengths are restorable (``side_pools.py``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier.base.errors import ConfigError
from kvtier.base.keys import ChunkHash
from kvtier.core.cache import KVCache
from kvtier.integrations.sglang.config import BackendConfig
from kvtier.integrations.sglang.pages import PoolGeometry, check_buffer, geometry_of, key_token_ids
from kvtier.integrations.sglang.side_pools import SidePool, restorable
from kvtier.tiers import SharedStore
from kvtier.tiers.control import Controlled, Feature, tenant_tag

log = logging.getLogger(__name__)
T = TypeVar("T")


def _never_raises(default: Callable[..., T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Turn any exception of a data-path method into ``default(*args)`` plus a logged error."""
    def wrap(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def guarded(self: KVTierStorage, *args: Any, **kwargs: Any) -> T:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                log.exception("kvtier HiCache backend: %s failed; answering a miss", method.__name__)
                return default(*args, **kwargs)
        return guarded
    return wrap


def _n_keys(keys: Sequence[str], *_: Any, **__: Any) -> int:
    return len(keys)


class _HostPages:
    """Pages of the host pool as a KVSource and KVSink (see kvtier.core.cache): chunk ``i`` is the page whose first
    token slot is ``starts[i]``; a view of the pool, so decodes land in it and stores read from it."""

    concurrent_writes = True  #: pages are disjoint
    device = torch.device("cpu")

    def __init__(self, pages: Sequence[torch.Tensor] | Callable[[int], torch.Tensor], page_size: int) -> None:
        self._page = pages if callable(pages) else pages.__getitem__
        self._size = page_size

    def chunk(self, start: int, end: int) -> torch.Tensor:
        return self._page(start // self._size)

    destination = chunk

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self._page(start // self._size).copy_(chunk)


class KVTierStorage(HiCacheStorage):
    """kvtier as SGLang's L3 (see the module docstring). Built by SGLang's ``dynamic`` loader as
    ``KVTierStorage(storage_config, kwargs)``; serves nothing until ``register_mem_pool_host``."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendConfig.from_extra(getattr(storage_config, "extra_config", None))
        self.cache: KVCache | None = None
        self.geometry: PoolGeometry | None = None
        self._kv_buffer: torch.Tensor | None = None
        self._capacity = 0  #: token slots of the host pool
        self._root = b""
        self._side: dict[str, SidePool] = {}  #: hybrid models' other pools, by SGLang's pool name
        self._side_lock = threading.Lock()

    # -- setup ---------------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Build the tier chain for this pool's pages (ConfigError if kvtier cannot serve it)."""
        super().register_mem_pool_host(mem_pool_host)
        geometry = geometry_of(mem_pool_host)
        kv_buffer = getattr(mem_pool_host, "kv_buffer", None)
        capacity = check_buffer(geometry, kv_buffer)
        sc = self.storage_config
        model = self.settings.model_id or getattr(sc, "model_name", None)
        if not model:
            raise ConfigError("kvtier needs the model's name: SGLang passed none, set model_id in the extra config")
        tp_rank, tp_size = (0, 1) if geometry.mla else (sc.tp_rank, sc.tp_size)
        shard = (f"sglang;mla={int(geometry.mla)};pp={sc.pp_rank}/{sc.pp_size};"
                 f"cp={getattr(sc, 'attn_cp_rank', 0)}/{getattr(sc, 'attn_cp_size', 1)};"
                 f"dcp={getattr(sc, 'dcp_rank', 0)}/{getattr(sc, 'dcp_size', 1)}")
        cache = KVCache(geometry.spec, model, self.settings.cache_config(geometry.page_size),
                        tp_rank=tp_rank, tp_size=tp_size, adapter=shard)
        if self.cache is not None:
            self.cache.close()
        self.cache, self.geometry, self._kv_buffer, self._capacity = cache, geometry, kv_buffer, capacity
        self._root = bytes(cache.namespace.with_salt(self.settings.tenant.encode()).root)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of a hybrid model (or the KV pool again, under ``PoolName.KV``): stored beside the KV."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        replaced = self._side.pop(str(getattr(host_pool_name, "value", host_pool_name)), None)
        if replaced is not None:
            replaced.close()

    def on_host_pools_registered(self) -> None:
        """Every pool is known: build the side pools' caches now, so a pool kvtier cannot store fails the start."""
        for name in getattr(self, "registered_pools", {}):
            if name != PoolName.KV:
                self._side_pool(name)

    def _side_pool(self, name: Any) -> SidePool | None:
        """The side pool registered under ``name``, its cache built on first use (None if never registered)."""
        key = str(getattr(name, "value", name))
        with self._side_lock:  # SGLang's prefetch and backup threads may both ask first
            side = self._side.get(key)
            pool = getattr(self, "registered_pools", {}).get(name)
            if side is None and pool is not None and self._ready():
                kv_page = self.geometry.spec.bytes_per_token * self.geometry.page_size
                side = self._side[key] = SidePool(key, pool, self.cache, kv_page, self._root)
            return side

    @_never_raises(lambda *_, **__: False)
    def clear(self) -> bool:
        """Forget this backend's pages (its namespace and tenant: every page is stored owned by ``owner``) in its
        memory and disk tiers, side pools included; pages of other models, ranks or tenants left in the same disk
        path stay. Pages in shared tiers (Redis, Valkey, Mooncake) stay too: other servers may be reading them.
        A local tier that records no owners is left as it is (logged): it cannot tell this backend's pages from
        others'. True once done."""
        owner = tenant_tag(self._root)
        for cache in [self.cache, *(side.cache for side in self._side.values())]:
            for tier in cache.tiers if cache is not None else []:
                if isinstance(tier, SharedStore):
                    continue
                if isinstance(tier, Controlled) and Feature.TENANTS in tier.supports:
                    tier.clear(tenant=owner)
                else:
                    log.warning("kvtier HiCache backend: tier %s records no owners; not cleared", tier.name)
        log.info("kvtier HiCache backend: cleared this server's pages")
        return True

    def close(self) -> None:
        for side in self._side.values():
            side.close()
        self._side.clear()
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    # -- keys ----------------------------------------------------------------------------------------------
    def kvtier_keys(self, keys: Sequence[str]) -> list[ChunkHash]:
        """The kvtier key of each SGLang page key in this backend's namespace (module docstring)."""
        root = self._root
        return [ChunkHash(hashlib.sha256(root + key.encode()).digest()) for key in keys]

    def _page_starts(self, n: int, host_indices: torch.Tensor) -> list[int] | None:
        """The first host slot of each of ``n`` pages, or None (logged) unless ``host_indices`` is ``n`` whole
        pages of consecutive slots inside the pool."""
        size = self.geometry.page_size
        idx = torch.as_tensor(host_indices).reshape(-1).to("cpu", torch.int64)
        if idx.numel() != n * size:
            log.error("kvtier: %d host indices for %d pages of %d tokens", idx.numel(), n, size)
            return None
        pages = idx.view(n, size)
        starts = pages[:, 0]
        capacity = self._capacity
        if n and (bool((starts % size).any()) or int(starts.min()) < 0 or int(starts.max()) + size > capacity
                  or not torch.equal(pages - starts[:, None], torch.arange(size).expand(n, size))):
            log.error("kvtier: host indices are not whole pages of the host pool")
            return None
        return starts.tolist()

    def _pool_pages(self, starts: Sequence[int]) -> _HostPages:
        geometry, buffer = self.geometry, self._kv_buffer
        return _HostPages(lambda i: geometry.page(buffer, starts[i]), geometry.page_size)

    def _ready(self) -> bool:
        if self.cache is None:
            log.error("kvtier HiCache backend used before a host pool was registered")
            return False
        return True

    # -- the zero-copy interface (interface_v1) -------------------------------------------------------------
    @_never_raises(lambda keys, *_, **__: 0)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Length of the run of leading pages some tier holds (one batched locate down the chain)."""
        if not keys or not self._ready():
            return 0
        where = self.cache.locate(self.kvtier_keys(keys))
        return next((i for i, t in enumerate(where) if t is None), len(where))

    @_never_raises(lambda keys, *_, **__: [False] * len(keys))
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load pages into the host pool at ``host_indices``, verified; True for the leading pages that
        arrived, False from the first page that did not (its later pages are not valid even if written)."""
        starts = self._page_starts(len(keys), host_indices) if keys and self._ready() else None
        if starts is None:
            return [False] * len(keys)
        return self._load(keys, self._pool_pages(starts))

    @_never_raises(lambda keys, *_, **__: [False] * len(keys))
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices``; True per page that some tier now holds."""
        starts = self._page_starts(len(keys), host_indices) if keys and self._ready() else None
        if starts is None:
            return [False] * len(keys)
        return self._store(keys, self._pool_pages(starts))

    def _load(self, keys: Sequence[str], pages: _HostPages) -> list[bool]:
        ids = self.kvtier_keys(keys)
        good = self.cache.retrieve_keyed(ids, key_token_ids(ids, self.geometry.page_size), pages, salt=self._root)
        return [True] * good + [False] * (len(keys) - good)

    def _store(self, keys: Sequence[str], pages: _HostPages) -> list[bool]:
        ids = self.kvtier_keys(keys)
        held = self.cache.store_keyed(ids, key_token_ids(ids, self.geometry.page_size), pages, salt=self._root)
        missing = [i for i, ok in enumerate(held) if not ok]  # already stored, or refused by every tier
        if missing:
            for i, tier in zip(missing, self.cache.locate([ids[i] for i in missing])):
                held[i] = tier is not None
        return held

    # -- the older interface (flat page tensors in the pool's layout) ---------------------------------------
    def _flat_pages(self, tensors: Sequence[torch.Tensor]) -> _HostPages:
        return _HostPages([self.geometry.flat_page(t) for t in tensors], self.geometry.page_size)

    @_never_raises(lambda *_, **__: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One page into ``target_location`` (a flat page, allocated when None); None for a miss."""
        return self.batch_get([key], [target_location])[0]

    @_never_raises(lambda keys, *_, **__: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        """Pages into flat page tensors; None from the first page that did not arrive."""
        if not keys or not self._ready():
            return [None] * len(keys)
        shape = self.geometry.buffer_shape(self.geometry.page_size)
        targets = [t if t is not None else torch.empty(shape, dtype=self.geometry.dtype).flatten()
                   for t in (target_locations or [None] * len(keys))]
        ok = self._load(keys, self._flat_pages(targets))
        return [t if hit else None for t, hit in zip(targets, ok)]

    @_never_raises(lambda *_, **__: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page (``value``); True once some tier holds it."""
        return self.batch_set([key], [value])

    @_never_raises(lambda *_, **__: False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages; True if every one is now held by some tier."""
        if not keys or not self._ready() or values is None or len(values) != len(keys):
            return not keys
        return all(self._store(keys, self._flat_pages(values)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v2: pool transfers (KV through the same path, other pools beside it) ----------------------------------
    def _is_kv(self, transfer: PoolTransfer) -> bool:
        pool = getattr(self, "registered_pools", {}).get(transfer.name, self.mem_pool_host)
        return transfer.name == PoolName.KV and pool is self.mem_pool_host

    @_never_raises(lambda *_, **__: PoolTransferResult.empty())
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: Any = None) -> PoolTransferResult:
        """The KV hit as ``batch_exists``, cut to the prefix lengths every other pool's hit policy allows."""
        kv_pages = self.batch_exists(keys, extra_info)
        sides = [t for t in pool_transfers or [] if not self._is_kv(t)]
        pools = {t.name: self._side_pool(t.name) for t in sides}
        if any(p is None for p in pools.values()):
            return PoolTransferResult(0, {}, [])  # a pool kvtier does not hold: nothing is restorable

        def held(transfer: PoolTransfer) -> list[bool]:
            return pools[transfer.name].held(keys[:kv_pages])

        lengths, boundaries = restorable(kv_pages, sides, held, PoolHitPolicy)
        hits = {PoolName.KV: kv_pages, **boundaries} if kv_pages else {}
        return PoolTransferResult(lengths[-1] if lengths else 0, hits, lengths)

    def _transfer(self, transfers: list[PoolTransfer], kv_op: Callable[..., list[bool]], side_op: str
                  ) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = t.keys or []
            if self._is_kv(t):
                out[t.name] = kv_op(keys, t.host_indices, None) if t.host_indices is not None else [False] * len(keys)
            elif (side := self._side_pool(t.name)) is not None:
                out[t.name] = getattr(side, side_op)(keys, t.host_indices)
            else:
                out[t.name] = [False] * len(keys)
        return out

    @_never_raises(lambda transfers, *_, **__: {t.name: [False] * len(t.keys or []) for t in transfers})
    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._transfer(transfers, self.batch_get_v1, "load")

    @_never_raises(lambda transfers, *_, **__: {t.name: [False] * len(t.keys or []) for t in transfers})
    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._transfer(transfers, self.batch_set_v1, "store")
