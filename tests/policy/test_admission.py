"""Admission policies: every one passes the conformance suite; second-hit and the rate cap keep their promises."""

from __future__ import annotations

import pytest

from kvtier.base.errors import ConfigError
from kvtier.policy.admission import (
    AdmissionSettings,
    AlwaysAdmit,
    RateCapped,
    Refusal,
    SecondHit,
    WriteSource,
    make_admission,
)
from kvtier.tiers import DiskTierConfig, MemoryTierConfig
from tests.conformance.admission_suite import AdmissionConformance, key


class TestAlways(AdmissionConformance):
    name = "always"


class TestSecondHit(AdmissionConformance):
    name = "second-hit"


def test_second_hit_refuses_a_first_sighting_and_admits_the_second():
    policy = SecondHit(AdmissionSettings("second-hit", sketch_chunks=1024))
    keys = [key(i) for i in range(100)]
    policy.seen(keys)
    assert policy.admit(keys, [1] * 100, WriteSource.STORE) == [Refusal.UNSEEN] * 100
    policy.seen(keys[:40])
    assert policy.admit(keys, [1] * 100, WriteSource.STORE) == [None] * 40 + [Refusal.UNSEEN] * 60


def test_second_hit_demotes_only_what_was_reused_above():
    """An eviction is not a sighting: a chunk stored once and evicted is dropped, one hit since is kept."""
    policy = SecondHit(AdmissionSettings("second-hit", sketch_chunks=1024))
    once, reused = key(1), key(2)
    policy.seen([once, reused])  # both stored into the tier above
    policy.seen([reused])  # a hit
    assert policy.admit([once, reused], [1, 1], WriteSource.DEMOTE) == [Refusal.UNSEEN, None]
    assert policy.admit([once], [1], WriteSource.DEMOTE) == [Refusal.UNSEEN]  # asking is not a sighting


def test_second_hit_rarely_mistakes_a_stranger_for_a_regular():
    """False positives (documented in the module): a full window of one-shot keys lets almost none through."""
    policy = SecondHit(AdmissionSettings("second-hit", sketch_chunks=1024))
    seen = [key(i) for i in range(1024)]
    policy.seen(seen)
    strangers = [key(100_000 + i) for i in range(5000)]
    assert policy.admit(strangers, [1] * 5000, WriteSource.STORE).count(None) <= 5
    assert policy.nbytes == 256 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_cap_refuses_over_the_rate_and_refills_with_time():
    clock = Clock()
    policy = RateCapped(AlwaysAdmit(), rate=1000, burst=1000, clock=clock)
    keys = [key(i) for i in range(10)]
    first = policy.admit(keys, [250] * 10, WriteSource.STORE)
    assert first == [None] * 4 + [Refusal.RATE] * 6  # the burst: 1000 bytes
    assert policy.admit(keys, [250] * 10, WriteSource.STORE) == [Refusal.RATE] * 10  # no time passed
    clock.now += 0.5  # 500 bytes more
    assert policy.admit(keys, [250] * 10, WriteSource.STORE).count(None) == 2
    clock.now += 3600  # a long quiet spell saves up only the burst
    assert policy.admit(keys, [250] * 10, WriteSource.STORE).count(None) == 4


def test_rate_cap_over_a_long_run_stays_near_the_rate():
    clock = Clock()
    policy = RateCapped(AlwaysAdmit(), rate=10_000, clock=clock)
    admitted = 0
    for step in range(1000):  # 100 s, offering 10x the rate
        clock.now += 0.1
        verdicts = policy.admit([key(step)] * 10, [1000] * 10, WriteSource.STORE)
        admitted += 1000 * verdicts.count(None)
    assert 100 * 10_000 <= admitted <= 100 * 10_000 + 10_000 + 1000  # rate x time, + burst, + one entry


def test_rate_cap_does_not_charge_what_the_inner_policy_refused():
    clock = Clock()
    policy = RateCapped(SecondHit(AdmissionSettings("second-hit", sketch_chunks=64)), rate=100, burst=100, clock=clock)
    policy.seen([key(1)])
    assert policy.admit([key(1)], [10**6], WriteSource.STORE) == [Refusal.UNSEEN]
    assert policy.admit([key(2)], [50], WriteSource.PROMOTE) == [None]  # the bucket is still full


def test_make_admission_wraps_a_cap_and_settings_are_checked():
    assert isinstance(make_admission(AdmissionSettings("second-hit")), SecondHit)
    assert isinstance(make_admission(AdmissionSettings("always", max_bytes_per_s=10)), RateCapped)
    for bad in ({"policy": "third-hit"}, {"max_bytes_per_s": 0}, {"sketch_chunks": 0}, {"burst_bytes": -1}):
        with pytest.raises(ConfigError):
            AdmissionSettings(**bad)


def test_tier_configs_take_admission_options(tmp_path):
    config = MemoryTierConfig(admission="second-hit", admission_max_bytes_per_s=2**20)
    assert config.admission_settings() == AdmissionSettings("second-hit", max_bytes_per_s=2**20)
    assert config.admission_settings(first=True).policy == "second-hit"  # named: wherever the tier sits
    assert MemoryTierConfig().admission_settings().policy == "always"
    disk = DiskTierConfig(path=tmp_path)
    assert disk.admission_settings().policy == "second-hit"  # the default below a faster tier
    assert disk.admission_settings(first=True).policy == "always"  # a cache's first tier admits everything
    with pytest.raises(ConfigError, match="admission policy"):
        MemoryTierConfig(admission="sometimes")
