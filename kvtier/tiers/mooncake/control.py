"""Cache control on a Mooncake Store pool (kvtier/tiers/control.py): what it can do, and what it cannot.

* **Clear**: keys are ``<key_prefix><codec>:<namespace>:<chunk hash hex>``, so one model's entries are removed
  with Mooncake's own ``remove_by_regex`` on that prefix, everything of this key prefix and codec (every model,
  and keys of the layout before namespaces) with the regex of ``<key_prefix><codec>:``. Removal is forced past
  read leases, as ``delete`` is; a reader racing it gets a miss.
* **Pins: not supported.** Mooncake's hard pin (``ReplicateConfig.with_hard_pin``) and soft pin
  (``soft_pin_ttl_ms``, ``soft_pin_action``) are options of a *put* or *upsert*: the installed store API has no
  call that pins an object already stored, so pinning a prefix would mean reading every chunk back and
  re-writing it (``batch_upsert_from`` with ``with_hard_pin``), and the pool keeps no pin set a budget could be
  checked against. That is not done: a pin naming this tier is refused (NotSupported); pins with no tier named
  skip it.
* **Expiry: not supported.** Mooncake keeps objects until its own eviction removes them (a soft pin's TTL is how
  long eviction spares an object, not when it goes): a store with a TTL skips this tier, unless its tags say the
  expiry is optional (``Tags.ttl_required``, a P/D prompt's tail): kvtier/tiers/control.py then stores it plainly.
* **Tenants: not supported.** Keys carry no tenant, and the master has no per-owner accounting kvtier could use.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from time import monotonic

from kvtier.base.errors import NotSupported, TierError
from kvtier.base.keys import ChunkHash
from kvtier.tiers.control import Feature, Tags, TierUsage


class MooncakeControl:
    """The ``Controlled`` methods of MooncakeTier (a base class of it); see the module docstring."""

    supports = frozenset({Feature.CLEAR})

    def put_tagged(self, items, tags: Tags) -> list[bool]:
        """Owners are not recorded and nothing expires here: a store with an expiry is refused (all False)."""
        if tags.expires_at is not None:
            return [False] * len(items)
        return self.put(items)

    def tags_of(self, keys: Sequence[ChunkHash]) -> list[None]:
        return [None] * len(keys)

    def pin(self, keys: Sequence[ChunkHash]) -> int:
        raise NotSupported(f"mooncake tier {self.name}: Mooncake pins objects only when they are put")

    def unpin(self, keys: Sequence[ChunkHash]) -> int:
        return 0

    def pinned(self, keys: Sequence[ChunkHash]) -> list[bool]:
        return [False] * len(keys)

    def clear(self, *, tenant: str | None = None, everything: bool = False) -> int:
        if tenant is not None:
            raise NotSupported(f"mooncake tier {self.name}: keys carry no tenant")
        prefix = self._root if everything else self._prefix
        if not self._usable("clear"):
            raise TierError(f"mooncake tier {self.name}: the pool is not reachable")
        removed = self._client.remove_matching("^" + re.escape(prefix), monotonic() + self.config.timeout_s)
        if removed < 0:
            raise TierError(f"mooncake tier {self.name}: remove_by_regex failed with code {removed}")
        return removed

    def usage(self) -> TierUsage:
        stats = self.stats()
        return TierUsage(stats.entries, stats.used_bytes, stats.capacity_bytes)
