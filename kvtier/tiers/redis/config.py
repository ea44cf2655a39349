"""The Redis tier's config: which server or cluster, how to reach it, how long to wait, how values are cut."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.base.errors import ConfigError
from kvtier.tiers.base import TierConfig
from kvtier.tiers.redis.limits import HEADER_BYTES, MIN_PART_BYTES, REDIS_MAX_BULK

MiB = 1 << 20


@dataclass(frozen=True)
class RedisTierConfig(TierConfig):
    """A Redis/Valkey server or cluster shared by every replica pointed at it (see tier.py).

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
    max_value_bytes: int = 1024 * MiB  #: and at most split.MAX_PARTS parts of max_part_bytes
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
        if not MIN_PART_BYTES <= self.max_part_bytes <= REDIS_MAX_BULK - HEADER_BYTES:
            largest = REDIS_MAX_BULK - HEADER_BYTES
            raise ConfigError(f"redis max_part_bytes must lie in [{MIN_PART_BYTES}, {largest}]")
        if self.max_value_bytes < 1 or (self.ttl_s is not None and self.ttl_s < 0):
            raise ConfigError("redis max_value_bytes must be positive and ttl_s not negative")
