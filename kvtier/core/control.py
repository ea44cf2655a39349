"""Cache control: what an operator does to a KVCache's entries besides storing and loading them (issue 30).

``cache.control`` is a ``CacheControl``: pin and unpin a prefix, clear a model's, a tenant's or every entry,
see how much of a prompt each tier holds and what each tier holds. Retention times are given per store
(``KVCache.store(..., ttl_s=)``); tenant shares are tier config (``tenant_share``, ``tenant_shares``). The tiers
do the work through their ``Controlled`` capability (kvtier/tiers/control.py states its contracts); a tier
without it, or without the feature asked for, is refused by name (``NotSupported``) when named, and skipped
(reported as None, or left out) when not.

Tenants are cache salts, as in ``store(salt=...)``; the empty salt is the ``default`` tenant. Every change to
pins or clears is logged (logger ``kvtier.core.control``, INFO), with its outcome per tier.

Contracts:

* ``pin`` is all or nothing: if any tier refuses (pin budget, failure), the pins this call added in other tiers
  are released again and the error is raised. Bad arguments (an unknown tier name, a tier that cannot pin)
  raise before anything changes.
* ``clear`` is best effort across tiers: each tier clears what it can; the result says per tier how many
  entries went, or None where the tier cannot clear in that scope (or failed: logged and counted).
* ``lookup_tiers`` and ``stats`` change nothing (eviction order included).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from kvtier.base.errors import InvalidArgument, KVTierError, NotSupported
from kvtier.base.keys import ChunkHash, Tokens
from kvtier.core.chain import TierChain
from kvtier.tiers import Tier
from kvtier.tiers.control import Controlled, Feature, TierUsage, tenant_tag

log = logging.getLogger(__name__)


class Controls(Protocol):
    """What CacheControl needs of its cache (a KVCache): its tiers and their chain, its chunk size and keys."""

    tiers: list[Tier]
    chain: TierChain
    chunk_size: int

    def keys(self, tokens: Tokens, *, salt: bytes = b"") -> list[ChunkHash]: ...


class CacheControl:
    """Pins, clears, per-tier lookup and usage of one KVCache (see the module docstring). Thread-safe as far as
    its tiers are."""

    def __init__(self, cache: Controls) -> None:
        self._cache = cache

    @property
    def tier_names(self) -> list[str]:
        """The names of the cache's tiers, fastest first (what ``tiers=`` and the results use)."""
        return [tier.name for tier in self._cache.tiers]

    def features(self) -> dict[str, list[str]]:
        """Per tier name, what it can do: some of ``pin``, ``ttl``, ``tenants`` (owners: shares, clear by tenant)
        and ``clear`` (kvtier.tiers.control.Feature); empty for a tier without cache control."""
        return {tier.name: sorted(f.value for f in tier.supports) if isinstance(tier, Controlled) else []
                for tier in self._cache.tiers}

    # -- pins ----------------------------------------------------------------------------------------------
    def pin(self, tokens: Tokens, *, salt: bytes = b"", tiers: Sequence[str] | None = None) -> dict[str, int]:
        """Pin the cached prefix of ``tokens`` (tenant ``salt``) in each of ``tiers`` (by name; None: every tier
        that can pin). Pinned chunks are never evicted and do not expire until ``unpin``; a disk tier keeps its
        pins across restarts; on Redis/Valkey a pin removes the keys' expiry (PERSIST).

        Returns, per tier, how many leading tokens of the prefix are pinned there now (a multiple of the chunk
        size; a tier holding only part of the prefix pins the chunks it holds). Raises InvalidArgument for an
        unknown tier name, NotSupported for a named tier that cannot pin, PinBudgetExceeded when a tier's pins
        would pass its ``pin_budget_bytes``: then nothing is pinned anywhere."""
        chosen = self._choose(tiers, Feature.PIN)
        keys = self._prefix_keys(tokens, salt)
        done: list[tuple[Tier, list[ChunkHash]]] = []
        out: dict[str, int] = {}
        try:
            for tier in chosen:
                held = [key for key, hit in zip(keys, tier.contains(keys)) if hit]
                new = [key for key, was in zip(held, tier.pinned(held)) if not was]
                added = tier.pin(held)
                done.append((tier, new))
                out[tier.name] = self._tokens(keys, held)
                log.info("pin: tier %s holds %d chunk(s) of the prefix pinned, %d new bytes", tier.name, len(held),
                         added)
        except KVTierError as exc:
            for tier, held in done:  # this call's pins only: what was pinned before stays pinned
                tier.unpin(held)
            log.warning("pin refused, nothing pinned: %s", exc)
            raise
        return out

    def unpin(self, tokens: Tokens, *, salt: bytes = b"", tiers: Sequence[str] | None = None) -> dict[str, int]:
        """Release the pins of the full chunks of ``tokens`` (tenant ``salt``) in ``tiers`` (None: every tier that
        can pin). Returns the bytes unpinned per tier. An entry whose retention time passed while it was pinned
        expires now. Same argument errors as ``pin``."""
        chosen = self._choose(tiers, Feature.PIN)
        keys = self._cache.keys(tokens, salt=salt)
        out: dict[str, int] = {}
        for tier in chosen:
            out[tier.name] = tier.unpin(keys)
            log.info("unpin: tier %s released %d bytes", tier.name, out[tier.name])
        return out

    # -- clear ---------------------------------------------------------------------------------------------
    def clear(self, *, tenant: bytes | None = None, all: bool = False) -> dict[str, int | None]:  # noqa: A002
        """Remove entries from every tier: by default this cache's namespace (its model: on memory and disk
        tiers, which belong to this cache, that is everything they hold; on a shared store, only this model's
        keys); with ``tenant`` (a cache salt; ``b""`` is the default tenant) only that tenant's entries of the
        namespace; with ``all`` everything every tier holds, other models' entries in shared stores included.
        Pinned entries go too.

        Returns the entries removed per tier name (a split Redis value counts once), None for a tier that
        cannot clear in that scope or failed (logged). InvalidArgument for ``tenant`` together with ``all``."""
        if all and tenant is not None:
            raise InvalidArgument("clear: give a tenant or all, not both")
        if tenant is not None and not isinstance(tenant, bytes):
            raise InvalidArgument("clear: tenant must be a cache salt (bytes)")
        need = Feature.TENANTS if tenant is not None else Feature.CLEAR
        tag = None if tenant is None else tenant_tag(tenant)
        scope = "all" if all else (f"tenant {tag or 'default'}" if tenant is not None else "namespace")
        out: dict[str, int | None] = {}
        for tier in self._cache.tiers:
            if not (isinstance(tier, Controlled) and need in tier.supports and Feature.CLEAR in tier.supports):
                out[tier.name] = None
                log.warning("clear %s: tier %s cannot clear in that scope; left as it is", scope, tier.name)
                continue
            try:
                out[tier.name] = tier.clear(tenant=tag, everything=all)
            except KVTierError as exc:
                out[tier.name] = None
                self._cache.chain.failed(tier, "clear", exc)
                continue
            log.info("clear %s: tier %s removed %d entries", scope, tier.name, out[tier.name])
        return out

    # -- looking -------------------------------------------------------------------------------------------
    def lookup_tiers(self, tokens: Tokens, *, salt: bytes = b"") -> dict[str, int]:
        """Per tier name, how many leading tokens of ``tokens`` (tenant ``salt``) that tier alone holds (a
        multiple of the chunk size; ``KVCache.lookup`` is what all tiers together can load). No side effects."""
        keys = self._cache.keys(tokens, salt=salt)
        out: dict[str, int] = {}
        for t, tier in enumerate(self._cache.tiers):
            held = self._cache.chain.locate_in(t, keys)
            n = held.index(False) if False in held else len(held)
            out[tier.name] = n * self._cache.chunk_size
        return out

    def stats(self) -> dict[str, TierUsage]:
        """Per tier name: entries, bytes, capacity, pinned bytes and pin budget, and bytes per tenant (configured
        tenants by name, ``default``, the rest as ``other``; empty for a tier that records no owners)."""
        out: dict[str, TierUsage] = {}
        for tier in self._cache.tiers:
            if isinstance(tier, Controlled):
                out[tier.name] = tier.usage()
            else:
                stats = tier.stats()
                out[tier.name] = TierUsage(stats.entries, stats.used_bytes, stats.capacity_bytes)
        return out

    # -- internals -----------------------------------------------------------------------------------------
    def _choose(self, names: Sequence[str] | None, feature: Feature) -> list:
        """The tiers named (all that have ``feature`` for None); InvalidArgument / NotSupported before any change."""
        by_name = {tier.name: tier for tier in self._cache.tiers}
        if names is None:
            return [t for t in self._cache.tiers if isinstance(t, Controlled) and feature in t.supports]
        if isinstance(names, str):
            raise InvalidArgument("tiers must be a list of tier names, not one string")
        unknown = [name for name in names if name not in by_name]
        if unknown:
            raise InvalidArgument(f"unknown tier(s) {unknown}; this cache has {list(by_name)}")
        chosen = [by_name[name] for name in dict.fromkeys(names)]
        for tier in chosen:
            if not (isinstance(tier, Controlled) and feature in tier.supports):
                raise NotSupported(f"tier {tier.name} cannot {feature.value}")
        return chosen

    def _prefix_keys(self, tokens: Tokens, salt: bytes) -> list[ChunkHash]:
        """The keys of the prefix of ``tokens`` that the tiers together hold now."""
        keys = self._cache.keys(tokens, salt=salt)
        return keys[: self._cache.chain.prefix(self._cache.chain.locate(keys))]

    def _tokens(self, keys: Sequence[ChunkHash], held: Sequence[ChunkHash]) -> int:
        """Tokens of the leading run of ``keys`` within ``held``."""
        have = set(held)
        n = 0
        for key in keys:
            if key not in have:
                break
            n += 1
        return n * self._cache.chunk_size
