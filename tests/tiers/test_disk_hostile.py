"""Things that are not chunk files, left where a disk tier's chunk files live (issue 17).

Anyone who can write to the directory can put a FIFO, a symlink, a socket or a folder where a chunk file
should be. A read must neither block on it (a FIFO's open waits for a writer forever) nor follow it: it is a
miss, found without blocking, and removed.
"""

from __future__ import annotations

import os
import shutil
import socket

import pytest
import torch

from kvtier.base.errors import ConfigError
from tests.conformance.tier_suite import blob, key
from tests.tiers.disk_helpers import disk_tier, put, read
from tests.tiers.test_disk_cache import CHUNK, cache, flush, kv, tokens


def plant(path: str, kind: str, elsewhere: str) -> socket.socket | None:
    """Put a ``kind`` of non-regular file at ``path`` (which must not exist); a socket must stay open."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":  # to a byte-identical copy of the chunk: still not ours to follow
        os.symlink(elsewhere, path)
    elif kind == "folder":
        os.mkdir(path)
    else:
        server = socket.socket(socket.AF_UNIX)
        short = os.path.join(os.path.dirname(elsewhere), "s")  # a chunk's path is too long to bind to
        server.bind(short)
        server.listen(1)
        os.rename(short, path)
        return server
    return None


@pytest.mark.timeout(60, method="thread")  # the bug guarded against: an open that never returns
@pytest.mark.parametrize("kind", ["fifo", "symlink", "socket", "folder"])
def test_a_non_regular_chunk_file_is_a_miss_found_without_blocking_and_removed(tmp_path, kind):
    toks, data = tokens(4, seed=3), kv(4, seed=3)
    with cache(tmp_path / "cache") as c:
        c.store(toks, data)
        flush(c)
        disk, keys = c.tiers[0], c.keys(toks)
        victim = disk.paths.path(keys[1])
        copy = str(tmp_path / "copy")
        shutil.copyfile(victim, copy)
        os.unlink(victim)
        server = plant(victim, kind, copy)
        try:
            out, n = c.retrieve(toks)
            assert n == CHUNK and torch.equal(out[:, :, :CHUNK], data[:, :, :CHUNK])  # the prefix before it
            flush(c)  # removal happens on the writer thread
            assert disk.contains(keys) == [True, False, True, True]
            assert os.path.lexists(victim) == (kind == "folder")  # a folder is left alone, but forgotten
            assert os.path.exists(copy)  # the symlink's target is untouched
            errors = c.metrics.total("kvtier_disk_io_errors_total")
            assert errors >= 1
            c.store(toks, data)  # the chunk can be stored again where the planted thing was
            flush(c)
            if kind != "folder":
                assert c.retrieve(toks)[1] == 4 * CHUNK
        finally:
            if server is not None:
                server.close()


@pytest.mark.timeout(60, method="thread")
def test_a_fifo_on_the_temp_name_skips_that_store_without_blocking(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    path = tier.paths.path(key(7))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path + ".tmp")  # a write opens its temp file for writing: with no reader that waits forever
    try:
        assert put(tier, [7]) == [True]  # accepted, then skipped by the writer
        assert tier.contains([key(7)]) == [False]
        assert not os.path.lexists(path + ".tmp")  # removed with the failed write
        assert tier._metrics.get("kvtier_skipped_stores_total", tier="disk", reason="io_error") == 1
        assert put(tier, [7]) == [True] and read(tier, [7]) == [blob(7)]
    finally:
        tier.close()


def test_deleting_the_lock_file_does_not_let_a_second_process_in(tmp_path):
    tier = disk_tier(tmp_path, 1 << 20)
    os.unlink(os.path.join(tier.paths.dir, ".lock"))  # the pid note; the lock is on the directory
    pid = os.fork()
    if pid == 0:  # the child: a second process opening the same directory
        try:
            disk_tier(tmp_path, 1 << 20)
            code = 1
        except ConfigError:
            code = 0
        except BaseException:  # noqa: BLE001 (any other failure: a distinct exit code for the parent)
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert put(tier, [1]) == [True] and read(tier, [1]) == [blob(1)]
    tier.close()
    again = disk_tier(tmp_path, 1 << 20)  # released by close
    assert read(again, [1]) == [blob(1)]
    again.close()


def test_where_a_directory_cannot_be_locked_the_lock_file_still_is(tmp_path, monkeypatch):
    import fcntl
    import stat

    real_flock = fcntl.flock

    def nfs_like_flock(fd, operation):  # NFS emulates flock with POSIX locks: EBADF on a read-only fd
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(9, "Bad file descriptor")
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", nfs_like_flock)
    tier = disk_tier(tmp_path, 1 << 20)
    with pytest.raises(ConfigError, match=f"in use by process {os.getpid()}"):
        disk_tier(tmp_path, 1 << 20)
    assert put(tier, [2]) == [True] and read(tier, [2]) == [blob(2)]
    tier.close()


@pytest.mark.timeout(60, method="thread")
def test_a_fifo_in_place_of_the_holders_note_neither_blocks_nor_unlocks(tmp_path):
    codec_dir = tmp_path / "raw"
    codec_dir.mkdir()
    os.mkfifo(codec_dir / ".lock")
    tier = disk_tier(tmp_path, 1 << 20)
    try:
        with pytest.raises(ConfigError, match="in use by process unknown"):
            disk_tier(tmp_path, 1 << 20)
        assert put(tier, [3]) == [True] and read(tier, [3]) == [blob(3)]
    finally:
        tier.close()
