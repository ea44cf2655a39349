"""What the configs of network tiers share: a tier whose entries live in a store that replicas reach over the
network (Redis, Mooncake) names its keys, bounds its calls and values and trips a circuit breaker alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtier.base.errors import ConfigError
from kvtier.tiers.base import TierConfig

MiB = 1 << 20


@dataclass(frozen=True)
class RemoteTierConfig(TierConfig):
    """Base of the network tiers' configs: the fields and checks they share.

    ``key_prefix``: begins every key the tier writes (at most 128 characters, none of them whitespace or in
    ``prefix_forbids``); ``timeout_s``: how long one call may take; ``connect_timeout_s``: how long
    connecting may take; ``min_rate_bytes``: per second, big transfers get this much extra time;
    ``max_value_bytes``: the largest value stored; ``breaker_failures``: failures in a row that open the
    circuit breaker, for ``breaker_cooldown_s``. Each check's ConfigError names the tier's ``kind``.
    """

    #: Characters a key prefix must not hold besides whitespace, and how the error names them.
    prefix_forbids: ClassVar[tuple[str, str]] = ("", "spaces")

    key_prefix: str = "kvtier:"
    timeout_s: float = 1.0
    connect_timeout_s: float = 5.0
    min_rate_bytes: int = 64 * MiB  #: per second; big transfers get this much extra time
    max_value_bytes: int = 1024 * MiB
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        forbidden, named = self.prefix_forbids
        if any(c in self.key_prefix for c in forbidden + " \t\r\n") or len(self.key_prefix) > 128:
            raise ConfigError(f"{self.kind} key_prefix {self.key_prefix!r} must be short and free of {named}")
        if not (self.timeout_s > 0 and self.connect_timeout_s > 0 and self.breaker_cooldown_s > 0):
            raise ConfigError(f"{self.kind} timeouts and breaker_cooldown_s must be positive")
        if min(self.breaker_failures, self.min_rate_bytes, self.max_value_bytes) < 1:
            raise ConfigError(f"{self.kind} breaker_failures, min_rate_bytes and max_value_bytes must be >= 1")
