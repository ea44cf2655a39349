"""Cache control on Redis/Valkey (kvtier/tiers/control.py): what a shared store can do, with its own commands.

Keys
    A KVCache's Redis keys carry its namespace tag (16 hex digits of the model's namespace root):
    ``<key_prefix><codec>:<namespace>:{<chunk hash hex>}`` (parts: ``...}:<nonce>:<i>``). So one model's entries
    are found with ``SCAN MATCH <key_prefix><codec>:<namespace>:*`` (never ``KEYS``), on every primary of a
    cluster. Entries written before this layout (``<key_prefix><codec>:{...}``) are no longer read by the new
    version: they are misses, left to the server's eviction or removed by ``clear(all=True)``.

Expiry
    A store with a retention time writes its keys with ``SET ... PX`` (parts a minute longer, as for ``ttl_s``):
    the server expires them; an expired key is a miss for every replica. With the tier's own ``ttl_s`` and
    ``refresh_ttl`` both on, every read re-arms the expiry (``GETEX``), which would stretch a store's retention and
    undo pins: such a tier supports neither (a store with a TTL skips it, a pin is refused).

Pins
    A pin removes the keys' expiry (``PERSIST``, head and parts) and records the value in a hash
    ``<key_prefix><codec>:<namespace>:pins`` (head key -> bytes) that every replica sees: the pin budget
    (``pin_budget_bytes``, default a quarter of the server's ``maxmemory``) is checked against it. Redis itself
    still evicts under memory pressure as its ``maxmemory-policy`` says: ``volatile-*`` policies evict only keys
    with an expiry, so they spare pinned keys (and every key stored without a TTL); ``allkeys-*`` policies evict
    any key, pinned or not, and no client can prevent it. Pin only with a ``volatile-*`` policy and TTLs on the
    rest (docs/operations/cache-control.md). Unpinning does not restore an expiry.

Tenants
    Keys do not carry the tenant (every read would need it): a salted tenant's stores add their head keys to a set
    ``<key_prefix><codec>:<namespace>:tenant:<tag>`` (one extra round trip per store), which ``clear(tenant=...)``
    walks with ``SSCAN``. The set keeps one member (about 100 bytes) per chunk stored until that tenant or the
    namespace is cleared; members whose keys the server evicted are skipped. The default tenant (empty salt) has
    no set and cannot be cleared alone. No tenant shares: the server, not kvtier, decides what to evict.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from time import monotonic

from kvtier.base.errors import NotSupported, PinBudgetExceeded, TierError
from kvtier.base.keys import ChunkHash
from kvtier.tiers.control import MAX_TTL_S, Feature, TierUsage
from kvtier.tiers.redis.batches import Batch
from kvtier.tiers.redis.split import HEADER_BYTES, SplitHeader, part_keys_of

log = logging.getLogger(__name__)

#: Keys asked for per SCAN / SSCAN call, and unlinked per UNLINK.
SCAN_COUNT = 1000


class RedisControl:
    """The ``Controlled`` methods of RedisTier (a base class of it); see the module docstring."""

    def _control_init(self, clock, namespace: str) -> None:
        config = self.config
        self._clock = clock
        self._space = self._prefix + (namespace.encode() + b":" if namespace else b"")
        self._pins_key = self._space + b"pins"
        rearms = bool(config.ttl_s) and config.refresh_ttl
        self.supports = frozenset({Feature.CLEAR, Feature.TENANTS} | (set() if rearms else {Feature.PIN, Feature.TTL}))

    # -- expiry ----------------------------------------------------------------------------------------------
    def _store_ttl_ms(self, expires_at: float | None) -> int | None:
        """Milliseconds left until ``expires_at`` (None: the tier's own ttl_s applies; 0: already expired, or not a
        time at all). At most ``MAX_TTL_S``: a later expiry (callers check TTLs, but a tier never raises into the
        engine) would overflow the integer, or the 64-bit milliseconds Redis takes."""
        if expires_at is None:
            return None
        left = expires_at - self._clock()
        if not left > 0:  # NaN too
            return 0
        return math.ceil(min(left, MAX_TTL_S) * 1000)

    def _tenant_key(self, tenant: str) -> bytes:
        return self._space + b"tenant:" + tenant.encode()

    def _index_tenant(self, tenant: str, heads: list[bytes], deadline: float) -> None:
        """Add stored heads to the tenant's set (a failure is counted: those entries then escape a tenant clear)."""
        if tenant and heads:
            batches: dict[str, Batch] = {}
            index = self._tenant_key(tenant)
            self._servers.batch(batches, index).add(None, b"SADD", index, *heads)
            self._servers.run(batches, "put", deadline)

    # -- pins ------------------------------------------------------------------------------------------------
    def pin(self, keys: Sequence[ChunkHash]) -> int:
        if Feature.PIN not in self.supports:
            raise NotSupported(f"redis tier {self.name}: reads re-arm ttl_s (refresh_ttl), so nothing can be pinned")
        deadline = monotonic() + self.config.timeout_s
        heads = [self._key(key) for key in keys]
        pinned = self._pinned_heads(heads, deadline)
        sizes = self._sizes([h for h, was in zip(heads, pinned) if not was], deadline)
        extra = sum(sizes.values())
        used = self._pinned_bytes(deadline)
        budget = self._pin_budget()
        if used + extra > budget:
            raise PinBudgetExceeded(f"tier {self.name}: pinning {extra} more bytes would pass its pin budget of "
                                    f"{budget} bytes ({used} pinned already); nothing was pinned")
        if sizes:
            batches: dict[str, Batch] = {}
            for head, parts in self._parts(list(sizes), deadline).items():
                batch = self._servers.batch(batches, head)
                for key in (head, *parts):
                    batch.add(None, b"PERSIST", key)
            self._servers.batch(batches, self._pins_key).add(
                None, b"HSET", self._pins_key, *[x for head, n in sizes.items() for x in (head, b"%d" % n)])
            self._run_all(batches, "pin", deadline)
        return extra

    def unpin(self, keys: Sequence[ChunkHash]) -> int:
        deadline = monotonic() + self.config.timeout_s
        heads = [self._key(key) for key in keys]
        if not heads:
            return 0
        batches: dict[str, Batch] = {}
        batch = self._servers.batch(batches, self._pins_key)
        batch.add(None, b"HMGET", self._pins_key, *heads)
        batch.add(None, b"HDEL", self._pins_key, *heads)
        done = self._run_all(batches, "unpin", deadline)
        return sum(int(n) for n in done[0].replies[0] if n is not None)

    def pinned(self, keys: Sequence[ChunkHash]) -> list[bool]:
        return self._pinned_heads([self._key(key) for key in keys], monotonic() + self.config.timeout_s)

    def _pinned_heads(self, heads: list[bytes], deadline: float) -> list[bool]:
        if not heads:
            return []
        batches: dict[str, Batch] = {}
        self._servers.batch(batches, self._pins_key).add(None, b"HMGET", self._pins_key, *heads)
        replies = self._run_all(batches, "pin", deadline)[0].replies[0]
        return [reply is not None for reply in replies]

    def _pinned_bytes(self, deadline: float) -> int:
        batches: dict[str, Batch] = {}
        self._servers.batch(batches, self._pins_key).add(None, b"HVALS", self._pins_key)
        return sum(int(n) for n in self._run_all(batches, "pin", deadline)[0].replies[0])

    def _pin_budget(self) -> int:
        if self.config.pin_budget_bytes is not None:
            return self.config.pin_budget_bytes
        return self.stats().capacity_bytes // 4

    def _sizes(self, heads: list[bytes], deadline: float) -> dict[bytes, int]:
        """Each existing head's whole value size (a split value's total), by head."""
        batches: dict[str, Batch] = {}
        for head in heads:
            batch = self._servers.batch(batches, head)
            batch.add(head, b"GETRANGE", head, b"0", b"%d" % (HEADER_BYTES - 1))
            batch.add(head, b"STRLEN", head)
        out: dict[bytes, int] = {}
        for batch in self._run_all(batches, "pin", deadline):
            replies = batch.replies or []
            for head, header, strlen in zip(batch.tags[::2], replies[::2], replies[1::2]):
                if isinstance(strlen, int) and strlen > 0:
                    split = SplitHeader.parse(header) if isinstance(header, bytes) else None
                    out[head] = split.total if split is not None else strlen
        return out

    def _parts(self, heads: list[bytes], deadline: float) -> dict[bytes, list[bytes]]:
        """The part keys of each head (none for a plain value)."""
        batches: dict[str, Batch] = {}
        for head in heads:
            self._servers.batch(batches, head).add(head, b"GETRANGE", head, b"0", b"%d" % (HEADER_BYTES - 1))
        out: dict[bytes, list[bytes]] = {}
        for batch in self._run_all(batches, "pin", deadline):
            for head, reply in zip(batch.tags, batch.replies or ()):
                out[head] = part_keys_of(head, reply) if isinstance(reply, bytes) else []
        return out

    # -- clear -----------------------------------------------------------------------------------------------
    def clear(self, *, tenant: str | None = None, everything: bool = False) -> int:
        """Namespace or everything: SCAN MATCH on every primary and UNLINK what it finds (pins and tenant sets
        of the scope included); tenant: the keys in its set. Returns the values removed (heads)."""
        if everything:
            return self._scan_unlink(self._prefix + b"*")
        if tenant is None:
            return self._scan_unlink(self._space + b"*")
        if not tenant:
            raise NotSupported(f"redis tier {self.name}: the default tenant's keys are not indexed; clear the "
                               "namespace instead")
        return self._clear_tenant(tenant)

    def _scan_unlink(self, pattern: bytes) -> int:
        removed = 0
        for node in self._servers.primaries():
            cursor = b"0"
            while True:
                deadline = monotonic() + self.config.timeout_s
                batch = Batch(node)
                batch.add(None, b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"%d" % SCAN_COUNT)
                cursor, found = self._run_all({node.name: batch}, "clear", deadline)[0].replies[0]
                if found:
                    unlink = Batch(node)
                    for key in found:  # one key a command: a cluster refuses keys of several slots in one
                        unlink.add(None, b"UNLINK", key)
                    self._run_all({node.name: unlink}, "clear", deadline)
                    removed += sum(1 for key in found if key.endswith(b"}"))
                if cursor in (b"0", 0):
                    break
        return removed

    def _clear_tenant(self, tenant: str) -> int:
        index = self._tenant_key(tenant)
        removed, cursor = 0, b"0"
        while True:
            deadline = monotonic() + self.config.timeout_s
            batches: dict[str, Batch] = {}
            self._servers.batch(batches, index).add(None, b"SSCAN", index, cursor, b"COUNT", b"%d" % SCAN_COUNT)
            cursor, heads = self._run_all(batches, "clear", deadline)[0].replies[0]
            if heads:
                parts = self._parts(heads, deadline)
                doomed: dict[str, Batch] = {}
                for head in heads:
                    self._servers.batch(doomed, head).add("head", b"UNLINK", head, *parts.get(head, []))
                self._servers.batch(doomed, self._pins_key).add("pins", b"HDEL", self._pins_key, *heads)
                for batch in self._run_all(doomed, "clear", deadline):
                    removed += sum(1 for tag, n in zip(batch.tags, batch.replies or ())
                                   if tag == "head" and isinstance(n, int) and n > 0)
            if cursor in (b"0", 0):
                break
        self._run_all(self._one(index, b"UNLINK", index), "clear", monotonic() + self.config.timeout_s)
        return removed

    def _one(self, key: bytes, *command: bytes) -> dict[str, Batch]:
        batches: dict[str, Batch] = {}
        self._servers.batch(batches, key).add(None, *command)
        return batches

    def _run_all(self, batches: dict[str, Batch], op: str, deadline: float) -> list[Batch]:
        """Run ``batches``; TierError unless every one got replies (failures are counted by Servers)."""
        done = self._servers.run(batches, op, deadline)
        if len(done) < len(batches):
            raise TierError(f"redis tier {self.name}: {op} failed on a server")
        return done

    # -- usage -----------------------------------------------------------------------------------------------
    def usage(self) -> TierUsage:
        """The server's figures (TierStats), the bytes pinned (every replica's pins) and the budget; no bytes per
        tenant (the server does not know them)."""
        stats = self.stats()
        try:
            pinned = self._pinned_bytes(monotonic() + self.config.timeout_s)
        except TierError:
            pinned = 0
        budget = self.config.pin_budget_bytes if self.config.pin_budget_bytes is not None else stats.capacity_bytes // 4
        return TierUsage(stats.entries, stats.used_bytes, stats.capacity_bytes, pinned, budget)

    def tags_of(self, keys: Sequence[ChunkHash]) -> list[None]:
        """The server keeps no owners kvtier could read back cheaply: a promotion from Redis has no tags."""
        return [None] * len(keys)
