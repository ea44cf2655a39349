"""Conformance suite every EvictionPolicy passes (kvtier/policy/base.py states the contracts).

Subclass ``PolicyConformance`` and set ``name`` to a key of ``kvtier.policy.POLICIES``; pytest collects the
inherited tests. Keys are SHA-256 digests, as chunk keys are.
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.base.keys import ChunkHash
from kvtier.policy import POLICIES, EvictionPolicy


def key(i: int) -> ChunkHash:
    return ChunkHash(hashlib.sha256(f"policy-{i}".encode()).digest())


#: One step of a workload: ("insert" | "access" | "remove" | "evict" | "chain", key number); "chain" reports
#: a request's chain (``on_chain``) from that key on, some of its keys held, some not
Op = tuple[str, int]

#: the suite's tests run once per policy class; they keep no state on ``self``, so that is safe
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.differing_executors])

ops_strategy = st.lists(st.tuples(st.sampled_from(["insert", "insert", "access", "remove", "evict", "chain"]),
                                  st.integers(0, 40)), max_size=300)


def drive(policy: EvictionPolicy, ops: Iterable[Op], capacity: int = 16, pinned: frozenset[int] = frozenset(),
          between: Callable[[EvictionPolicy], None] | None = None) -> list[ChunkHash | None]:
    """Play ``ops`` like a tier of ``capacity`` entries would; returns every victim taken.

    ``insert`` of an absent key first evicts down to ``capacity - 1`` entries (as a full tier does), then
    reports the insert; ``evict`` takes one victim. ``between`` runs after every step (extra calls that must
    not change the outcome).
    """
    held: set[ChunkHash] = set()
    locked = {key(i) for i in pinned}
    victims: list[ChunkHash | None] = []

    def evict_one() -> bool:
        victim = policy.victim(lambda k: k not in locked)
        victims.append(victim)
        if victim is None:
            return False
        assert victim in held, "victim must be an entry the tier holds"
        assert victim not in locked, "a pinned entry was proposed"
        held.discard(victim)
        policy.on_remove(victim)
        return True

    for op, i in ops:
        k = key(i)
        if op == "insert" and k not in held:
            while len(held) >= capacity and evict_one():
                pass
            if len(held) < capacity:
                held.add(k)
                policy.on_insert(k)
        elif op == "insert" or op == "access":
            policy.on_access(k)
        elif op == "remove":
            held.discard(k)
            policy.on_remove(k)
        elif op == "chain":
            policy.on_chain([key(j) for j in range(i, i + 6)])
        else:
            evict_one()
        assert len(policy) == len(held)
        if between is not None:
            between(policy)
    return victims


class PolicyConformance:
    name: str

    def make(self) -> EvictionPolicy:
        return POLICIES[self.name]()

    def test_empty_policy_has_no_victim(self):
        policy = self.make()
        assert policy.victim(lambda k: True) is None
        assert len(policy) == 0

    def test_unknown_keys_are_ignored(self):
        policy = self.make()
        policy.on_access(key(1))
        policy.on_remove(key(2))
        assert len(policy) == 0 and policy.victim(lambda k: True) is None

    @PROPERTY
    @given(ops=ops_strategy)
    def test_victims_are_held_and_never_pinned(self, ops):
        drive(self.make(), ops, pinned=frozenset({0, 1, 2, 3}))

    def test_pins_made_through_a_tier_are_never_evicted(self):
        """Cache-control pins (kvtier/tiers/control.py) reach the policy as ``evictable`` refusals: under this
        policy, in a real memory tier, a pinned chunk outlives a flood (with re-reads, so frequency policies
        see hot entries) that evicts everything else."""
        from kvtier.tiers import MemoryTier, MemoryTierConfig
        from tests.conformance.tier_suite import BLOB_BYTES, BytesPayload, blob, tier_context
        from tests.conformance.tier_suite import key as chunk_key

        def put(ids: Iterable[int]) -> None:
            tier.put([(chunk_key(i), BytesPayload(blob(i, seal=False))) for i in ids])

        config = MemoryTierConfig(capacity_bytes=8 * BLOB_BYTES + 100, policy=self.name, prefault=False,
                                  pin_budget_bytes=3 * BLOB_BYTES + 100)
        tier = MemoryTier(config, tier_context("memory"))
        try:
            put(range(8))
            assert tier.pin([chunk_key(i) for i in (0, 3, 5)]) > 0
            for i in range(100, 160):
                put([i])
                with tier.get([chunk_key(i), chunk_key(i)]):  # hot: read twice
                    pass
            assert tier.contains([chunk_key(i) for i in (0, 3, 5)]) == [True] * 3
            assert tier.contains([chunk_key(i) for i in (1, 2, 4, 6, 7)]) == [False] * 5
            tier.unpin([chunk_key(i) for i in (0, 3, 5)])
            for i in range(200, 260):
                put([i])
            assert tier.contains([chunk_key(i) for i in (0, 3, 5)]) == [False] * 3
        finally:
            tier.close()

    def test_all_pinned_means_no_victim(self):
        policy = self.make()
        for i in range(8):
            policy.on_insert(key(i))
        policy.on_access(key(3))
        assert policy.victim(lambda k: False) is None
        only = key(5)
        assert policy.victim(lambda k: k == only) == only
        assert len(policy) == 8

    @PROPERTY
    @given(ops=ops_strategy)
    def test_victim_changes_nothing(self, ops):
        def ask_often(policy: EvictionPolicy) -> None:
            for _ in range(3):
                policy.victim(lambda k: True)
                policy.victim(lambda k: k != key(7))

        assert drive(self.make(), ops, between=ask_often) == drive(self.make(), ops)

    @PROPERTY
    @given(ops=ops_strategy)
    def test_a_chain_of_keys_not_held_changes_nothing(self, ops):
        def stray_chain(policy: EvictionPolicy) -> None:
            policy.on_chain([key(1000), key(1001), key(1002)])

        assert drive(self.make(), ops, between=stray_chain) == drive(self.make(), ops)

    def test_deterministic_across_processes(self):
        """The same calls give the same victims in processes with different hash seeds."""
        script = (
            "import hashlib,random\n"
            "from kvtier.policy import POLICIES\n"
            f"p=POLICIES[{self.name!r}]()\nrng=random.Random(5)\nheld=[]\nout=[]\n"
            "for step in range(3000):\n"
            "    k=hashlib.sha256(str(rng.randrange(400)).encode()).digest()\n"
            "    if k in held: p.on_access(k); continue\n"
            "    if len(held)>=50:\n"
            "        v=p.victim(lambda x: True); held.remove(v); p.on_remove(v); out.append(v.hex()[:8])\n"
            "    held.append(k); p.on_insert(k)\n"
            "print(','.join(out))\n"
        )
        runs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                               env={**_env(), "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
        assert len(runs) == 1 and len(runs.pop()) > 1000

    def test_memory_is_bounded(self):
        """Streaming ever new keys through a tier of fixed size leaves the policy's footprint flat."""
        policy = self.make()
        rng = random.Random(3)
        held: list[ChunkHash] = []
        fresh = iter(range(10**9))

        def churn(steps: int) -> None:
            for _ in range(steps):
                k = key(next(fresh)) if rng.random() < 0.7 or not held else rng.choice(held)
                if k in held:
                    policy.on_access(k)
                    continue
                if len(held) >= 300:
                    victim = policy.victim(lambda x: True)
                    held.remove(victim)
                    policy.on_remove(victim)
                held.append(k)
                policy.on_insert(k)

        tracemalloc.start()  # before anything is allocated, so that later frees are seen too
        try:
            churn(6000)  # warm: the tier is full, ghost lists and sketches at their size
            before = tracemalloc.take_snapshot()
            churn(30000)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename")
                    if "kvtier/policy" in stat.traceback[0].filename)
        assert grown < 64 * 1024, f"policy grew by {grown} bytes over 30,000 new keys"

    def test_chain_reported_deepest_first_is_evicted_deepest_first(self):
        """Tiers report a request's chunks deepest first; eviction then takes a chain from its end."""
        policy = self.make()
        chain = [key(100 + depth) for depth in range(12)]  # chain[0] is the root
        for k in reversed(chain):
            policy.on_insert(k)
        for k in reversed(chain):  # read again, as a retrieve of the whole prefix reports it
            policy.on_access(k)
        assert self._eviction_order(policy) == list(reversed(chain))

    def test_on_chain_orders_a_chain_that_arrived_in_pieces(self):
        """Windows of a store reach a tier root side first; ``on_chain`` then orders the chain deepest first,
        ignoring keys the policy does not hold."""
        policy = self.make()
        chain = [key(200 + depth) for depth in range(12)]
        for start in (0, 4, 8):  # three windows, each reported deepest first
            for k in reversed(chain[start : start + 4]):
                policy.on_insert(k)
        policy.on_chain([key(999), *chain])
        assert len(policy) == 12
        assert self._eviction_order(policy) == list(reversed(chain))

    @staticmethod
    def _eviction_order(policy: EvictionPolicy) -> list[ChunkHash]:
        order = []
        while (victim := policy.victim(lambda k: True)) is not None:
            order.append(victim)
            policy.on_remove(victim)
        return order


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
