"""The Tier protocol, its optional capabilities, tier configs and the registry of tier kinds.

A tier stores opaque blobs (see blob.py) under chunk keys. Every method is batched: it takes a list of keys
so a tier can pipeline (Redis), overlap (disk) or amortise Python overhead. Contracts every tier keeps (the
conformance suite in tests/conformance checks them):

* ``used_bytes`` never exceeds ``capacity_bytes``.
* An entry returned by ``get`` stays valid (pinned, never evicted or overwritten) until the ``with`` block
  that received it ends, whatever happens inside it.
* ``put`` has consumed each payload (written or copied it) before it returns; a stored entry becomes visible
  only when complete. A chunk that cannot be stored (larger than the tier, tier full of pinned entries, I/O
  error) is skipped: ``put`` returns False for it and raises nothing.
* Backend failures surface as misses / skipped stores, counted in metrics; a tier never raises into the
  cache except ``KVTierError`` subclasses from programming errors.
* Every tier is built as ``XTier(config, ctx)``: its ``TierConfig`` subclass and the ``TierContext`` of the
  cache that owns it. A kind's config and tier classes are found by name in ``TIER_KINDS`` and
  ``TIER_CLASSES`` (lazy registries: nothing of a tier is imported before it is configured or built), so a
  tier's config never imports its tier. Optional capabilities are the protocols ``EvictionReporter``,
  ``Flushable``, ``RemovalReporter``, ``Listable``, ``SharedStore``, ``LargeLoadWindows`` and ``BoundedGets``.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

from kvtier.base.errors import ConfigError
from kvtier.base.keys import ChunkHash
from kvtier.base.layout import KVSpec
from kvtier.base.metrics import Metrics
from kvtier.base.registry import Registry
from kvtier.base.state import ModelStateSpec
from kvtier.codecs import Codec, Payload, get_codec
from kvtier.policy.admission import DEFAULT_SKETCH_CHUNKS, AdmissionSettings
from kvtier.tiers.metrics import CAPACITY_BYTES, ENTRIES, USED_BYTES


@dataclass(frozen=True)
class TierStats:
    used_bytes: int
    capacity_bytes: int
    entries: int


class Tier(Protocol):
    name: str
    codec: Codec
    #: True where blobs leave the process (disk, network): they are sealed on write and verified on read.
    verifies: bool

    def contains(self, keys: Sequence[ChunkHash]) -> list[bool]:
        """Which keys are present now. No side effects on eviction order."""

    def get(self, keys: Sequence[ChunkHash]) -> AbstractContextManager[list[memoryview | None]]:
        """Blobs of ``keys`` (None for a miss), valid until the ``with`` block exits."""

    def put(self, items: Sequence[tuple[ChunkHash, Payload]]) -> list[bool]:
        """Store blobs; True where the key is now present. Existing keys are kept, not rewritten."""

    def delete(self, keys: Sequence[ChunkHash]) -> None:
        """Remove keys if present (a pinned entry goes once its readers are done)."""

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Release resources; flush pending writes where the tier has them."""


#: Receives an entry its tier evicts: (key, blob), the blob valid only during the call (see EvictionReporter).
EvictionListener = Callable[[ChunkHash, memoryview], None]


@runtime_checkable
class EvictionReporter(Protocol):
    """Optional capability: a tier that evicts by itself and reports each eviction, so it can feed a write-back
    tier below it (KVCache checks for it with isinstance).

    Contract: the listener is called synchronously, once per entry the tier evicts to make room, before the
    entry's bytes are reused and while the tier holds its own lock; the blob is valid only during the call.
    The listener must not call back into this tier, and must not raise: it handles its own failures.
    Entries removed by ``delete`` or ``close`` are not evictions and are not reported. Setting a listener
    replaces the previous one; None removes it.
    """

    def set_eviction_listener(self, listener: EvictionListener | None) -> None: ...


@runtime_checkable
class ChainOrdered(Protocol):
    """Optional capability: a tier whose eviction policy learns each request's chain (kvtier/policy/base.py,
    ``on_chain``). KVCache calls ``order_chain`` once a request is done with the tier: after a retrieve with
    the prefix it loaded (or promoted), after a store with the prompt's chunks, root first. Keys the tier
    does not hold are ignored; no chunk is read or written (the disk tier records the order in its files'
    mtimes)."""

    def order_chain(self, keys: Sequence[ChunkHash]) -> None: ...


@runtime_checkable
class LargeLoadWindows(Protocol):
    """Optional capability: a tier that says whether a long load should ask ``get`` for fewer, larger windows
    (``large_load_windows`` True: a get costs no round trip per window, as in memory or on a local disk; see
    ``kvtier.core.pipeline.Pipeline.windows``). Tiers without it get windows of the base size."""

    large_load_windows: bool


@runtime_checkable
class BoundedGets(Protocol):
    """Optional capability: a tier whose ``get`` holds at most ``max_get_bytes`` of blobs at once (values read
    into one fixed transfer buffer, as the Mooncake tier's), each counted rounded up to a multiple of 64 bytes
    (``kvtier.codecs.blob.ALIGN``). A value that does not fit is a miss, so callers cut their reads into gets
    that fit (``kvtier.core.bounded``); gets that together exceed it may wait for each other, within their
    deadline. Tiers without it take any number of keys in one get."""

    max_get_bytes: int


@runtime_checkable
class Flushable(Protocol):
    """Optional capability: a tier that writes in the background.

    ``flush`` returns once every store accepted by ``put`` before the call is visible (or has failed and
    been counted). Tiers without it make stores visible before ``put`` returns.
    """

    def flush(self) -> None: ...


#: Receives the key of an entry that left its tier (see RemovalReporter).
RemovalListener = Callable[[ChunkHash], None]


@runtime_checkable
class RemovalReporter(Protocol):
    """Optional capability: a tier that tells which keys leave it, so the cache's event stream (and a router
    reading it) knows where prefixes are.

    Contract: the listener is called once for every entry that stops being visible, whatever the cause
    (evicted, deleted, found lost or unreadable), possibly from the tier's own threads and while it holds its
    lock: the listener must be quick, must not call back into the tier and must not raise. Entries dropped by
    ``close`` are not reported. Setting a listener replaces the previous one; None removes it.
    """

    def set_removal_listener(self, listener: RemovalListener | None) -> None: ...


@runtime_checkable
class Listable(Protocol):
    """Optional capability: a tier that can list what it holds (for snapshots of the cache's contents)."""

    def list_keys(self) -> list[ChunkHash]:
        """Every key the tier holds now, or has accepted to store in the background (a store that then fails
        is reported by a RemovalReporter), in no particular order."""


@runtime_checkable
class SharedStore(Protocol):
    """Optional capability: a tier whose entries live in a store other processes read too (Redis/Valkey).

    ``store_id`` names the store and key space: two tiers with the same id see the same entries, so a chunk
    one replica stored there is a hit for every replica configured with it. No secrets go into the id.
    """

    @property
    def store_id(self) -> str: ...


def stats_gauges(tier: Tier, stats: TierStats | None = None) -> Iterator[tuple[str, dict[str, str], float]]:
    """The gauges every tier exports from its ``stats()`` (or from ``stats`` it already has): used bytes,
    capacity and entries."""
    stats = tier.stats() if stats is None else stats
    labels = {"tier": tier.name}
    yield USED_BYTES.name, labels, stats.used_bytes
    yield CAPACITY_BYTES.name, labels, stats.capacity_bytes
    yield ENTRIES.name, labels, stats.entries


class WriteMode(enum.Enum):
    """How a tier below the first receives chunks."""

    THROUGH = "through"  #: every store is written to this tier too
    BACK = "back"  #: chunks arrive only when the tier above evicts them


@dataclass(frozen=True)
class TierContext:
    """What a tier needs from the cache that builds it."""

    #: What the cache holds: attention KV, or a ModelStateSpec for models with SSM state as well.
    spec: KVSpec | ModelStateSpec
    metrics: Metrics
    name: str
    #: The cache's tensor-parallel rank and size: a tier private to one process (disk) keeps ranks apart.
    tp_rank: int = 0
    tp_size: int = 1
    #: A short tag of the cache's namespace (the model, without tenant salt): a shared store keeps it in its keys
    #: so one model's entries can be cleared (kvtier/tiers/control.py). Empty: the tier's own default.
    namespace: str = ""
    #: Owner tag (``control.tenant_tag``) -> tenant name, for the tenants configured by name (metrics labels and
    #: share overrides); every other tenant is ``other`` in metrics.
    tenants: Mapping[str, str] = field(default_factory=dict)
    #: The clock entries expire by (seconds; wall-clock time, so a disk tier's expiries survive a restart).
    clock: Callable[[], float] = time.time


@dataclass(frozen=True)
class TierConfig:
    """Base of every tier's config. Subclasses add their own fields (sizes as ints in bytes); ``build`` makes
    the tier class registered for ``kind`` in ``TIER_CLASSES`` (a config for a tier of its own may override
    it instead)."""

    kind: ClassVar[str]
    #: The admission policy a tier of this kind gets below another tier when its config names none (the first
    #: tier of a cache admits ``always`` unless told otherwise; kvtier.policy.admission).
    default_admission: ClassVar[str] = "always"
    codec: str = "raw"
    write: WriteMode = WriteMode.THROUGH
    #: Which writes this tier accepts: ``always`` or ``second-hit`` (only chunks a request sighted twice: stored
    #: or hit before; kvtier.policy.admission has the rules for write-back and promotions). Unset: ``always`` for
    #: a cache's first tier; below it, the kind's default (``second-hit`` for disk, ``always`` for memory,
    #: redis and mooncake: docs/benchmarks/admission.md has the measurements behind them).
    admission: str | None = None
    #: A byte-rate cap on this tier's writes from this process (a token bucket over the entries' raw KV
    #: bytes), e.g. ``200MiB``; unset: no cap. Meant for shared tiers, so one replica cannot eat their bandwidth.
    admission_max_bytes_per_s: int | None = None
    #: How many bytes the rate cap lets through at once after a quiet spell (default: one second of the rate).
    admission_burst_bytes: int | None = None
    #: Distinct chunks the ``second-hit`` sketch remembers (256 bytes of memory each; counts halve after ten
    #: times as many sightings).
    admission_sketch_chunks: int = DEFAULT_SKETCH_CHUNKS

    def __post_init__(self) -> None:
        get_codec(self.codec)  # raises ConfigError for an unknown codec
        self.admission_settings()  # raises ConfigError for an unknown policy or a bad cap

    def admission_settings(self, first: bool = False) -> AdmissionSettings:
        """This tier's admission options, checked; ``first``: the tier is its cache's first (fastest) one."""
        policy = self.admission or ("always" if first else type(self).default_admission)
        return AdmissionSettings(policy, self.admission_sketch_chunks, self.admission_max_bytes_per_s,
                                 self.admission_burst_bytes)

    def build(self, ctx: TierContext) -> Tier:
        """The tier this config describes: every tier is built as ``XTier(config, ctx)``."""
        return TIER_CLASSES.lookup(self.kind)(self, ctx)


_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


def check_device(device: str, what: str = "device") -> None:
    """ConfigError (naming ``what``) unless ``device`` is ``cpu`` or ``cuda:N``."""
    if not _DEVICE.match(device):
        raise ConfigError(f"{what} must be cpu or cuda:N, not {device!r}")


#: tier kind (a config's ``kind``, the ``kind:`` of YAML) -> its TierConfig subclass
TIER_KINDS: Registry[type[TierConfig]] = Registry("tier kind")
#: tier kind -> the tier class its config builds, as ``XTier(config, ctx)``
TIER_CLASSES: Registry[Callable[[TierConfig, TierContext], Tier]] = Registry("tier")

C = TypeVar("C", bound=type[TierConfig])


def register_tier(cls: C) -> C:
    """Class decorator: make a TierConfig subclass available under ``cls.kind`` in configs. Such a config
    builds its tier with its own ``build`` unless a tier class is registered for the kind in TIER_CLASSES."""
    TIER_KINDS.add(cls.kind, cls)
    return cls


def register_tier_kind(kind: str, package: str, config: str, tier: str) -> None:
    """Make tier ``kind`` available without importing it: its config is ``<package>.config.<config>`` and
    its tier ``<package>.tier.<tier>``, each imported the first time it is needed."""
    TIER_KINDS.register(kind, f"{package}.config", config)
    TIER_CLASSES.register(kind, f"{package}.tier", tier)


register_tier_kind("memory", "kvtier.tiers.memory", "MemoryTierConfig", "MemoryTier")
register_tier_kind("disk", "kvtier.tiers.disk", "DiskTierConfig", "DiskTier")
register_tier_kind("redis", "kvtier.tiers.redis", "RedisTierConfig", "RedisTier")
register_tier_kind("mooncake", "kvtier.tiers.mooncake", "MooncakeTierConfig", "MooncakeTier")
