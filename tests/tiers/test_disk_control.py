"""The disk tier's pins, owners and expiries on disk (kvtier/tiers/disk/control.py): written when they change,
read back at start, damaged files ignored."""

from __future__ import annotations

import json
import os

from kvtier.tiers.control import Tags
from tests.conformance.tier_suite import BLOB_BYTES, BytesPayload, FakeClock, blob, key
from tests.tiers.disk_helpers import disk_tier


def store(tier, ids, tags=Tags()) -> None:
    tier.put_tagged([(key(i), BytesPayload(blob(i))) for i in ids], tags)
    tier.flush()


def test_a_pin_is_on_disk_before_it_returns_and_owners_with_each_chunk(tmp_path):
    clock = FakeClock()
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, clock, fsync=False)
    store(tier, [0, 1], Tags("a", clock.now + 30))
    store(tier, [2])
    tier.pin([key(0)])
    pins = json.loads((tmp_path / "raw" / "pins.json").read_text())
    assert pins["pinned"] == [key(0).hex()]
    expiry = round((clock.now + 30) * 1000)
    names = sorted(p.name for p in (tmp_path / "raw").glob("??/*"))  # before any close: written with the chunks
    assert names == sorted([f"{key(0).hex()}.a.{expiry}", f"{key(1).hex()}.a.{expiry}", key(2).hex()])
    tier.close()
    assert not (tmp_path / "raw" / "tags.json").exists()
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
        assert tier.usage().pinned_bytes == 0
        assert tier.tags_of([key(1)]) == [Tags("a")]  # the file's name records it; the damaged old file is ignored
        assert not (tmp_path / "raw" / "tags.json").exists()
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


def test_an_older_versions_tags_json_moves_into_the_names_and_goes(tmp_path):
    clock = FakeClock()
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, clock, fsync=False)
    store(tier, [0, 1, 2])
    tier.close()
    old = {"version": 1, "tags": {key(0).hex(): ["b", clock.now + 30], key(1).hex(): ["c", None],
                                  key(9).hex(): ["b", None]}}  # key 9: a chunk gone since, ignored
    (tmp_path / "raw" / "tags.json").write_text(json.dumps(old))
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, clock, fsync=False)
    try:
        assert tier.tags_of([key(0), key(1), key(2)]) == [Tags("b", clock.now + 30), Tags("c"), Tags()]
        assert not (tmp_path / "raw" / "tags.json").exists()
        assert os.path.exists(tier.paths.path(key(1), Tags("c"))) and not os.path.exists(tier.paths.path(key(1)))
        assert tier.clear(tenant="b") == 1 and tier.contains([key(0), key(1)]) == [False, True]
    finally:
        tier.close()
    tier = disk_tier(tmp_path, 16 * BLOB_BYTES, clock, fsync=False)  # and the names keep them from now on
    try:
        assert tier.tags_of([key(1), key(2)]) == [Tags("c"), Tags()]
    finally:
        tier.close()
