"""A Mooncake call that this replica queued (here for the transfer buffer) until less than half of its timeout
was left, and that then ran out, is busy, not the pool's failure: it does not count towards the circuit
breaker. The same slow call given its whole timeout is a failure. Against a real mooncake_master; the transfer
is slowed by a wrapper that sleeps before the real call (a slow peer)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier import KVSpec
from kvtier.base.metrics import Metrics
from kvtier.codecs import BytesPayload
from kvtier.tiers import MooncakeTier, TierContext
from harness.process import wait_for
from tests.tiers.mooncake.helpers import MiB, tier_config

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, dtype=torch.float16)
TIMEOUT_S = 2.0
SLOW_S = 3.0  # longer than any deadline below
HANG_GUARD_S = 120.0


class SlowGets:
    """The client's store with ``batch_get_into`` taking ``SLOW_S`` longer."""

    def __init__(self, store) -> None:
        self._store = store

    def batch_get_into(self, *args):
        time.sleep(SLOW_S)
        return self._store.batch_get_into(*args)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


@pytest.fixture
def tier(mooncake_master):
    tier = MooncakeTier(tier_config(mooncake_master, buffer_bytes=MiB, timeout_s=TIMEOUT_S),
                        TierContext(SPEC, Metrics(), "mooncake"))
    yield tier
    tier.close()
    assert mooncake_master.keys() == [], "a test left values in the pool"


def counted(tier: MooncakeTier, name: str) -> float:
    return tier._metrics.get(name, tier="mooncake", op="get")


def test_a_get_queued_for_the_buffer_that_then_runs_out_is_busy_and_a_full_one_is_a_failure(tier):
    values = [bytes([i + 1]) * (400 << 10) for i in range(4)]  # two fill the 1 MiB buffer
    keys = [bytes([i]) * 32 for i in range(4)]
    assert tier.put(list(zip(keys, map(BytesPayload, values)))[:2]) == [True, True]
    assert tier.put(list(zip(keys, map(BytesPayload, values)))[2:]) == [True, True]
    got: list = []

    def read() -> None:
        with tier.get(keys[2:]) as views:
            got.append(list(views))

    with tier.get(keys[:2]) as held:  # the whole buffer: the next get queues for it
        assert [bytes(v) for v in held] == values[:2]
        tier._client._store = SlowGets(tier._client._store)
        waiter = threading.Thread(target=read)
        waiter.start()
        assert wait_for(lambda: tier._buffers.waited == 1)
        time.sleep(TIMEOUT_S * 0.8)  # most of the waiter's deadline goes by in the queue
    waiter.join(HANG_GUARD_S)
    assert got == [[None, None]]  # a miss, ...
    assert counted(tier, "kvtier_mooncake_busy_total") == 1  # ... this replica's queue, ...
    assert counted(tier, "kvtier_tier_errors_total") == 0  # ... not the pool's failure
    assert wait_for(lambda: tier._buffers.largest_free == tier._buffers.capacity, timeout=HANG_GUARD_S)

    read()  # the same slow call with its whole timeout: the pool's failure
    assert got[-1] == [None, None]
    assert counted(tier, "kvtier_tier_errors_total") == 1 and counted(tier, "kvtier_mooncake_busy_total") == 1
    assert wait_for(lambda: tier._buffers.largest_free == tier._buffers.capacity, timeout=HANG_GUARD_S)
    tier._client._store = tier._client._store._store
    tier.delete(keys)


def staged(tier: MooncakeTier, op: str, stage: str) -> tuple[float, float]:
    """(calls, seconds) the tier's stage histogram holds for ``op``/``stage``."""
    labels = {"op": op, "stage": stage, "tier": "mooncake"}
    samples = {s.name: s.value for m in tier._metrics.registry.collect() for s in m.samples if s.labels == labels}
    name = "kvtier_mooncake_stage_seconds"
    return samples.get(f"{name}_count", 0.0), samples.get(f"{name}_sum", 0.0)


def test_every_stage_of_a_put_and_a_get_is_timed_and_a_late_transfer_when_it_ends(tier):
    keys = [bytes([i]) * 32 for i in range(2)]
    assert tier.put([(k, BytesPayload(bytes([7]) * (100 << 10))) for k in keys]) == [True, True]
    for stage in ("buffer", "copy", "turn", "start", "transfer"):
        assert staged(tier, "put", stage)[0] == 1, stage
    with tier.get(keys) as views:
        assert all(v is not None for v in views)
    for stage in ("sizes", "buffer", "turn", "start", "transfer", "held"):
        assert staged(tier, "get", stage)[0] == 1, stage
    tier._client._store = SlowGets(tier._client._store)
    with tier.get(keys) as views:  # past its deadline: a miss, the transfer still under way
        assert views == [None, None]
        assert staged(tier, "get", "transfer")[0] == 1
    assert wait_for(lambda: staged(tier, "get", "transfer")[0] == 2, timeout=HANG_GUARD_S)
    assert staged(tier, "get", "transfer")[1] >= SLOW_S  # the late call's whole time, recorded when it ended
    assert wait_for(lambda: tier._buffers.largest_free == tier._buffers.capacity, timeout=HANG_GUARD_S)
    tier._client._store = tier._client._store._store
    tier.delete(keys)
