"""Shared tier on Redis or Valkey: one prefix cache for many engine replicas.

Keys
    ``<key_prefix><codec>:{<chunk hash hex>}``, e.g. ``kvtier:raw:{3fa2...}``. The chunk hash already covers the
    model, KV spec, chunk size, TP rank, adapter and tenant salt, so replicas of one model share entries and
    nothing else does; the codec in the key keeps two codecs from reading each other's entries. The braces are
    a Redis Cluster hash tag: a value's parts live in its head's slot, so they travel on one connection.

Values
    The sealed, checksummed blob (blob.py). KVCache verifies every read against the chunk key and token ids,
    so a planted, truncated, foreign or older-format value is a miss (and is deleted). A blob larger than
    ``max_part_bytes`` is split so that no single command moves more than that: parts
    ``<head key>:<nonce>:<i>`` are written first, then the head (a 32-byte split header plus part 0) last,
    on the same connection, with ``SET NX``. A reader therefore sees the head only once every part exists,
    parts of concurrent writers never mix (each write has its own nonce), and a value with a part missing
    (evicted, expired) is a miss that is cleaned up. Largest value: ``max_value_bytes`` (default 1 GiB);
    largest single command: ``max_part_bytes`` (default 8 MiB, at most 512 MiB, Redis's proto-max-bulk-len).

Capacity
    Left to the server: set ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (see README). The tier does not
    evict; ``stats()`` reports the server's ``used_memory``, its ``maxmemory`` (or its host's memory when it has
    none) and its key count (split values count once per part), summed over a cluster's primaries.

Failures
    Every call has one deadline: ``timeout_s``, plus ``1 / min_rate_bytes`` seconds per byte of value moved.
    A dead, slow or resetting server gives misses and skipped stores (``kvtier_tier_errors_total``,
    ``kvtier_skipped_stores_total``); ``breaker_failures`` consecutive failures of one server open its circuit
    breaker, after which requests skip it at once while a background thread probes it every
    ``breaker_cooldown_s`` and closes the breaker when it answers. With Redis Cluster each primary has its own
    pool and breaker, and one pipeline per primary is sent per call.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import numpy as np

from kvtier.codecs import Payload, get_codec
from kvtier.errors import ConfigError
from kvtier.keys import ChunkHash
from kvtier.metrics import Metrics
from kvtier.tiers.redis import pipeline as net
from kvtier.tiers.base import TierConfig, TierContext, TierStats, register_tier
from kvtier.net.buffers import BufferPool
from kvtier.tiers.redis.servers import Servers
from kvtier.tiers.redis.resp import Reader, RespError

log = logging.getLogger(__name__)

MiB = 1 << 20
#: Redis's default proto-max-bulk-len: no single argument may be larger.
REDIS_MAX_BULK = 512 * MiB
SPLIT_MAGIC = b"KVTS"
SPLIT_VERSION = 1
_SPLIT = struct.Struct("<4sHH8sQII")  # magic, version, reserved, nonce, total length, part length, part count
assert _SPLIT.size == 32
#: A put stages at most this many bytes of values before sending them (one round trip per stage).
STAGE_BYTES = 64 * MiB
_STATS_FIELDS = (b"used_memory:", b"maxmemory:", b"total_system_memory:")


@register_tier
@dataclass(frozen=True)
class RedisTierConfig(TierConfig):
    """A Redis/Valkey server or cluster shared by every replica pointed at it (see the module docstring).

    ``url``: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or ``unix:///path.sock?db=0``.
    ``username``/``password`` override the URL's (handy as ``KVTIER_REDIS_PASSWORD``). ``tls_*``: CA bundle,
    client certificate and key for ``rediss://``. ``ttl_s``: expire entries this long after their last
    write (and, with ``refresh_ttl``, their last read); None keeps them until the server evicts them.
    """

    kind = "redis"
    url: str = field(default="redis://localhost:6379/0", repr=False)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    key_prefix: str = "kvtier:"
    cluster: bool = False
    timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    min_rate_bytes: int = 64 * MiB  #: per second; big transfers get this much extra time
    pool_size: int = 8  #: connections per server
    ttl_s: float | None = None
    refresh_ttl: bool = True
    max_part_bytes: int = 8 * MiB
    max_value_bytes: int = 1024 * MiB
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0
    buffer_pool_bytes: int = 1024 * MiB  #: idle receive/staging buffers kept for reuse
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("redis url must start with redis://, rediss:// or unix://")
        if any(c in self.key_prefix for c in "{} \t\r\n") or len(self.key_prefix) > 128:
            raise ConfigError(f"redis key_prefix {self.key_prefix!r} must be short and free of braces/spaces")
        if not (self.timeout_s > 0 and self.connect_timeout_s > 0 and self.breaker_cooldown_s > 0):
            raise ConfigError("redis timeouts and breaker_cooldown_s must be positive")
        if self.pool_size < 1 or self.breaker_failures < 1 or self.min_rate_bytes < 1:
            raise ConfigError("redis pool_size, breaker_failures and min_rate_bytes must be >= 1")
        if not 4096 <= self.max_part_bytes <= REDIS_MAX_BULK - _SPLIT.size:
            raise ConfigError(f"redis max_part_bytes must lie in [4096, {REDIS_MAX_BULK - _SPLIT.size}]")
        if self.max_value_bytes < 1 or (self.ttl_s is not None and self.ttl_s < 0):
            raise ConfigError("redis max_value_bytes must be positive and ttl_s not negative")

    def build(self, ctx: TierContext) -> RedisTier:
        return RedisTier(self, metrics=ctx.metrics, name=ctx.name)


class _Split:
    """A split value being received: its assembled bytes and where its parts come from."""

    __slots__ = ("n_parts", "nonce", "ok", "part_len", "view")

    def __init__(self, view: memoryview, nonce: bytes, part_len: int, n_parts: int) -> None:
        self.view, self.nonce, self.part_len, self.n_parts, self.ok = view, nonce, part_len, n_parts, True


_BAD = object()  # a reply that is not a value of ours: a miss, and deleted
_TOO_BIG = object()  # a value larger than max_value_bytes: a miss, left for replicas that accept it


class RedisTier:
    verifies = True

    def __init__(self, config: RedisTierConfig, *, metrics: Metrics | None = None, name: str = "redis") -> None:
        self.name = name
        self.config = config
        self.codec = get_codec(config.codec)
        self._metrics = metrics if metrics is not None else Metrics()
        self._prefix = f"{config.key_prefix}{self.codec.name}:".encode()
        self._ttl_ms = int(config.ttl_s * 1000) if config.ttl_s else 0
        # parts outlive their head a little, so a head never points at parts that already expired
        self._part_ttl_ms = self._ttl_ms + max(60_000, self._ttl_ms // 10) if self._ttl_ms else 0
        self._rate = float(config.min_rate_bytes)
        self._buffers = BufferPool(config.buffer_pool_bytes)
        conn_class, conn_kwargs = net.connection_kwargs(config.url, {
            "username": config.username, "password": config.password,
            "ssl_ca_certs": config.tls_ca_file, "ssl_certfile": config.tls_cert_file,
            "ssl_keyfile": config.tls_key_file,
            "protocol": 2, "health_check_interval": 0,
        })
        self._servers = Servers(
            conn_class, conn_kwargs, cluster=config.cluster, pool_size=config.pool_size, timeout_s=config.timeout_s,
            connect_timeout_s=config.connect_timeout_s, breaker_failures=config.breaker_failures,
            breaker_cooldown_s=config.breaker_cooldown_s, metrics=self._metrics, name=name)
        self._last_stats = TierStats(0, 0, 0)

    # -- the Tier protocol ---------------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkHash]) -> list[bool]:
        out = [False] * len(keys)
        if not keys:
            return out
        batches: dict[str, net.Batch] = {}
        for node, (idx, heads) in self._servers.group([self._key(key) for key in keys]).items():
            batches[node.name] = batch = net.Batch(node)
            batch.add_exists(idx, heads)
        for batch in self._servers.run(batches, "contains", monotonic() + self.config.timeout_s):
            for i, reply in zip(batch.tags, batch.replies or ()):
                out[i] = reply == 1
        return out

    @contextmanager
    def get(self, keys: Sequence[ChunkHash]) -> Iterator[list[memoryview | None]]:
        taken: list[np.ndarray] = []
        try:
            yield self._get(keys, taken)
        finally:
            for buf in taken:
                self._buffers.give(buf)

    def put(self, items: Sequence[tuple[ChunkHash, Payload]]) -> list[bool]:
        out = [False] * len(items)
        sizes = [payload.nbytes for _, payload in items]
        todo = []
        for i, n in enumerate(sizes):
            if n > self.config.max_value_bytes:
                self._metrics.inc("kvtier_skipped_stores_total", tier=self.name, reason="too_large")
            else:
                todo.append(i)
        if not todo:
            return out
        deadline = monotonic() + self.config.timeout_s + sum(sizes[i] for i in todo) / self._rate
        stage = self._buffers.take(min(sum(sizes[i] for i in todo), max(STAGE_BYTES, max(sizes))))
        try:
            start = 0
            while start < len(todo):  # one round trip per stage of at most STAGE_BYTES (or one value)
                end, used = start, 0
                while end < len(todo) and (end == start or used + sizes[todo[end]] <= stage.nbytes):
                    used += sizes[todo[end]]
                    end += 1
                self._put_stage([(i, *items[i]) for i in todo[start:end]], stage, out, deadline)
                start = end
        finally:
            self._buffers.give(stage)
        return out

    def delete(self, keys: Sequence[ChunkHash]) -> None:
        if keys:
            self._delete(keys, monotonic() + self.config.timeout_s)

    def _delete(self, keys: Sequence[ChunkHash], deadline: float) -> None:
        """Read each head's first bytes (a split header names its parts), then unlink head and parts."""
        heads = [self._key(key) for key in keys]
        batches: dict[str, net.Batch] = {}
        for head in heads:
            self._servers.batch(batches, head).add(head, b"GETRANGE", head, b"0", b"%d" % (_SPLIT.size - 1))
        doomed: dict[str, net.Batch] = {}
        for batch in self._servers.run(batches, "delete", deadline):
            for head, reply in zip(batch.tags, batch.replies or ()):
                parts = self._part_keys(head, reply) if isinstance(reply, bytes) else []
                self._servers.batch(doomed, head).add(head, b"UNLINK", head, *parts)
        self._servers.run(doomed, "delete", deadline)

    def stats(self) -> TierStats:
        deadline = monotonic() + self.config.timeout_s
        nodes = self._servers.primaries()
        batches: dict[str, net.Batch] = {}
        for node in nodes:
            batch = batches[node.name] = net.Batch(node)
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

    # -- keys -----------------------------------------------------------------------------------------
    def _key(self, key: ChunkHash) -> bytes:
        return b"%s{%s}" % (self._prefix, key.hex().encode())

    @staticmethod
    def _part_key(head: bytes, nonce: bytes, i: int) -> bytes:
        return b"%s:%s:%d" % (head, nonce.hex().encode(), i)

    def _part_keys(self, head: bytes, header: bytes) -> list[bytes]:
        parsed = self._parse_split(header)
        if parsed is None:
            return []
        nonce, _total, _part_len, n_parts = parsed
        return [self._part_key(head, nonce, i) for i in range(1, n_parts)]

    def _parse_split(self, header: bytes) -> tuple[bytes, int, int, int] | None:
        if len(header) < _SPLIT.size or header[:4] != SPLIT_MAGIC:
            return None
        _magic, version, _reserved, nonce, total, part_len, n_parts = _SPLIT.unpack_from(header)
        if version != SPLIT_VERSION or not 0 < part_len < total or part_len > REDIS_MAX_BULK - _SPLIT.size:
            return None
        if n_parts != -(-total // part_len):
            return None
        return nonce, total, part_len, n_parts

    # -- get -----------------------------------------------------------------------------------------------
    def _get(self, keys: Sequence[ChunkHash], taken: list[np.ndarray]) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(keys)
        if not keys:
            return out
        deadline = monotonic() + self.config.timeout_s
        heads = [self._key(key) for key in keys]
        read_head = self._head_reader(taken)
        batches: dict[str, net.Batch] = {}
        for i, head in enumerate(heads):
            self._servers.batch(batches, head).add(i, *self._get_cmd(head, self._ttl_ms), into=read_head)
        splits: dict[int, _Split] = {}
        bad: list[ChunkHash] = []
        for batch in self._servers.run(batches, "get", deadline, self._rate):
            for i, reply in zip(batch.tags, batch.replies or ()):
                if isinstance(reply, memoryview):
                    out[i] = reply
                elif isinstance(reply, _Split):
                    splits[i] = reply
                elif reply is _BAD or isinstance(reply, RespError) and reply.code == "WRONGTYPE":
                    bad.append(keys[i])  # not a value of ours (a bad split header, a hash, ...)
                elif isinstance(reply, RespError) and not net.is_redirect(reply):
                    log.debug("redis tier %s: get: %s", self.name, reply)
        if splits:
            self._get_parts(keys, heads, splits, out, deadline)
        if bad:
            self._metrics.inc("kvtier_corrupt_chunks_total", len(bad), tier=self.name)
            log.warning("redis tier %s: %d stored value(s) of another format: misses, deleted", self.name, len(bad))
            self._delete(bad, deadline)
        return out

    def _get_cmd(self, key: bytes, ttl_ms: int) -> tuple[bytes, ...]:
        if ttl_ms and self.config.refresh_ttl:
            return b"GETEX", key, b"PX", b"%d" % ttl_ms
        return b"GET", key

    def _head_reader(self, taken: list[np.ndarray]) -> Any:
        """The ``Into`` for heads: a plain value lands in a pooled buffer; a split head's part 0 lands at the
        start of a buffer sized for the whole value, which its other parts fill later."""
        max_value = self.config.max_value_bytes
        take = self._buffers.take

        def read_head(n: int, reader: Reader) -> Any:
            if n > _SPLIT.size and reader.peek(4) == SPLIT_MAGIC:
                parsed = self._parse_split(reader.peek(_SPLIT.size))
                if parsed is None or n != _SPLIT.size + parsed[2]:
                    reader.skip(n)
                    return _BAD
                nonce, total, part_len, n_parts = parsed
                if total > max_value:  # valid, but more than this replica accepts: a miss, left in place
                    reader.skip(n)
                    return _TOO_BIG
                buf = take(total)
                taken.append(buf)
                view = memoryview(buf)[:total]
                reader.skip(_SPLIT.size)
                reader.read_into(view[:part_len])
                return _Split(view, nonce, part_len, n_parts)
            if n > max_value:
                reader.skip(n)
                return _TOO_BIG
            buf = take(n)
            taken.append(buf)
            view = memoryview(buf)[:n]
            reader.read_into(view)
            return view

        return read_head

    def _get_parts(self, keys: Sequence[ChunkHash], heads: list[bytes], splits: dict[int, _Split],
                   out: list[memoryview | None], deadline: float) -> None:
        batches: dict[str, net.Batch] = {}
        for i, split in splits.items():
            batch = self._servers.batch(batches, heads[i])
            total = split.view.nbytes
            for p in range(1, split.n_parts):
                start = p * split.part_len
                target = split.view[start : min(start + split.part_len, total)]
                batch.add(i, *self._get_cmd(self._part_key(heads[i], split.nonce, p), self._part_ttl_ms),
                          into=self._part_reader(target, split))
        answered: set[int] = set()
        for batch in self._servers.run(batches, "get", deadline, self._rate):
            for i, reply in zip(batch.tags, batch.replies or ()):
                answered.add(i)
                if reply is not True:
                    splits[i].ok = False
        broken = []
        for i, split in splits.items():
            if i not in answered:
                continue  # the server failed: a miss, but the value may be fine
            if split.ok:
                out[i] = split.view
            else:
                broken.append(keys[i])
        if broken:  # a part was evicted or expired: drop the rest so the chunk can be stored again
            self._metrics.inc("kvtier_incomplete_values_total", len(broken), tier=self.name)
            self._delete(broken, deadline)

    @staticmethod
    def _part_reader(target: memoryview, split: _Split) -> Any:
        def read_part(n: int, reader: Reader) -> bool:
            if n != target.nbytes or not split.ok:
                reader.skip(n)
                return False
            reader.read_into(target)
            return True

        return read_part

    # -- put -----------------------------------------------------------------------------------------------
    def _put_stage(self, items: list[tuple[int, ChunkHash, Payload]], stage: np.ndarray, out: list[bool],
                   deadline: float) -> None:
        """Write, send and confirm one stage of values (they fit in ``stage`` together, or are one value)."""
        part_len = self.config.max_part_bytes
        ttl = (b"PX", b"%d" % self._ttl_ms) if self._ttl_ms else ()
        part_ttl = (b"PX", b"%d" % self._part_ttl_ms) if self._part_ttl_ms else ()
        view = memoryview(stage)
        offset = 0
        batches: dict[str, net.Batch] = {}
        parts_of: dict[int, list[bytes]] = {}
        sizes: dict[int, int] = {}
        for i, key, payload in items:
            n = sizes[i] = payload.nbytes
            value = view[offset : offset + n]
            offset += n
            payload.write_into(value)
            head = self._key(key)
            batch = self._servers.batch(batches, head)
            if n <= part_len:
                batch.add(("head", i, head), b"SET", head, value, b"NX", *ttl)
                continue
            nonce = os.urandom(8)
            n_parts = -(-n // part_len)
            parts_of[i] = [self._part_key(head, nonce, p) for p in range(1, n_parts)]
            for p, part_key in enumerate(parts_of[i], start=1):  # the parts first ...
                batch.add(("part", i, head), b"SET", part_key, value[p * part_len : (p + 1) * part_len], *part_ttl)
            header = _SPLIT.pack(SPLIT_MAGIC, SPLIT_VERSION, 0, nonce, n, part_len, n_parts)
            batch.add(("head", i, head), b"SET", head, (header, value[:part_len]), b"NX", *ttl)  # ... the head last
        cleanup: dict[str, net.Batch] = {}
        for batch in self._servers.run(batches, "put", deadline):
            refused: set[int] = set()
            for (what, i, head), reply in zip(batch.tags, batch.replies or ()):
                if isinstance(reply, RespError):
                    refused.add(i)
                    log.debug("redis tier %s: put refused: %s", self.name, reply)
                    if what == "head":
                        self._metrics.inc("kvtier_skipped_stores_total", tier=self.name, reason="refused")
                    continue
                if what != "head":
                    continue
                ours = reply == b"OK"  # else nil: another writer's complete value is already there
                if i in refused:  # a part was refused (e.g. OOM): the value is unusable
                    self._metrics.inc("kvtier_skipped_stores_total", tier=self.name, reason="refused")
                    cleanup_keys = ([head] if ours else []) + parts_of.get(i, [])
                    self._servers.batch(cleanup, head).add(i, b"UNLINK", *cleanup_keys)
                    continue
                out[i] = True
                if ours:
                    self._metrics.inc("kvtier_written_bytes_total", sizes[i], tier=self.name)
                elif i in parts_of:  # lost the race to another writer: our parts are orphans
                    self._servers.batch(cleanup, head).add(i, b"UNLINK", *parts_of[i])
        for batch in batches.values():
            if batch.error is not None:
                heads = sum(1 for what, _i, _h in batch.tags if what == "head")
                self._metrics.inc("kvtier_skipped_stores_total", heads, tier=self.name, reason="unavailable")
        if cleanup:
            self._servers.run(cleanup, "put", deadline)

