"""The Redis tier's config: which server or cluster, how to reach it, how long to wait, how values are cut."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvtier.base.errors import ConfigError
from kvtier.tiers.control import MAX_TTL_S
from kvtier.tiers.redis.limits import HEADER_BYTES, MIN_PART_BYTES, REDIS_MAX_BULK
from kvtier.tiers.remote import MiB, RemoteTierConfig


@dataclass(frozen=True)
class RedisTierConfig(RemoteTierConfig):
    """A Redis/Valkey server or cluster shared by every replica pointed at it (see tier.py).

    ``url``: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or ``unix:///path.sock?db=0``.
    ``username``/``password`` override the URL's (handy as ``KVTIER_REDIS_PASSWORD``). ``tls_*``: CA bundle,
    client certificate and key for ``rediss://``. ``ttl_s``: expire entries this long after their last
    write (and, with ``refresh_ttl``, their last read); None keeps them until the server evicts them.
    ``max_part_bytes``: values larger than this are split into parts (split.py), so a value is stored only
    within ``max_value_bytes`` and at most split.MAX_PARTS parts. ``pin_budget_bytes``: the most bytes pins may
    hold, every replica's pins together (None: a quarter of the server's maxmemory; pins and what Redis still
    evicts: control.py). Key prefix, deadlines and circuit breaker: RemoteTierConfig.
    """

    kind = "redis"
    #: Braces would make a cluster hash the prefix, not the key (RemoteTierConfig has the shared fields).
    prefix_forbids: ClassVar[tuple[str, str]] = ("{}", "braces/spaces")
    url: str = field(default="redis://localhost:6379/0", repr=False)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    cluster: bool = False
    timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    pool_size: int = 8  #: connections per server
    ttl_s: float | None = None
    refresh_ttl: bool = True
    max_part_bytes: int = 8 * MiB
    buffer_pool_bytes: int = 1024 * MiB  #: idle receive/staging buffers kept for reuse
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    pin_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("redis url must start with redis://, rediss:// or unix://")
        if self.pool_size < 1:
            raise ConfigError("redis pool_size must be >= 1")
        if not MIN_PART_BYTES <= self.max_part_bytes <= REDIS_MAX_BULK - HEADER_BYTES:
            largest = REDIS_MAX_BULK - HEADER_BYTES
            raise ConfigError(f"redis max_part_bytes must lie in [{MIN_PART_BYTES}, {largest}]")
        if self.pin_budget_bytes is not None and self.pin_budget_bytes < 0:
            raise ConfigError("redis pin_budget_bytes must not be negative")
        if self.ttl_s is not None and not 0 <= self.ttl_s <= MAX_TTL_S:
            raise ConfigError(f"redis ttl_s must be a number of seconds from 0 to {MAX_TTL_S}")
