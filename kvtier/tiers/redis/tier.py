"""Shared tier on Redis or Valkey: one prefix cache for many engine replicas.

Keys
    ``<key_prefix><codec>:<namespace>:{<chunk hash hex>}``, e.g. ``kvtier:raw:9c1e...:{3fa2...}``. The chunk hash
    already covers the model, KV spec, chunk size, TP rank, adapter and tenant salt, so replicas of one model share
    entries and nothing else does; the codec in the key keeps two codecs from reading each other's entries, and the
    namespace tag lets one model's entries be cleared (control.py, which also has pins, expiry and tenants). The
    braces are a Redis Cluster hash tag: a value's parts live in its head's slot, so they travel on one connection.

Values
    The sealed, checksummed blob (blob.py). KVCache verifies every read against the chunk key and token ids,
    so a planted, truncated, foreign or older-format value is a miss (and is deleted). A blob larger than
    ``max_part_bytes`` is split (split.py) so that no single command moves more than that; a reader sees it
    only once every part exists. Largest value: ``max_value_bytes`` (default 1 GiB) and at most MAX_PARTS
    (4,096) parts; largest single command: ``max_part_bytes`` (default 8 MiB, at most 512 MiB, Redis's
    proto-max-bulk-len). A head declaring parts under 4 KiB or more than 4,096 is foreign: a miss, deleted
    before any part is asked for.

Capacity
    Left to the server: set ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (docs/tiers/redis.md). The tier does not
    evict; ``stats()`` reports the server's ``used_memory``, its ``maxmemory`` (or its host's memory when it has
    none) and its key count (split values count once per part), summed over a cluster's primaries.

Failures
    Every call has one deadline: ``timeout_s``, plus ``1 / min_rate_bytes`` seconds per byte of value moved.
    A dead, slow or resetting server gives misses and skipped stores (``kvtier_tier_errors_total``,
    ``kvtier_skipped_stores_total``); ``breaker_failures`` consecutive failures of one server open its circuit
    breaker, after which requests skip it at once while a background thread probes it every
    ``breaker_cooldown_s`` and closes the breaker when it answers. With Redis Cluster each primary has its own
    pool and breaker, and one pipeline per primary is sent per call (servers.py, pipeline.py).

Modules: config.py (RedisTierConfig), split.py (split values), servers.py (routing, health), pipeline.py
(the batch runner), pool.py (connections per server), client.py (the redis-py adapter), resp.py (RESP2).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from time import monotonic
from urllib.parse import urlsplit

import numpy as np

from kvtier.base.keys import ChunkHash
from kvtier.base.metrics import declare_counter
from kvtier.codecs import Payload, get_codec
from kvtier.net.buffers import TransferBufferPool
from kvtier.tiers.base import TierContext, TierStats
from kvtier.tiers.control import DEFAULT_TAGS, Tags
from kvtier.tiers.metrics import CORRUPT_CHUNKS, SKIPPED_STORES, WRITTEN_BYTES
from kvtier.tiers.redis.batches import Batch, is_redirect
from kvtier.tiers.redis.client import Endpoint
from kvtier.tiers.redis.config import MiB, RedisTierConfig
from kvtier.tiers.redis.control import RedisControl
from kvtier.tiers.redis.resp import RespError
from kvtier.tiers.redis.servers import Servers
from kvtier.tiers.redis.split import (
    HEADER_BYTES,
    MAX_PARTS,
    HeadReader,
    PartReader,
    SplitHeader,
    SplitValue,
    Unusable,
    part_keys_of,
)

log = logging.getLogger(__name__)

INCOMPLETE_VALUES = declare_counter("kvtier_incomplete_values_total",
                                    "Split values found with a part missing (evicted or expired): misses.", ("tier",))

#: A put stages at most this many bytes of values before sending them (one round trip per stage).
STAGE_BYTES = 64 * MiB
_STATS_FIELDS = (b"used_memory:", b"maxmemory:", b"total_system_memory:")


class Role(enum.Enum):
    """What one SET of a put pipeline writes: a value's head, or one of its other parts."""

    HEAD = "head"
    PART = "part"


@dataclass(frozen=True, slots=True)
class _Write:
    """The tag of one SET in a put pipeline: which piece of which value (its position in the put)."""

    role: Role
    index: int


@dataclass(frozen=True, slots=True)
class _Staged:
    """A value sent in a put stage: its head key, its size and, when split, the keys of its other parts."""

    head: bytes
    nbytes: int
    part_keys: list[bytes]


def _stages(todo: list[int], sizes: list[int], capacity: int) -> Iterator[list[int]]:
    """``todo`` in consecutive groups whose values fit ``capacity`` bytes together (a larger one goes alone)."""
    group: list[int] = []
    used = 0
    for i in todo:
        if group and used + sizes[i] > capacity:
            yield group
            group, used = [], 0
        group.append(i)
        used += sizes[i]
    if group:
        yield group


class RedisTier(RedisControl):
    """The Tier protocol over a Redis/Valkey server or cluster (see the module docstring); a ``SharedStore`` and
    ``Controlled`` (control.py)."""

    verifies = True

    def __init__(self, config: RedisTierConfig, ctx: TierContext) -> None:
        self.name = ctx.name
        self.config = config
        self.codec = get_codec(config.codec)
        self._metrics = ctx.metrics
        self._prefix = f"{config.key_prefix}{self.codec.name}:".encode()
        self._control_init(ctx.clock, ctx.namespace)
        self._ttl_ms = int(config.ttl_s * 1000) if config.ttl_s else 0
        # parts outlive their head a little, so a head never points at parts that already expired
        self._part_ttl_ms = self._ttl_ms + max(60_000, self._ttl_ms // 10) if self._ttl_ms else 0
        self._ttl_args = (b"PX", b"%d" % self._ttl_ms) if self._ttl_ms else ()
        self._part_ttl_args = (b"PX", b"%d" % self._part_ttl_ms) if self._part_ttl_ms else ()
        self._rate = float(config.min_rate_bytes)
        #: the largest value put() stores: readers refuse heads of more than MAX_PARTS parts
        self.max_value_bytes = min(config.max_value_bytes, MAX_PARTS * config.max_part_bytes)
        self._buffers = TransferBufferPool(config.buffer_pool_bytes)
        endpoint = Endpoint.from_url(config.url, {
            "username": config.username, "password": config.password,
            "ssl_ca_certs": config.tls_ca_file, "ssl_certfile": config.tls_cert_file,
            "ssl_keyfile": config.tls_key_file,
        })
        self._servers = Servers(endpoint, config, self._metrics, self.name)
        self._last_stats = TierStats(0, 0, 0)

    @property
    def store_id(self) -> str:
        """The server (its URL without credentials or query; a cluster's: the node named) and the key space."""
        where = urlsplit(self.config.url)
        server = f"{where.hostname}:{where.port or 6379}{where.path or '/0'}" if where.hostname else where.path
        return f"redis:{server}#{self._prefix.decode()}"

    # -- the Tier protocol ---------------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkHash]) -> list[bool]:
        out = [False] * len(keys)
        if not keys:
            return out
        batches: dict[str, Batch] = {}
        for node, (idx, heads) in self._servers.group([self._key(key) for key in keys]).items():
            batches[node.name] = batch = Batch(node)
            batch.add_exists(idx, heads)
        for batch in self._servers.run(batches, "contains", monotonic() + self.config.timeout_s):
            for i, reply in zip(batch.tags, batch.replies or ()):
                out[i] = reply == 1
        return out

    @contextmanager
    def get(self, keys: Sequence[ChunkHash]) -> Iterator[list[memoryview | None]]:
        taken: list[np.ndarray] = []  # the buffers the values were received into, released when the block ends
        try:
            yield self._get(keys, taken)
        finally:
            for buf in taken:
                self._buffers.release(buf)

    def put(self, items: Sequence[tuple[ChunkHash, Payload]]) -> list[bool]:
        return self.put_tagged(items, DEFAULT_TAGS)

    def put_tagged(self, items: Sequence[tuple[ChunkHash, Payload]], tags: Tags) -> list[bool]:
        """``put``; with ``tags.expires_at`` the keys expire then (SET PX), a salted owner's heads join its set."""
        out = [False] * len(items)
        ttl_ms = self._store_ttl_ms(tags.expires_at)
        if ttl_ms == 0:  # already expired
            return out
        sizes = [payload.nbytes for _, payload in items]
        todo = [i for i, n in enumerate(sizes) if n <= self.max_value_bytes]
        if len(todo) < len(items):
            self._metrics.inc(SKIPPED_STORES, len(items) - len(todo), tier=self.name,
                              reason="too_large")
        if not todo:
            return out
        total = sum(sizes[i] for i in todo)
        deadline = monotonic() + self.config.timeout_s + total / self._rate
        stage = self._buffers.acquire(min(total, max(STAGE_BYTES, max(sizes))))
        try:
            for group in _stages(todo, sizes, stage.nbytes):  # one round trip per stage
                self._put_stage([(i, *items[i]) for i in group], stage, out, deadline, ttl_ms)
        finally:
            self._buffers.release(stage)
        self._index_tenant(tags.tenant, [self._key(items[i][0]) for i in todo if out[i]], deadline)
        return out

    def delete(self, keys: Sequence[ChunkHash]) -> None:
        if keys:
            self._delete(keys, monotonic() + self.config.timeout_s)

    def stats(self) -> TierStats:
        """The servers' figures summed over the primaries; the last complete figures if one does not answer."""
        deadline = monotonic() + self.config.timeout_s
        nodes = self._servers.primaries()
        batches: dict[str, Batch] = {}
        for node in nodes:
            batch = batches[node.name] = Batch(node)
            batch.add("info", b"INFO", b"memory")
            batch.add("dbsize", b"DBSIZE")
        used = capacity = entries = 0
        done = self._servers.run(batches, "stats", deadline)
        if len(done) < len(nodes):
            return self._last_stats
        for batch in done:
            info, dbsize = batch.replies or (None, None)
            if not isinstance(info, bytes) or not isinstance(dbsize, int):
                return self._last_stats
            fields = dict(line.split(b":", 1) for line in info.splitlines() if line.startswith(_STATS_FIELDS))
            used += int(fields.get(b"used_memory", 0))
            capacity += int(fields.get(b"maxmemory", 0)) or int(fields.get(b"total_system_memory", 0))
            entries += dbsize
        self._last_stats = TierStats(used, capacity, entries)
        return self._last_stats

    def close(self) -> None:
        self._servers.close()
        self._buffers.clear()

    # -- keys and commands ---------------------------------------------------------------------------------
    def _key(self, key: ChunkHash) -> bytes:
        return b"%s{%s}" % (self._space, key.hex().encode())

    def _get_cmd(self, key: bytes, ttl_ms: int) -> tuple[bytes, ...]:
        if ttl_ms and self.config.refresh_ttl:
            return b"GETEX", key, b"PX", b"%d" % ttl_ms
        return b"GET", key

    # -- get -----------------------------------------------------------------------------------------------
    def _get(self, keys: Sequence[ChunkHash], taken: list[np.ndarray]) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(keys)
        if not keys:
            return out
        deadline = monotonic() + self.config.timeout_s
        heads = [self._key(key) for key in keys]
        read_head = HeadReader(self._buffers, self.config.max_value_bytes, taken)
        batches: dict[str, Batch] = {}
        for i, head in enumerate(heads):
            self._servers.batch(batches, head).add(i, *self._get_cmd(head, self._ttl_ms), into=read_head)
        splits: dict[int, SplitValue] = {}
        bad: list[ChunkHash] = []
        for batch in self._servers.run(batches, "get", deadline, self._rate):
            for i, reply in zip(batch.tags, batch.replies or ()):
                if isinstance(reply, memoryview):
                    out[i] = reply
                elif isinstance(reply, SplitValue):
                    splits[i] = reply
                elif reply is Unusable.FOREIGN or isinstance(reply, RespError) and reply.code == "WRONGTYPE":
                    bad.append(keys[i])  # not a value of ours (a bad split header, a hash, ...)
                elif isinstance(reply, RespError) and not is_redirect(reply):
                    log.debug("redis tier %s: get: %s", self.name, reply)
        if splits:
            self._get_parts(keys, heads, splits, out, deadline)
        if bad:
            self._metrics.inc(CORRUPT_CHUNKS, len(bad), tier=self.name)
            log.warning("redis tier %s: %d stored value(s) of another format: misses, deleted", self.name, len(bad))
            self._delete(bad, deadline)
        return out

    def _get_parts(self, keys: Sequence[ChunkHash], heads: list[bytes], splits: dict[int, SplitValue],
                   out: list[memoryview | None], deadline: float) -> None:
        """Receive the other parts of the split values whose heads arrived; complete ones go to ``out``."""
        batches: dict[str, Batch] = {}
        for i, value in splits.items():
            if monotonic() > deadline:
                break  # the rest stay misses, not deleted: asking for their parts would only overrun the call
            batch = self._servers.batch(batches, heads[i])
            for p in range(1, value.header.n_parts):
                part_key = value.header.part_key(heads[i], p)
                batch.add(i, *self._get_cmd(part_key, self._part_ttl_ms), into=PartReader(value, p))
        answered: set[int] = set()
        for batch in self._servers.run(batches, "get", deadline, self._rate):
            for i, reply in zip(batch.tags, batch.replies or ()):
                answered.add(i)
                if reply is not True:
                    splits[i].ok = False
        broken = []
        for i, value in splits.items():
            if i not in answered:
                continue  # the server failed: a miss, but the value may be fine
            if value.ok:
                out[i] = value.view
            else:
                broken.append(keys[i])
        if broken:  # a part was evicted or expired: drop the rest so the chunk can be stored again
            self._metrics.inc(INCOMPLETE_VALUES, len(broken), tier=self.name)
            self._delete(broken, deadline)

    # -- put -----------------------------------------------------------------------------------------------
    def _put_stage(self, items: list[tuple[int, ChunkHash, Payload]], stage: np.ndarray, out: list[bool],
                   deadline: float, ttl_ms: int | None = None) -> None:
        """Write, send and confirm one stage of values (they fit in ``stage`` together, or are one value).

        Cleanup (unlinking the parts of values that cannot be used) is sent only once every reply is in, so it
        never races the writes it cleans up after."""
        batches, staged = self._pack_stage(items, stage, ttl_ms)
        cleanup: dict[str, Batch] = {}
        for batch in self._servers.run(batches, "put", deadline):
            self._confirm(batch, staged, out, cleanup)
        for batch in batches.values():
            if batch.error is not None:
                heads = sum(1 for tag in batch.tags if tag.role is Role.HEAD)
                self._metrics.inc(SKIPPED_STORES, heads, tier=self.name, reason="unavailable")
        if cleanup:
            self._servers.run(cleanup, "put", deadline)

    def _pack_stage(self, items: list[tuple[int, ChunkHash, Payload]], stage: np.ndarray,
                    ttl_ms: int | None) -> tuple[dict[str, Batch], dict[int, _Staged]]:
        """Copy each value into ``stage`` and queue its SETs: a split value's parts first, its head last. They
        expire in ``ttl_ms`` (parts a little later), or as the tier's ``ttl_s`` says for None."""
        head_ttl, part_ttl = self._ttl_args, self._part_ttl_args
        if ttl_ms is not None:
            head_ttl, part_ttl = (b"PX", b"%d" % ttl_ms), (b"PX", b"%d" % (ttl_ms + max(60_000, ttl_ms // 10)))
        part_len = self.config.max_part_bytes
        view = memoryview(stage)
        offset = 0
        batches: dict[str, Batch] = {}
        staged: dict[int, _Staged] = {}
        for i, key, payload in items:
            n = payload.nbytes
            value = view[offset : offset + n]
            offset += n
            payload.write_into(value)
            head = self._key(key)
            batch = self._servers.batch(batches, head)
            if n <= part_len:
                staged[i] = _Staged(head, n, [])
                batch.add(_Write(Role.HEAD, i), b"SET", head, value, b"NX", *head_ttl)
                continue
            header = SplitHeader.new(n, part_len)
            staged[i] = _Staged(head, n, header.part_keys(head))
            for p, part_key in enumerate(staged[i].part_keys, start=1):
                batch.add(_Write(Role.PART, i), b"SET", part_key, value[header.part_range(p)], *part_ttl)
            batch.add(_Write(Role.HEAD, i), b"SET", head, (header.pack(), value[:part_len]), b"NX", *head_ttl)
        return batches, staged

    def _confirm(self, batch: Batch, staged: dict[int, _Staged], out: list[bool], cleanup: dict[str, Batch]) -> None:
        """Read one batch's SET replies: mark the values now stored, queue unlinks of unusable pieces."""
        refused: set[int] = set()
        for tag, reply in zip(batch.tags, batch.replies or ()):
            i = tag.index
            if isinstance(reply, RespError):
                refused.add(i)
                log.debug("redis tier %s: put refused: %s", self.name, reply)
                if tag.role is Role.HEAD:
                    self._metrics.inc(SKIPPED_STORES, tier=self.name, reason="refused")
                continue
            if tag.role is Role.PART:
                continue
            value = staged[i]
            ours = reply == b"OK"  # else nil: another writer's complete value is already there
            if i in refused:  # a part was refused (e.g. OOM), and parts come before their head: unusable
                self._metrics.inc(SKIPPED_STORES, tier=self.name, reason="refused")
                self._servers.batch(cleanup, value.head).add(i, b"UNLINK", *([value.head] if ours else []),
                                                            *value.part_keys)
                continue
            out[i] = True
            if ours:
                self._metrics.inc(WRITTEN_BYTES, value.nbytes, tier=self.name)
            elif value.part_keys:  # lost the race to another writer: our parts are orphans
                self._servers.batch(cleanup, value.head).add(i, b"UNLINK", *value.part_keys)

    # -- delete --------------------------------------------------------------------------------------------
    def _delete(self, keys: Sequence[ChunkHash], deadline: float) -> None:
        """Read each head's first bytes (a split header names its parts), then unlink head and parts."""
        heads = [self._key(key) for key in keys]
        batches: dict[str, Batch] = {}
        for head in heads:
            self._servers.batch(batches, head).add(head, b"GETRANGE", head, b"0", b"%d" % (HEADER_BYTES - 1))
        doomed: dict[str, Batch] = {}
        for batch in self._servers.run(batches, "delete", deadline):
            for head, reply in zip(batch.tags, batch.replies or ()):
                parts = part_keys_of(head, reply) if isinstance(reply, bytes) else []
                self._servers.batch(doomed, head).add(head, b"UNLINK", head, *parts)
        self._servers.run(doomed, "delete", deadline)
