"""The bookkeeping of cache control for a tier that evicts by itself (memory, disk): each entry's owner,
expiry and pin, bytes per tenant and pinned, and the sweep of expired entries. No I/O, no lock: the tier calls
it under its own lock, next to its policy (kvtier/tiers/control.py states the contracts it serves)."""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

from kvtier.base.errors import PinBudgetExceeded
from kvtier.base.keys import ChunkHash
from kvtier.tiers.base import TierContext
from kvtier.tiers.control import (
    DEFAULT_TAGS,
    DEFAULT_TENANT,
    OTHER_TENANT,
    ControlledTierConfig,
    Tags,
    TierUsage,
)
from kvtier.tiers.metrics import PINNED_BYTES, TENANT_BYTES

log = logging.getLogger(__name__)

#: Expired entries a sweep step reclaims at most (each put and contains advances the sweep by one step).
SWEEP_STEP = 32


class _Record:
    __slots__ = ("expires_at", "nbytes", "pinned", "tenant")

    def __init__(self, nbytes: int, tags: Tags) -> None:
        self.nbytes, self.tenant, self.expires_at, self.pinned = nbytes, tags.tenant, tags.expires_at, False


class Ledger:
    """Owners, expiries and pins of one tier's entries. ``capacity`` is the tier's, in bytes."""

    def __init__(self, config: ControlledTierConfig, capacity: int, ctx: TierContext) -> None:
        self.capacity = capacity
        self.pin_budget = config.pin_budget(capacity)
        self.clock = ctx.clock
        self._tier = ctx.name
        self._names = dict(ctx.tenants)
        self._share, self._shares = config.tenant_share, dict(config.tenant_shares)
        self._records: dict[ChunkHash, _Record] = {}
        self._tenant_bytes: dict[str, int] = {}
        self.pinned_bytes = 0
        self._heap: list[tuple[float, int, ChunkHash]] = []
        self._seq = itertools.count()
        unknown = set(self._shares) - set(self._names.values()) - {DEFAULT_TENANT}
        if unknown:
            log.warning("tier %s: tenant_shares names %s that the cache's tenants do not: those shares apply to "
                        "no one", ctx.name, sorted(unknown))
        if config.pin_budget_bytes is not None or config.tenant_share < 1 or config.tenant_shares:
            log.info("tier %s: pin budget %d bytes, tenant share %s of %d bytes, overrides %s", ctx.name,
                     self.pin_budget, config.tenant_share, capacity, dict(config.tenant_shares))

    # -- entries -------------------------------------------------------------------------------------------
    def add(self, key: ChunkHash, nbytes: int, tags: Tags = DEFAULT_TAGS) -> None:
        """A new entry of ``nbytes`` became held with ``tags``."""
        self.drop(key)
        record = self._records[key] = _Record(nbytes, tags)
        self._tenant_bytes[record.tenant] = self._tenant_bytes.get(record.tenant, 0) + nbytes
        if record.expires_at is not None:
            heapq.heappush(self._heap, (record.expires_at, next(self._seq), key))

    def drop(self, key: ChunkHash) -> None:
        """The entry left the tier (unknown keys are ignored)."""
        record = self._records.pop(key, None)
        if record is None:
            return
        left = self._tenant_bytes[record.tenant] - record.nbytes
        if left:
            self._tenant_bytes[record.tenant] = left
        else:
            del self._tenant_bytes[record.tenant]
        if record.pinned:
            self.pinned_bytes -= record.nbytes

    def tags(self, key: ChunkHash) -> Tags | None:
        record = self._records.get(key)
        return None if record is None else Tags(record.tenant, record.expires_at)

    def expired(self, key: ChunkHash, now: float | None = None) -> bool:
        """True if ``key`` is held, unpinned and past its expiry (the tier then reclaims it)."""
        record = self._records.get(key)
        if record is None or record.expires_at is None or record.pinned:
            return False
        return record.expires_at <= (self.clock() if now is None else now)

    def due(self, limit: int = SWEEP_STEP) -> list[ChunkHash]:
        """Up to ``limit`` held entries whose expiry has passed, earliest first (the sweep: the tier removes them)."""
        now = self.clock()
        out: list[ChunkHash] = []
        heap = self._heap
        while heap and heap[0][0] <= now and len(out) < limit:
            when, _, key = heapq.heappop(heap)
            record = self._records.get(key)
            if record is not None and record.expires_at == when and not record.pinned:
                out.append(key)
        return out

    def pinned(self, key: ChunkHash) -> bool:
        record = self._records.get(key)
        return record is not None and record.pinned

    # -- pins ----------------------------------------------------------------------------------------------
    def pin(self, keys: Iterable[ChunkHash]) -> int:
        """Pin the held ``keys`` (absent ones ignored): the bytes newly pinned. Past the budget: raises
        PinBudgetExceeded and pins nothing."""
        todo = {key: r for key in keys if (r := self._records.get(key)) is not None and not r.pinned}
        extra = sum(r.nbytes for r in todo.values())
        if self.pinned_bytes + extra > self.pin_budget:
            raise PinBudgetExceeded(
                f"tier {self._tier}: pinning {extra} more bytes would pass its pin budget of {self.pin_budget} "
                f"bytes ({self.pinned_bytes} pinned already); nothing was pinned")
        for record in todo.values():
            record.pinned = True
        self.pinned_bytes += extra
        return extra

    def unpin(self, keys: Iterable[ChunkHash]) -> int:
        """Release the pins of ``keys``: the bytes unpinned. An expiry passed meanwhile applies again."""
        freed = 0
        for key in keys:
            record = self._records.get(key)
            if record is not None and record.pinned:
                record.pinned = False
                freed += record.nbytes
                if record.expires_at is not None:
                    heapq.heappush(self._heap, (record.expires_at, next(self._seq), key))
        self.pinned_bytes -= freed
        return freed

    # -- tenants -------------------------------------------------------------------------------------------
    def share_bytes(self, tenant: str) -> int:
        """The most bytes ``tenant`` (an owner tag) may hold."""
        name = DEFAULT_TENANT if not tenant else self._names.get(tenant)
        share = self._shares.get(name, self._share) if name is not None else self._share
        return int(share * self.capacity)

    def over_share(self, tenant: str, nbytes: int) -> int:
        """How many bytes ``tenant`` must give up before it may hold ``nbytes`` more (0: none; always 0 for a
        share of the whole tier, where the tier's own eviction decides)."""
        share = self.share_bytes(tenant)
        if share >= self.capacity:
            return 0
        return max(0, self._tenant_bytes.get(tenant, 0) + nbytes - self.share_bytes(tenant))

    def over_filter(self) -> Callable[[ChunkHash], bool] | None:
        """A filter of the keys owned by tenants past their share now (after a restart, or a share cut), to evict
        first when the tier needs room; None when no tenant is past its share (the common case: no scan)."""
        over = {t for t, n in self._tenant_bytes.items() if self.share_bytes(t) < min(n, self.capacity)}
        if not over:
            return None
        records = self._records
        return lambda key: (r := records.get(key)) is not None and r.tenant in over

    def owned_by(self, tenant: str) -> Callable[[ChunkHash], bool]:
        """A filter of the keys ``tenant`` owns (for a policy's ``victim``)."""
        records = self._records
        return lambda key: (r := records.get(key)) is not None and r.tenant == tenant

    def keys_of(self, tenant: str | None) -> list[ChunkHash]:
        """The held keys of ``tenant`` (every held key for None)."""
        if tenant is None:
            return list(self._records)
        return [key for key, r in self._records.items() if r.tenant == tenant]

    def label(self, tenant: str) -> str:
        """The metrics label of an owner tag: its configured name, ``default``, or ``other``."""
        return DEFAULT_TENANT if not tenant else self._names.get(tenant, OTHER_TENANT)

    def tenant_usage(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tenant, nbytes in self._tenant_bytes.items():
            label = self.label(tenant)
            out[label] = out.get(label, 0) + nbytes
        return out

    def usage(self, entries: int, used: int) -> TierUsage:
        return TierUsage(entries, used, self.capacity, self.pinned_bytes, self.pin_budget, self.tenant_usage())

    def gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """The control gauges of the tier: pinned bytes, and bytes per configured tenant (0 when it holds none)."""
        yield PINNED_BYTES.name, {"tier": self._tier}, self.pinned_bytes
        usage = self.tenant_usage()
        for label in {DEFAULT_TENANT, OTHER_TENANT, *self._names.values(), *usage}:
            yield TENANT_BYTES.name, {"tier": self._tier, "tenant": label}, usage.get(label, 0)

    # -- persistence (the disk tier) -----------------------------------------------------------------------
    def export(self, *, pins: bool = True, tags: bool = True) -> dict[str, object]:
        """The pins and/or the non-default tags as JSON-ready data (keys in hex), for ``restore`` after a restart."""
        out: dict[str, object] = {"version": 1}
        if pins:
            out["pinned"] = [key.hex() for key, r in self._records.items() if r.pinned]
        if tags:
            out["tags"] = {key.hex(): [r.tenant, r.expires_at] for key, r in self._records.items()
                           if r.tenant or r.expires_at is not None}
        return out

    def restore(self, data: Mapping[str, object]) -> None:
        """Apply what ``export`` wrote to the entries held now (others are gone); malformed parts are ignored.
        Pins are restored within the budget only."""
        tags = data.get("tags")
        if isinstance(tags, dict):
            for hexkey, value in tags.items():
                key = _key(hexkey)
                if key in self._records and isinstance(value, list) and len(value) == 2:
                    tenant, when = value
                    if isinstance(tenant, str) and (when is None or isinstance(when, int | float)):
                        self.add(key, self._records[key].nbytes, Tags(tenant, when))
        pinned = data.get("pinned")
        if isinstance(pinned, list):
            for hexkey in pinned:
                key = _key(hexkey)
                if key is not None:
                    try:
                        self.pin([key])
                    except PinBudgetExceeded:
                        break


def _key(text: object) -> ChunkHash | None:
    if not isinstance(text, str) or len(text) != 64:
        return None
    try:
        return ChunkHash(bytes.fromhex(text))
    except ValueError:
        return None

