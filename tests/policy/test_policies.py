"""Every policy passes the conformance suite; each keeps the promise it is chosen for."""

from __future__ import annotations

import pytest

from kvtier.base.errors import ConfigError
from kvtier.policy import POLICIES, EvictionPolicy, make_policy
from tests.conformance.policy_suite import PolicyConformance, key


class TestLRU(PolicyConformance):
    name = "lru"


class TestS3FIFO(PolicyConformance):
    name = "s3fifo"


class TestARC(PolicyConformance):
    name = "arc"


class TestARCLFU(PolicyConformance):
    name = "arc-lfu"


class TestTinyLFU(PolicyConformance):
    name = "tinylfu"


def test_every_registered_policy_has_a_conformance_class():
    tested = {cls.name for cls in PolicyConformance.__subclasses__()}
    assert tested == set(POLICIES)


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown eviction policy 'mru'"):
        make_policy("mru")


class Tier:
    """A tier of ``capacity`` equal-sized entries around a policy, for behaviour tests."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy, self.capacity, self.held = policy, capacity, set()

    def use(self, i: int) -> bool:
        """Read key ``i`` if held (True), else store it, evicting as needed (False)."""
        k = key(i)
        if k in self.held:
            self.policy.on_access(k)
            return True
        while len(self.held) >= self.capacity:
            victim = self.policy.victim(lambda x: True)
            self.held.remove(victim)
            self.policy.on_remove(victim)
        self.held.add(k)
        self.policy.on_insert(k)
        return False


def hot_set_after_scan(name: str) -> int:
    """How many of 20 keys used three times each survive a scan of 200 keys used once, in a tier of 50."""
    tier = Tier(make_policy(name), 50)
    for _ in range(3):
        for i in range(20):
            tier.use(i)
    for i in range(1000, 1200):
        tier.use(i)
    return sum(key(i) in tier.held for i in range(20))


def test_lru_loses_a_hot_set_to_a_scan():
    assert hot_set_after_scan("lru") == 0


@pytest.mark.parametrize("name", ["s3fifo", "arc", "arc-lfu", "tinylfu"])
def test_frequency_aware_policies_keep_a_hot_set_through_a_scan(name):
    assert hot_set_after_scan(name) == 20


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc", "arc-lfu"])
def test_recency_workload_hits_like_lru(name):
    """A working set that fits and drifts slowly: nothing beats recency, and none of these lags it much."""
    tier = Tier(make_policy(name), 100)
    hits = sum(tier.use(i // 10 + (i % 10) * 7) for i in range(5000))
    lru = Tier(make_policy("lru"), 100)
    lru_hits = sum(lru.use(i // 10 + (i % 10) * 7) for i in range(5000))
    assert hits >= 0.9 * lru_hits


def test_arc_lfu_remembers_reuse_beyond_arc_ghosts():
    """A key used before, evicted long ago and forgotten by ARC's ghost lists, comes back: arc-lfu knows it
    is reused and keeps it through the next scan; plain ARC treats it as new."""
    def survivors(name: str) -> int:
        tier = Tier(make_policy(name), 40)
        returning = range(10)
        for i in returning:
            tier.use(i)
        for i in range(1000, 1200):  # out of the cache and of the ghosts (40 keys), not of the sketch (400 uses)
            tier.use(i)
        for i in returning:
            tier.use(i)  # back after a long gap
        for i in range(2000, 2100):
            tier.use(i)
        return sum(key(i) in tier.held for i in returning)

    assert survivors("arc") == 0
    assert survivors("arc-lfu") == 10


def test_policies_load_on_first_use():
    """``import kvtier.policy`` lists the policies without importing them; a tier asking for one loads it."""
    import subprocess
    import sys

    script = (
        "import sys, kvtier.policy as p\n"
        "mods = ('kvtier.policy.arc', 'kvtier.policy.lru', 'kvtier.policy.s3fifo', 'kvtier.policy.tinylfu')\n"
        "print(sorted(m for m in mods if m in sys.modules))\n"
        "print(sorted(p.POLICIES))\n"
        "policy = p.make_policy('arc-lfu')\n"
        "print(sorted(m for m in mods if m in sys.modules), type(policy).__name__, policy._sketch is not None)\n"
        "print(p.make_policy('arc')._sketch is None, p.ARCPolicy is type(policy))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "[]",
        "['arc', 'arc-lfu', 'lru', 's3fifo', 'tinylfu']",
        "['kvtier.policy.arc'] ARCPolicy True",
        "True True",
    ]
