"""The disk tier's files: where a chunk lives, how it is written atomically, read back and found at start.

Layout under the configured root, one file per chunk::

    <root>/<codec>/               locked (flock on the directory) by the one process using it
    <root>/<codec>/.lock          the pid of that process, for messages
    <root>/<codec>/<hh>/<hex>     a complete blob; <hex> is the 64-hex-digit chunk key, <hh> its first two digits
    <root>/<codec>/<hh>/<hex>.<tenant>.<expiry>
                                  the same, owned by a tenant other than the default one and/or expiring: the
                                  tenant's tag (hex digits, empty for the default tenant) and the expiry in
                                  wall-clock milliseconds (empty for none)
    <root>/<codec>/<hh>/<name>.tmp a write in progress (or torn by a crash): never read, removed at start

A chunk's owner and expiry are part of its file's name, so they are written with the chunk by the same atomic
rename and read back at start with the names, also after a crash (no file is opened to learn them). A chunk's
tags never change while it is stored, so its name does not either. Directories written before names carried
tags hold only ``<hex>`` names (their tags, if any, were kept in ``tags.json``: control.py migrates them).

The codec is part of the path, so tiers of different codecs may share a root without ever meeting. Nothing
here keeps state: the tier (tier.py) owns the index, the locking and the accounting; these are plain
functions over paths that raise OSError (wrapped in ``DiskIOError`` naming the failed step).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import threading

from kvtier.base.errors import ConfigError, TierError
from kvtier.base.keys import ChunkHash
from kvtier.codecs.blob import header_length
from kvtier.native.hugepages import HUGE_PAGE, huge_page_map
from kvtier.tiers.control import DEFAULT_TAGS, Tags
from kvtier.tiers.disk.names import chunk_name, parse_name

TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
#: O_DIRECT wants buffers, offsets and lengths aligned to the logical block size; a page covers every disk.
ALIGN = 4096
#: The shortest possible blob: a header for one dimension and no tokens, and no payload.
MIN_BLOB_BYTES = header_length(1, 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
log = logging.getLogger(__name__)
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

    def path(self, key: ChunkHash, tags: Tags = DEFAULT_TAGS) -> str:
        """The file of ``key`` stored with ``tags`` (see ``chunk_name``)."""
        return os.path.join(self.dir, key[:1].hex(), chunk_name(key, tags))


# -- locking --------------------------------------------------------------------------------------------------
def lock_directory(paths: ChunkPaths) -> int:
    """Create ``paths.dir`` if needed and take an exclusive lock on it; returns the fd that holds it.

    The lock is on the directory itself, not on a file in it: a lock file can be deleted under a live process,
    and the next process would lock a new one and take the directory over. ``.lock`` only names the holder's
    pid for the error message. Where a filesystem cannot lock a directory (NFS emulates flock with POSIX
    locks, which need a writable fd), the lock falls back to the ``.lock`` file.

    Raises ConfigError when another process (or another tier in this one) holds the directory. The lock goes
    with the fd: it is released by ``os.close`` or by the death of the process, SIGKILL included.
    """
    os.makedirs(paths.dir, exist_ok=True)
    note = os.path.join(paths.dir, LOCK_NAME)
    fd = os.open(paths.dir, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        try:
            _flock(fd, paths, note)
        except OSError:  # this filesystem cannot lock a directory: lock the note instead
            os.close(fd)
            fd = -1
            fd = os.open(note, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | _O_CLOEXEC, 0o644)
            _flock(fd, paths, note)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    _write_note(note)
    return fd


def _flock(fd: int, paths: ChunkPaths, note: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"disk tier directory {paths.dir} is in use by process {_holder(note)}; give each "
                          "process its own path") from None


def _holder(note: str) -> str:
    try:
        fd = open_regular(note, os.O_RDONLY | _O_CLOEXEC)
    except DiskIOError:
        return "unknown"  # no note (deleted, or something else in its place): the lock still holds
    try:
        return os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
    finally:
        os.close(fd)


def _write_note(note: str) -> None:
    """Write this process's pid to ``note``; a note that cannot be written only costs error messages."""
    try:
        fd = open_regular(note, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
    except (DiskIOError, OSError) as exc:
        log.warning("disk tier: cannot write the holder's pid to %s (%s); the directory is locked all the same",
                    note, exc)


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


def open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` for a chunk file that neither blocks on nor follows whatever was put in its place.

    Anyone who can write to the directory can leave a FIFO there (a plain open would wait for a writer
    forever), a symlink (to a file that is not ours), a socket or a device: O_NONBLOCK and O_NOFOLLOW make
    the open return at once, and ``fstat`` then refuses anything but a regular file with DiskIOError at
    ``open`` (ELOOP for a symlink, ENXIO for the rest), for the caller to count as a miss and remove.
    """
    fd = _step("open", os.open, path, flags | os.O_NONBLOCK | os.O_NOFOLLOW, mode)
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
    except OSError as exc:
        os.close(fd)
        raise DiskIOError("open", exc) from exc
    if kind != stat.S_IFREG:
        os.close(fd)
        raise DiskIOError("open", OSError(errno.ENXIO, f"not a regular file (mode {kind:o})", path))
    return fd  # O_NONBLOCK does nothing to a regular file's reads and writes


def write_atomic(path: str, buf: mmap.mmap, nbytes: int, *, fsync: bool, direct: bool,
                 mtime_ns: int | None = None) -> None:
    """Make ``path`` hold exactly ``buf[:nbytes]``, all or nothing: temp file, fsync, rename, fsync of the directory.
    ``mtime_ns`` (when given) becomes the file's modification time, set before the fsync so it lasts with it.

    With ``direct`` the temp file is written O_DIRECT (``buf`` is page-aligned and at least
    ``round_up(nbytes)`` long), whole blocks, then truncated to ``nbytes``. On failure the temp file is removed
    and DiskIOError names the step (open, write, fsync, rename, fsync_dir); ``path`` is then untouched. The
    parent directory must exist (its absence is an ``open`` ENOENT).
    """
    tmp = path + TEMP_SUFFIX
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC | (_O_DIRECT if direct else 0)
    try:
        fd = open_regular(tmp, flags)  # inside the try: whatever squats on the temp name is removed below
        try:
            _step("write", _write_all, fd, memoryview(buf)[: round_up(nbytes) if direct else nbytes])
            if direct:
                _step("write", os.ftruncate, fd, nbytes)
            if mtime_ns is not None:
                _step("utime", set_mtime, fd, mtime_ns)
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


def set_mtime(target: str | int, mtime_ns: int) -> None:
    """Set the access and modification times of an open file, or of a path without following a symlink put
    in its place: the disk tier's record of last use."""
    if isinstance(target, int):
        os.utime(target, ns=(mtime_ns, mtime_ns))
    else:
        os.utime(target, ns=(mtime_ns, mtime_ns), follow_symlinks=False)


def touch(path: str, mtime_ns: int) -> None:
    """``set_mtime`` of a chunk file, failures as DiskIOError."""
    _step("utime", set_mtime, path, mtime_ns)


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
    fd = open_regular(path, flags)
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


def new_buffer(nbytes: int) -> mmap.mmap:
    """A fresh page-aligned anonymous buffer of at least ``nbytes``.

    Fresh memory costs the kernel a zeroed page per 4 KiB, which can be slower than the disk, so buffers of
    2 MiB and more are rounded up to whole huge pages and advised MADV_HUGEPAGE (one fault per 2 MiB); smaller
    ones are populated in one call. Measured on docs/benchmarks/tiers.md ("Why the code is shaped this way").
    """
    if nbytes < HUGE_PAGE:
        return mmap.mmap(-1, nbytes, flags=_MAP_FLAGS)
    return huge_page_map(nbytes)


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
        return new_buffer(need)

    def release(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._free_bytes + len(buf) <= self._retain:
                self._free.append(buf)
                self._free_bytes += len(buf)


# -- re-indexing at start -------------------------------------------------------------------------------------
def scan(paths: ChunkPaths) -> tuple[list[tuple[ChunkHash, int, Tags]], dict[str, int]]:
    """Every chunk file under ``paths.dir`` as ``(key, size, tags)``, oldest first; removes everything else there.

    Costs a directory listing and one stat per file: no file is opened (reading each header is several
    times slower on a cold re-index: docs/benchmarks/tiers.md); the tags come from the names. A file only
    becomes a chunk name by an atomic rename after it was complete, so what is left to remove is: ``temp``
    files of interrupted writes, ``torn`` files too short to hold a blob header (possible only after a machine
    crash with fsync off), and ``stray`` names (an older file of a key found twice among them).
    Damage inside a complete file is found by the checksum when it is read (and then removed).
    """
    found: dict[ChunkHash, tuple[int, int, Tags, str]] = {}
    removed = {"temp": 0, "torn": 0, "stray": 0}
    try:
        subdirs = [e for e in os.scandir(paths.dir) if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
    except FileNotFoundError:
        return [], removed
    for sub in subdirs:
        with os.scandir(sub.path) as entries:
            for entry in entries:
                named = parse_name(entry.name)
                if named is not None and entry.name[:2] == sub.name and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_size >= MIN_BLOB_BYTES:
                        older = _keep_newer(found, named, st, entry.path)
                        if older is None:
                            continue
                        kind, path = "stray", older
                    else:
                        kind, path = "torn", entry.path
                elif entry.is_dir(follow_symlinks=False):
                    continue  # not ours to delete recursively; ignored
                else:
                    kind, path = ("temp" if entry.name.endswith(TEMP_SUFFIX) else "stray"), entry.path
                try:
                    remove(path)
                except DiskIOError:
                    continue  # not indexed either way; a later start tries again
                removed[kind] += 1
    ordered = sorted(found.items(), key=lambda item: item[1][0])
    return [(key, size, tags) for key, (_, size, tags, _) in ordered], removed


def _keep_newer(found: dict[ChunkHash, tuple[int, int, Tags, str]], named: tuple[ChunkHash, Tags],
                st: os.stat_result, path: str) -> str | None:
    """Record a chunk file in ``found``; where its key was found already, keep the newer file and return the
    path of the other (to remove), else None. (Two names of one key: only if a crash came between a chunk's
    removal and its store under other tags.)"""
    key, tags = named
    seen = found.get(key)
    if seen is not None and seen[0] >= st.st_mtime_ns:
        return path
    found[key] = (st.st_mtime_ns, st.st_size, tags, path)
    return None if seen is None else seen[3]
