"""The disk tier: conformance, layout, locking, start-up re-index, faults (see also test_disk_*.py)."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from kvtier.base.errors import ConfigError
from kvtier.codecs import BytesPayload
from kvtier.core.config import CacheConfig
from kvtier.tiers import DiskTier, DiskTierConfig
from tests.conformance.control_suite import ControlConformance
from tests.conformance.tier_suite import (
    BLOB_BYTES,
    EvictingTierConformance,
    RemovalListenerConformance,
    blob,
    key,
)
from tests.tiers.disk_helpers import disk_tier, put, read


class TestDiskTierConformance(EvictingTierConformance, RemovalListenerConformance, ControlConformance):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.root = tmp_path
        self.n = 0

    def make_tier(self, capacity_bytes: int) -> DiskTier:
        self.n += 1  # one directory per tier: a directory belongs to one tier at a time
        return disk_tier(self.root / f"t{self.n}", capacity_bytes, fsync=False)

    def make_controlled(self, capacity_bytes: int, clock, **config) -> DiskTier:
        self.n += 1
        return disk_tier(self.root / f"t{self.n}", capacity_bytes, clock, fsync=False, **config)


def hold_writers(tier: DiskTier) -> threading.Event:
    """Block every writer thread until the returned event is set."""
    gate = threading.Event()
    for writer in tier._writers:
        writer.submit(gate.wait)
    return gate




def test_files_live_under_the_codec_and_key(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    put(tier, [1])
    path = tmp_path / "raw" / key(1).hex()[:2] / key(1).hex()
    assert path.read_bytes() == blob(1)
    assert tier.paths.path(key(1)) == str(path)
    tier.close()


def test_restart_reindexes_and_removes_leftovers(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    put(tier, [1, 2, 3])
    tier.close()
    sub = tmp_path / "raw" / "ab"
    sub.mkdir(exist_ok=True)
    (sub / ("ab" * 32 + ".tmp")).write_bytes(b"half a chunk")  # an interrupted write
    (sub / "junk").write_bytes(b"x")
    torn = tmp_path / "raw" / key(4).hex()[:2] / key(4).hex()
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(blob(4)[:40])  # too short for any blob (only a machine crash with fsync off leaves this)

    again = disk_tier(tmp_path, 1 << 20)
    assert again.contains([key(i) for i in (1, 2, 3, 4)]) == [True, True, True, False]
    assert read(again, [1, 2, 3]) == [blob(1), blob(2), blob(3)]
    assert sorted(p.name for p in sub.iterdir()) == []
    assert not torn.exists()
    assert again.stats().used_bytes == 3 * BLOB_BYTES
    assert again._metrics.get("kvtier_disk_leftovers_removed_total", tier="disk", kind="temp") == 1
    assert again._metrics.get("kvtier_disk_leftovers_removed_total", tier="disk", kind="torn") == 1
    assert again._metrics.get("kvtier_disk_leftovers_removed_total", tier="disk", kind="stray") == 1
    again.close()


def test_restart_keeps_write_order_for_eviction_and_obeys_a_smaller_capacity(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    for i in range(5):
        put(tier, [i])
        path = tier.paths.path(key(i))
        os.utime(path, ns=(i * 10**9, i * 10**9))  # distinct mtimes, oldest first
    tier.close()
    small = disk_tier(tmp_path, 3 * BLOB_BYTES)
    assert small.contains([key(i) for i in range(5)]) == [False, False, True, True, True]
    put(small, [9])
    assert small.contains([key(2), key(9)]) == [False, True]
    small.close()


def test_restart_keeps_the_order_of_last_use(tmp_path):
    """Reads and writes stamp each file's mtime, so a restarted tier evicts by last use, a chain from its end."""
    tier = disk_tier(tmp_path, 6 * BLOB_BYTES)
    for i in range(4):
        put(tier, [i])
    assert read(tier, [0]) == [blob(0)]  # 0 is now the most recently used
    put(tier, [20, 21])  # one request's chain, root first
    tier.close()
    again = disk_tier(tmp_path, 6 * BLOB_BYTES)
    evicted = []
    for i in range(30, 34):
        put(again, [i])
        evicted += [j for j in (0, 1, 2, 3, 20, 21) if j not in evicted and again.contains([key(j)]) == [False]]
    assert evicted == [1, 2, 3, 0]
    again.close()
    again = disk_tier(tmp_path, 6 * BLOB_BYTES)
    put(again, [40])
    assert again.contains([key(20), key(21)]) == [True, False]  # the chain lost its deepest chunk first
    again.close()


def test_a_directory_belongs_to_one_tier(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    with pytest.raises(ConfigError, match="in use by process"):
        disk_tier(tmp_path, 1 << 20)
    other_codec = tmp_path / "raw"  # the lock is per codec directory: another root is free
    assert other_codec.is_dir()
    tier.close()
    disk_tier(tmp_path, 1 << 20).close()  # released on close


def test_full_queue_drops_and_counts(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20, write_queue_depth=2)
    gate = hold_writers(tier)
    try:
        assert tier.put([(key(i), BytesPayload(blob(i))) for i in range(4)]) == [True, True, False, False]
        assert tier._metrics.get("kvtier_skipped_stores_total", tier="disk", reason="queue_full") == 2
        assert tier.contains([key(0)]) == [False]  # queued is not visible
    finally:
        gate.set()
    tier.flush()
    assert tier.contains([key(i) for i in range(4)]) == [True, True, False, False]
    tier.close()


def test_put_copies_the_payload_before_returning(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    gate = hold_writers(tier)
    data = bytearray(blob(1))
    tier.put([(key(1), BytesPayload(data))])
    data[:] = bytes(len(data))  # the caller reuses its buffer at once
    gate.set()
    tier.flush()
    assert read(tier, [1]) == [blob(1)]
    tier.close()


def test_delete_of_a_queued_store_wins(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    gate = hold_writers(tier)
    tier.put([(key(1), BytesPayload(blob(1)))])
    tier.delete([key(1)])
    gate.set()
    tier.flush()
    assert tier.contains([key(1)]) == [False]
    assert not os.path.exists(tier.paths.path(key(1)))
    assert tier.stats().used_bytes == 0
    tier.close()


def test_vanished_file_is_a_miss_and_leaves_the_index(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    put(tier, [1, 2])
    os.unlink(tier.paths.path(key(1)))
    assert read(tier, [1, 2]) == [None, blob(2)]
    assert tier.contains([key(1), key(2)]) == [False, True]
    assert tier._metrics.get("kvtier_disk_io_errors_total", tier="disk", op="read", errno="ENOENT") == 1
    tier.close()


def test_directory_removed_underneath_then_back(tmp_path):
    import shutil

    root = tmp_path / "cache"
    tier = disk_tier(root, 1 << 20)
    put(tier, [1, 2])
    shutil.rmtree(root)
    assert read(tier, [1, 2]) == [None, None]  # misses, no exception
    assert tier.contains([key(1), key(2)]) == [False, False]
    assert tier.stats().used_bytes == 0
    assert put(tier, [3]) == [True]  # accepted, then fails in the writer: root is still gone
    assert tier.contains([key(3)]) == [False]
    assert tier._metrics.get("kvtier_skipped_stores_total", tier="disk", reason="io_error") == 1
    root.mkdir()  # back (empty)
    assert put(tier, [4]) == [True]
    assert read(tier, [4]) == [blob(4)]
    assert tier.stats().entries == 1
    assert DiskTier  # the lock was taken again: a second tier on the directory is refused
    with pytest.raises(ConfigError):
        disk_tier(root, 1 << 20)
    tier.close()


@pytest.mark.parametrize("o_direct", [True, False])
def test_direct_and_buffered_io_store_the_same_bytes(tmp_path, o_direct):
    tier = disk_tier(tmp_path, 1 << 20, o_direct=o_direct)
    put(tier, [1, 2, 3])
    assert read(tier, [3, 1, 2]) == [blob(3), blob(1), blob(2)]
    assert all(os.path.getsize(tier.paths.path(key(i))) == len(blob(i)) for i in (1, 2, 3))
    tier.close()


def test_o_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch):
    tier = disk_tier(tmp_path, 1 << 20, o_direct=True)
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    assert put(tier, [1]) == [True]
    assert read(tier, [1]) == [blob(1)]
    assert (tier._read_direct, tier._write_direct) == (False, False)
    assert tier._metrics.total("kvtier_disk_io_errors_total") == 0
    tier.close()


def test_config_from_yaml_and_env(tmp_path):
    env = {
        "KVTIER_TIERS": "memory,disk", "KVTIER_DISK_PATH": str(tmp_path), "KVTIER_DISK_CAPACITY_BYTES": "200GiB",
        "KVTIER_DISK_WRITE": "back", "KVTIER_DISK_WRITE_QUEUE_DEPTH": "8", "KVTIER_DISK_READ_THREADS": "2",
        "KVTIER_DISK_O_DIRECT": "on", "KVTIER_DISK_FSYNC": "false",
    }
    disk = CacheConfig.from_env(env).tiers[1]
    assert isinstance(disk, DiskTierConfig)
    assert (disk.path, disk.capacity_bytes, disk.write.value) == (tmp_path, 200 << 30, "back")
    assert (disk.write_queue_depth, disk.read_threads, disk.o_direct, disk.fsync) == (8, 2, True, False)
    yaml_file = tmp_path / "kvtier.yaml"
    yaml_file.write_text(f"tiers:\n  - kind: disk\n    path: {tmp_path}\n    capacity_bytes: 1GiB\n")
    assert CacheConfig.from_yaml(yaml_file).tiers[0].capacity_bytes == 1 << 30
    with pytest.raises(ConfigError, match="path is required"):
        CacheConfig.from_dict({"tiers": [{"kind": "disk"}]})


def test_errno_names():
    from kvtier.tiers.disk.files import DiskIOError

    assert DiskIOError("write", OSError(errno.ENOSPC, "full")).errno_name == "ENOSPC"
