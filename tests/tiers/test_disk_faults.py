"""Disk tier faults: ENOSPC and EIO on write and fsync (injected, and on a real full tmpfs where mounting
works), a second process on the same directory."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from pathlib import Path

import pytest

from kvtier.base.errors import ConfigError
from kvtier.tiers.disk import tier as tier_module
from tests.conformance.tier_suite import blob, key
from tests.tiers.disk_helpers import disk_tier, put, read


def leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*.tmp")]


def in_writer() -> bool:
    return threading.current_thread().name.startswith("kvtier-disk-writer")


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_write_error_skips_the_store_and_removes_the_partial_file(tmp_path, monkeypatch, err):
    tier = disk_tier(tmp_path, 1 << 20)
    put(tier, [1])
    real_write = os.write

    def failing_write(fd, data):
        if not in_writer():
            return real_write(fd, data)
        real_write(fd, memoryview(data)[: len(data) // 2 // 4096 * 4096])  # some of it lands, then the disk is full
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "write", failing_write)
    assert put(tier, [2, 3]) == [True, True]  # accepted; no exception reaches the caller
    monkeypatch.setattr(os, "write", real_write)
    assert tier.contains([key(1), key(2), key(3)]) == [True, False, False]
    assert read(tier, [1, 2]) == [blob(1), None]  # reads keep working
    assert leftovers(tmp_path) == [] and not os.path.exists(tier.paths.path(key(2)))
    name = errno.errorcode[err]
    assert tier._metrics.get("kvtier_disk_io_errors_total", tier="disk", op="write", errno=name) == 2
    assert tier._metrics.get("kvtier_skipped_stores_total", tier="disk", reason="io_error") == 2
    assert tier.stats().used_bytes == len(blob(1))
    assert put(tier, [2]) == [True] and read(tier, [2]) == [blob(2)]  # and it recovers
    tier.close()


def test_a_writer_that_raises_a_bug_skips_that_store_and_the_next_is_written(tmp_path, monkeypatch):
    """Not an OSError (those are DiskIOError): a bug in one store's write. The writer thread goes on, and the
    store gives its room and its write-queue slot back instead of staying pending for ever."""
    tier = disk_tier(tmp_path, 1 << 20, write_queue_depth=1, write_threads=1)
    real = tier_module.write_atomic
    calls = []

    def raises_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("injected: a bug in one store's write")
        return real(*args, **kwargs)

    monkeypatch.setattr(tier_module, "write_atomic", raises_once)
    assert put(tier, [1]) == [True]
    assert tier.contains([key(1)]) == [False] and tier.stats().used_bytes == 0
    assert tier._metrics.get("kvtier_skipped_stores_total", tier="disk", reason="io_error") == 1
    assert put(tier, [2]) == [True] and read(tier, [2]) == [blob(2)]  # the one queue slot is free again
    tier.close()


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_fsync_error_skips_the_store_and_removes_the_file(tmp_path, monkeypatch, err):
    tier = disk_tier(tmp_path, 1 << 20)
    real_fsync = os.fsync

    def failing_fsync(fd):
        if in_writer() and not os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(err, os.strerror(err))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    assert put(tier, [1]) == [True]
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert tier.contains([key(1)]) == [False]
    assert leftovers(tmp_path) == [] and not os.path.exists(tier.paths.path(key(1)))
    name = errno.errorcode[err]
    assert tier._metrics.get("kvtier_disk_io_errors_total", tier="disk", op="fsync", errno=name) == 1
    assert put(tier, [1]) == [True] and read(tier, [1]) == [blob(1)]
    tier.close()


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                              check=False, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("cannot run mount here")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=10)


def test_enospc_on_a_full_filesystem(small_fs):
    tier = disk_tier(small_fs, 64 << 20)  # the tier allows far more than the filesystem holds
    results = [put(tier, [i])[0] for i in range(100)]
    assert all(results)  # every store was accepted and none raised
    stored = [i for i in range(100) if tier.contains([key(i)])[0]]
    assert 0 < len(stored) < 100
    assert tier._metrics.get("kvtier_skipped_stores_total", tier="disk", reason="io_error") == 100 - len(stored)
    assert tier._metrics.total("kvtier_disk_io_errors_total") == 100 - len(stored)
    assert leftovers(small_fs) == []
    assert read(tier, stored) == [blob(i) for i in stored]  # reads keep working
    tier.delete([key(i) for i in stored[:5]])  # room again: stores work again
    tier.flush()
    assert put(tier, [500]) == [True] and read(tier, [500]) == [blob(500)]
    tier.close()


def test_a_second_process_is_refused(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    pid = os.fork()
    if pid == 0:  # the child: a second process opening the same directory
        try:
            disk_tier(tmp_path, 1 << 20)
            code = 1
        except ConfigError as exc:
            code = 0 if str(os.getppid()) in str(exc) else 2
        except Exception:  # noqa: BLE001 (any other failure: a distinct exit code for the parent)
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tier.close()
