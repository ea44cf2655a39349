"""Cache control at the tier boundary: owner tags, retention, pins, clears and usage (issue 30).

A tier that keeps these is ``Controlled``, an optional capability that KVCache's control object
(kvtier/core/control.py) looks for with isinstance. Its contracts (tests/conformance/tier_suite.py,
``ControlConformance``, checks them):

* **Tags.** ``put_tagged`` stores like ``put`` and records each new entry's ``Tags``: its owner (the tenant,
  ``tenant_tag`` of the cache salt) and when it expires. ``put`` is ``put_tagged`` with ``DEFAULT_TAGS``. An entry
  already present keeps the tags it has. ``tags_of`` reads them back (a promotion carries them along).
* **Expiry.** An entry whose ``expires_at`` has passed (on ``TierContext.clock``) is a miss for ``contains`` and
  ``get`` and is reclaimed: at once when found, and by a sweep that ``put`` and ``contains`` advance a little at a
  time. A pinned entry does not expire while it is pinned.
* **Pins.** ``pin`` pins the listed entries the tier holds (absent keys are ignored) so that no policy ever
  evicts them, within the tier's pin budget: a pin that would take the pinned bytes past it raises
  ``PinBudgetExceeded`` and pins nothing. Pinning a pinned entry is a no-op; ``unpin`` releases. ``delete`` and
  ``clear`` remove pinned entries too (they are explicit).
* **Quotas.** A tier with tenant shares admits a tenant's new entry only within that tenant's share of the
  capacity, evicting that tenant's own entries (in policy order) to make room; if that cannot make room, the
  store is skipped (``kvtier_skipped_stores_total{reason="over_quota"}``).
* **Clear.** ``clear(tenant=None)`` removes every entry of the tier's namespace (the cache's model), or only
  the tenant's; ``everything=True`` removes what the tier holds whatever its namespace (on a shared store:
  every model's entries under its key prefix). Returns the entries removed.

Every tier answers ``supports`` (a set of ``Feature``) so the cache can refuse what a tier cannot do with a clear
error (``NotSupported``) instead of pretending.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvtier.base.errors import ConfigError, InvalidArgument, KVTierError, TierError
from kvtier.base.keys import ChunkHash
from kvtier.base.sizes import MAX_TTL_S  # re-exported; defined below the tiers so a router reads it alone
from kvtier.codecs import Payload
from kvtier.tiers.base import Tier, TierConfig

log = logging.getLogger(__name__)


class Feature(enum.Enum):
    """What a Controlled tier can do (its ``supports``)."""

    PIN = "pin"  #: pin and unpin entries
    TTL = "ttl"  #: expire entries at their ``expires_at``
    TENANTS = "tenants"  #: record owners: per-tenant bytes, shares, clear by tenant
    CLEAR = "clear"  #: clear by namespace or everything


@dataclass(frozen=True)
class Tags:
    """What a store says of its entries besides their bytes: ``tenant``, the owner's ``tenant_tag`` ("" for the
    default tenant, the empty salt); ``expires_at``, when they expire in seconds on the tier's clock
    (``TierContext.clock``, wall-clock time by default), None for never. ``ttl_required``: whether a tier that
    cannot expire entries must skip them (True) or store them without expiry, to go by its own eviction (False:
    for entries whose expiry only reclaims space, such as a P/D prompt's tail)."""

    tenant: str = ""
    expires_at: float | None = None
    ttl_required: bool = True


DEFAULT_TAGS = Tags()

#: The label of the default tenant (the empty salt) in metrics, stats and share overrides.
DEFAULT_TENANT = "default"
#: The metrics label of every tenant that is not configured by name (a bounded label set).
OTHER_TENANT = "other"


def tenant_tag(salt: bytes) -> str:
    """The owner tag of a cache salt: "" for the empty salt, else 16 hex digits of a digest of it. Stable across
    processes, so a disk tier's tags survive a restart; it names no secret (the salt is a digest already)."""
    if not salt:
        return ""
    return hashlib.sha256(b"kvtier-tenant-tag\x00" + salt).hexdigest()[:16]


@dataclass(frozen=True)
class TierUsage:
    """What a tier holds, for ``stats()``: bytes and entries as ``TierStats`` has them, the bytes pinned and the
    pin budget, and bytes per tenant label (configured names, ``default``, and ``other`` for the rest; empty for
    a tier that records no owners)."""

    entries: int
    used_bytes: int
    capacity_bytes: int
    pinned_bytes: int = 0
    pin_budget_bytes: int = 0
    tenant_bytes: Mapping[str, int] = field(default_factory=dict)


@runtime_checkable
class Controlled(Protocol):
    """Optional capability: a tier with owner tags, expiry, pins, clears and usage (module docstring)."""

    supports: frozenset[Feature]

    def put_tagged(self, items: Sequence[tuple[ChunkHash, Payload]], tags: Tags) -> list[bool]:
        """``put``, recording ``tags`` on every entry newly stored."""

    def tags_of(self, keys: Sequence[ChunkHash]) -> list[Tags | None]:
        """Each key's tags (None where the tier does not hold it)."""

    def pin(self, keys: Sequence[ChunkHash]) -> int:
        """Pin the held ``keys``; bytes newly pinned. PinBudgetExceeded (nothing pinned) past the budget."""

    def unpin(self, keys: Sequence[ChunkHash]) -> int:
        """Release pins; bytes unpinned."""

    def pinned(self, keys: Sequence[ChunkHash]) -> list[bool]:
        """Which ``keys`` are pinned now."""

    def clear(self, *, tenant: str | None = None, everything: bool = False) -> int:
        """Remove the namespace's entries (or the tenant's, or everything held); the number removed."""

    def usage(self) -> TierUsage: ...


@runtime_checkable
class EvictionTags(Protocol):
    """Optional capability of an ``EvictionReporter`` that records tags: while its eviction listener runs (on the
    evicting thread, under the tier's lock), ``evicting_tags`` gives the evicted entry's tags without taking the
    lock, so a write-back tier below receives the entry with its owner and expiry. None outside such a call."""

    def evicting_tags(self) -> Tags | None: ...


def put_tagged(tier: Tier, items: Sequence[tuple[ChunkHash, Payload]], tags: Tags | None) -> list[bool]:
    """Store ``items`` with ``tags`` where the tier records them. A tier that records no owners is given a plain
    ``put``; a store with an expiry skips a tier that cannot expire entries (False for every item), so no tier
    keeps an entry longer than its store asked.

    Every store of every tier passes here, so this is where a tier's untranslated exception (a bug: tiers
    raise KVTierError) becomes a TierError, which callers count as a skipped store: a tier never raises into
    the engine that stored."""
    try:
        return _put_tagged(tier, items, tags)
    except KVTierError:
        raise
    except Exception as exc:
        log.exception("tier %s raised on put", getattr(tier, "name", "?"))
        raise TierError(f"{type(exc).__name__}: {exc}") from exc


def _put_tagged(tier: Tier, items: Sequence[tuple[ChunkHash, Payload]], tags: Tags | None) -> list[bool]:
    if tags is None or tags == DEFAULT_TAGS:
        return tier.put(items)
    features = tier.supports if isinstance(tier, Controlled) else frozenset()
    if tags.expires_at is not None and Feature.TTL not in features:
        if tags.ttl_required:
            return [False] * len(items)
        tags = Tags(tags.tenant)  # kept until the tier evicts it
        if tags == DEFAULT_TAGS:
            return tier.put(items)
    if not features:
        return tier.put(items)
    return tier.put_tagged(items, tags)




def check_ttl(ttl_s: object) -> float:
    """``ttl_s`` as a float if it is a number of seconds in ``[0, MAX_TTL_S]``; InvalidArgument otherwise (a
    bool, a non-number, NaN, infinite, negative or too long)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) \
            or not 0 <= ttl_s <= MAX_TTL_S:
        raise InvalidArgument(f"ttl_s must be a number of seconds from 0 to {MAX_TTL_S}, not {ttl_s!r}")
    return float(ttl_s)


def expires_at(ttl_s: float | None, now: float) -> float | None:
    """``now + ttl_s``; None for None. InvalidArgument for a TTL ``check_ttl`` refuses."""
    if ttl_s is None:
        return None
    return now + check_ttl(ttl_s)


@dataclass(frozen=True)
class ControlledTierConfig(TierConfig):
    """Fields of the tiers that enforce pins and tenant shares themselves (memory, disk).

    ``pin_budget_bytes``: the most bytes pins may hold in this tier (None: a quarter of its capacity; 0: no
    pins), so pins can never fill it; ``tenant_share``: the fraction of the capacity each tenant may hold (1.0:
    no quota); ``tenant_shares``: per-tenant overrides of it, by tenant name (``default`` is the empty salt;
    other names are those of the cache's ``tenants``).
    """

    pin_budget_bytes: int | None = None
    tenant_share: float = 1.0
    tenant_shares: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pin_budget_bytes is not None and self.pin_budget_bytes < 0:
            raise ConfigError(f"tiers[{self.kind}]: pin_budget_bytes must not be negative")
        if not isinstance(self.tenant_shares, Mapping):
            raise ConfigError(f"tiers[{self.kind}]: tenant_shares must map tenant names to fractions")
        for name, share in {"tenant_share": self.tenant_share, **self.tenant_shares}.items():
            if not isinstance(share, int | float) or isinstance(share, bool) or not 0 < share <= 1:
                raise ConfigError(f"tiers[{self.kind}]: the share of {name!r} must be a fraction in (0, 1]")

    def pin_budget(self, capacity: int) -> int:
        """The pin budget in bytes for a tier of ``capacity`` bytes."""
        return capacity // 4 if self.pin_budget_bytes is None else min(self.pin_budget_bytes, capacity)
