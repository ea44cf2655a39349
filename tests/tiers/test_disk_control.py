"""The disk tier's pins, owners and expiries on disk (kvtier/tiers/disk/control.py): written when they change,
read back at start, damaged files ignored."""

from __future__ import annotations

import json

from kvtier.tiers.control import Tags
from tests.conformance.tier_suite import BLOB_BYTES, BytesPayload, FakeClock, blob, key
from tests.tiers.disk_helpers import disk_tier


def store(tier, ids, tags=Tags()) -> None:
    tier.put_tagged([(key(i), BytesPayload(blob(i))) for i in ids], tags)
    tier.flush()


def test_a_pin_is_on_disk_before_it_returns_and_owners_at_close(tmp_path):
    clock = FakeClock()
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, clock, fsync=False)
    store(tier, [0, 1], Tags("a", clock.now + 30))
    store(tier, [2])
    tier.pin([key(0)])
    pins = json.loads((tmp_path / "raw" / "pins.json").read_text())
    assert pins["pinned"] == [key(0).hex()]
    tier.close()
    tags = json.loads((tmp_path / "raw" / "tags.json").read_text())["tags"]
    assert sorted(tags) == sorted([key(0).hex(), key(1).hex()])
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, clock, fsync=False)
    try:
        assert tier.pinned([key(0), key(1), key(2)]) == [True, False, False]
        assert tier.tags_of([key(1), key(2)]) == [Tags("a", clock.now + 30), Tags()]
        clock.now += 31
        assert tier.contains([key(0), key(1), key(2)]) == [True, False, True]  # pinned: no expiry
    finally:
        tier.close()


def test_damaged_control_files_are_ignored_and_the_chunks_stay(tmp_path):
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, fsync=False)
    store(tier, [0, 1], Tags("a"))
    tier.pin([key(0)])
    tier.close()
    (tmp_path / "raw" / "pins.json").write_text("{not json")
    (tmp_path / "raw" / "tags.json").write_text(json.dumps({"version": 1, "tags": {"zz": 3, key(1).hex(): [7, 0]}}))
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, fsync=False)
    try:
        assert tier.contains([key(0), key(1)]) == [True, True]
        assert tier.pinned([key(0)]) == [False]
        assert tier.usage().pinned_bytes == 0 and tier.tags_of([key(1)]) == [Tags()]
    finally:
        tier.close()


def test_restored_pins_stay_within_the_budget(tmp_path):
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, fsync=False, pin_budget_bytes=4 * BLOB_BYTES)
    store(tier, [0, 1, 2])
    tier.pin([key(0), key(1), key(2)])
    tier.close()
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, fsync=False, pin_budget_bytes=2 * BLOB_BYTES)  # budget cut
    try:
        assert sum(tier.pinned([key(0), key(1), key(2)])) <= 2
        assert tier.usage().pinned_bytes <= 2 * BLOB_BYTES
    finally:
        tier.close()


def test_a_tenant_past_its_share_after_a_restart_gives_room_first(tmp_path):
    tier = disk_tier(tmp_path, 8 * BLOB_BYTES, fsync=False)
    store(tier, [10], Tags("b"))  # the oldest: plain LRU would evict it first
    for i in range(6):
        store(tier, [i], Tags("a"))
    tier.close()
    tier = disk_tier(tmp_path, 8 * BLOB_BYTES, fsync=False, tenant_share=0.25, tenant_shares={"default": 1.0})
    try:
        store(tier, [20])
        store(tier, [21])  # the tier is full: tenant a, past its quarter, gives the room
        assert tier.contains([key(10), key(20), key(21)]) == [True, True, True]
        assert sum(tier.contains([key(i) for i in range(6)])) == 5
    finally:
        tier.close()
