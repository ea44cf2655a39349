"""The network tiers' configs share their common fields and checks through RemoteTierConfig."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.base.errors import ConfigError
from kvtier.tiers import TierConfig
from kvtier.tiers.mooncake.config import MooncakeTierConfig
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.remote import RemoteTierConfig

SHARED = ("key_prefix", "timeout_s", "connect_timeout_s", "min_rate_bytes", "max_value_bytes", "breaker_failures",
          "breaker_cooldown_s")
CONFIGS = [RedisTierConfig, MooncakeTierConfig]


@pytest.mark.parametrize("cls", CONFIGS)
def test_both_configs_take_the_shared_fields_from_the_base(cls):
    assert issubclass(cls, RemoteTierConfig)
    assert set(SHARED) <= {f.name for f in dataclasses.fields(cls)}
    every_tier = {f.name for f in dataclasses.fields(TierConfig)}  # codec, write, admission ...
    assert {f.name for f in dataclasses.fields(RemoteTierConfig)} - every_tier == set(SHARED)


def test_each_keeps_its_own_defaults():
    redis, mooncake = RedisTierConfig(), MooncakeTierConfig()
    assert (redis.timeout_s, redis.connect_timeout_s) == (0.5, 0.5)
    assert (mooncake.timeout_s, mooncake.connect_timeout_s) == (1.0, 5.0)
    for field in ("key_prefix", "min_rate_bytes", "max_value_bytes", "breaker_failures", "breaker_cooldown_s"):
        assert getattr(redis, field) == getattr(mooncake, field)
    assert (redis.key_prefix, redis.max_value_bytes, redis.breaker_failures) == ("kvtier:", 1 << 30, 3)


@pytest.mark.parametrize("cls", CONFIGS)
@pytest.mark.parametrize("bad", [
    {"key_prefix": "a b"}, {"key_prefix": "tab\t"}, {"key_prefix": "x" * 129}, {"timeout_s": 0},
    {"connect_timeout_s": -1}, {"breaker_cooldown_s": 0}, {"breaker_failures": 0}, {"min_rate_bytes": 0},
    {"max_value_bytes": 0},
])
def test_the_shared_checks_hold_for_both(cls, bad):
    with pytest.raises(ConfigError, match=cls.kind):
        cls(**bad)


def test_redis_alone_refuses_braces_in_its_prefix():
    with pytest.raises(ConfigError, match="braces"):
        RedisTierConfig(key_prefix="a{b}")
    assert MooncakeTierConfig(key_prefix="a{b}").key_prefix == "a{b}"
    assert RedisTierConfig(key_prefix="x" * 128).key_prefix == "x" * 128
