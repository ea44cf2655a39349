"""The disk tier's files: where a chunk lives, how it is written atomically, read back and found at start.

Layout under the configured root, one file per chunk::

    <root>/<codec>/.lock          held (flock) by the one process using this directory
    <root>/<codec>/<hh>/<hex>     a complete blob; <hex> is the 64-hex-digit chunk key, <hh> its first two digits
    <root>/<codec>/<hh>/<hex>.tmp a write in progress (or torn by a crash): never read, removed at start

The codec is part of the path, so tiers of different codecs may share a root without ever meeting. Nothing
here keeps state: the tier (tier.py) owns the index, the locking and the accounting; these are plain
functions over paths that raise OSError (wrapped in ``DiskIOError`` naming the failed step).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

from kvtier.blob import header_length
from kvtier.errors import ConfigError, TierError
from kvtier.keys import HASH_BYTES, ChunkHash

TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
#: O_DIRECT wants buffers, offsets and lengths aligned to the logical block size; a page covers every disk.
ALIGN = 4096
#: The shortest possible blob: a header for one dimension and no tokens, and no payload.
MIN_BLOB_BYTES = header_length(1, 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DiskIOError(TierError):
    """An OSError at one named step (``op``) of a file operation. The tier turns it into a miss or a skipped
    store; being a TierError, KVCache would do the same should one escape the tier."""

    def __init__(self, op: str, cause: OSError) -> None:
        super().__init__(f"{op}: {cause}")
        self.op, self.cause = op, cause

    @property
    def errno_name(self) -> str:
        return errno.errorcode.get(self.cause.errno or 0, "unknown")


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class ChunkPaths:
    """Where one disk tier's chunk files live: ``dir`` is ``<root>/<codec>``, ``path(key)`` a chunk's file."""

    def __init__(self, root: str | os.PathLike[str], codec: str) -> None:
        self.root = os.fspath(root)
        self.dir = os.path.join(self.root, codec)

    def path(self, key: ChunkHash) -> str:
        return os.path.join(self.dir, key[:1].hex(), key.hex())


# -- locking --------------------------------------------------------------------------------------------------
def lock_directory(paths: ChunkPaths) -> int:
    """Create ``paths.dir`` if needed and take its exclusive lock; returns the fd that holds it.

    Raises ConfigError when another process (or another tier in this one) holds the directory. The lock goes
    with the fd: it is released by ``os.close`` or by the death of the process, SIGKILL included.
    """
    os.makedirs(paths.dir, exist_ok=True)
    fd = os.open(os.path.join(paths.dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"disk tier directory {paths.dir} is in use by process {holder}; give each process its own path"
        ) from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# -- writing --------------------------------------------------------------------------------------------------
def _step(op: str, fn, *args):  # type: ignore[no-untyped-def]
    try:
        return fn(*args)
    except OSError as exc:
        raise DiskIOError(op, exc) from exc


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < data.nbytes:
        done += os.write(fd, data[done:])


def write_atomic(path: str, buf: mmap.mmap, nbytes: int, *, fsync: bool, direct: bool) -> None:
    """Make ``path`` hold exactly ``buf[:nbytes]``, all or nothing: temp file, fsync, rename, fsync of the directory.

    With ``direct`` the temp file is written O_DIRECT (``buf`` is page-aligned and at least
    ``round_up(nbytes)`` long), whole blocks, then truncated to ``nbytes``. On failure the temp file is removed
    and DiskIOError names the step (open, write, fsync, rename, fsync_dir); ``path`` is then untouched. The
    parent directory must exist (its absence is an ``open`` ENOENT).
    """
    tmp = path + TEMP_SUFFIX
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC | (_O_DIRECT if direct else 0)
    fd = _step("open", os.open, tmp, flags, 0o644)
    try:
        try:
            _step("write", _write_all, fd, memoryview(buf)[: round_up(nbytes) if direct else nbytes])
            if direct:
                _step("write", os.ftruncate, fd, nbytes)
            if fsync:
                _step("fsync", os.fsync, fd)
        finally:
            os.close(fd)
        _step("rename", os.rename, tmp, path)
    except BaseException:
        try:
            remove(tmp)
        except DiskIOError:
            pass  # the original failure is what the caller needs; a later start removes the leftover
        raise
    if fsync:
        dfd = _step("fsync_dir", os.open, os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        try:
            _step("fsync_dir", os.fsync, dfd)
        finally:
            os.close(dfd)


def remove(path: str) -> bool:
    """Unlink ``path``; False if it was already gone. Other errors propagate as DiskIOError."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise DiskIOError("unlink", exc) from exc


# -- reading --------------------------------------------------------------------------------------------------
def read_into(path: str, out: memoryview, nbytes: int, *, direct: bool) -> int:
    """Read up to ``nbytes`` of ``path`` into ``out``; returns how many arrived (fewer: the file is short).

    With ``direct`` the file is opened O_DIRECT (``out`` must be ALIGN-aligned and ``round_up(nbytes)`` long);
    a filesystem that refuses O_DIRECT raises DiskIOError with EINVAL at ``open``.
    """
    flags = os.O_RDONLY | _O_CLOEXEC | (_O_DIRECT if direct else 0)
    fd = _step("open", os.open, path, flags)
    try:
        want = round_up(nbytes) if direct else nbytes
        got = 0
        while got < want:
            n = _step("read", os.preadv, fd, [out[got:want]], got)
            short = n < want - got
            got += n
            if short:
                break  # a short read of a regular file is its end (O_DIRECT reads round up past it)
        return min(got, nbytes)
    finally:
        os.close(fd)


class AlignedBufferPool:
    """Page-aligned, reusable byte buffers (anonymous mmaps), so reads and staged writes allocate rarely.

    Keeps at most ``retain_bytes`` of free buffers (a buffer released beyond that is dropped); a buffer is handed
    out whole, ``len(buf) >= nbytes``, and must not be used after ``release``.
    """

    def __init__(self, retain_bytes: int) -> None:
        self._retain = retain_bytes
        self._free: list[mmap.mmap] = []
        self._free_bytes = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> mmap.mmap:
        need = round_up(max(nbytes, 1))
        with self._lock:
            best = None
            for i, buf in enumerate(self._free):  # smallest free buffer that fits and wastes under half
                if need <= len(buf) < 2 * need and (best is None or len(buf) < len(self._free[best])):
                    best = i
            if best is not None:
                buf = self._free.pop(best)
                self._free_bytes -= len(buf)
                return buf
        return mmap.mmap(-1, need, flags=_MAP_FLAGS)  # populated now: one call instead of a fault per page

    def release(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._free_bytes + len(buf) <= self._retain:
                self._free.append(buf)
                self._free_bytes += len(buf)


# -- re-indexing at start -------------------------------------------------------------------------------------
def _parse_key(name: str) -> ChunkHash | None:
    if len(name) != 2 * HASH_BYTES:
        return None
    try:
        return ChunkHash(bytes.fromhex(name))
    except ValueError:
        return None


def scan(paths: ChunkPaths) -> tuple[list[tuple[ChunkHash, int]], dict[str, int]]:
    """Every chunk file under ``paths.dir`` as ``(key, size)``, oldest first; removes everything else there.

    Costs a directory listing and one stat per file: no file is opened (measured: reading each header made
    a cold re-index of 100,000 chunks 5x slower). A file only becomes a chunk name by an atomic rename after
    it was complete, so what is left to remove is: ``temp`` files of interrupted writes, ``torn`` files too
    short to hold a blob header (possible only after a machine crash with fsync off), and ``stray`` names.
    Damage inside a complete file is found by the checksum when it is read (and then removed).
    """
    found: list[tuple[int, ChunkHash, int]] = []
    removed = {"temp": 0, "torn": 0, "stray": 0}
    try:
        subdirs = [e for e in os.scandir(paths.dir) if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
    except FileNotFoundError:
        return [], removed
    for sub in subdirs:
        with os.scandir(sub.path) as entries:
            for entry in entries:
                key = _parse_key(entry.name)
                if key is not None and entry.name[:2] == sub.name and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_size >= MIN_BLOB_BYTES:
                        found.append((st.st_mtime_ns, key, st.st_size))
                        continue
                    kind = "torn"
                elif entry.is_dir(follow_symlinks=False):
                    continue  # not ours to delete recursively; ignored
                else:
                    kind = "temp" if entry.name.endswith(TEMP_SUFFIX) else "stray"
                try:
                    remove(entry.path)
                except DiskIOError:
                    continue  # not indexed either way; a later start tries again
                removed[kind] += 1
    found.sort(key=lambda f: f[0])
    return [(key, size) for _, key, size in found], removed
