"""Who may use a replica's event sockets: the router's CURVE key pair, and the replica's allow-list of them.

A replica's event sockets (kvtier.events.publisher) are CURVE servers; the allow-list decides, at the CURVE
handshake (ZAP), which clients may complete it. A client refused there never sends a subscription or a
snapshot request, so what it can make the replica hold is one handshake's state, freed when it is refused.
libzmq's XPUB keeps every subscription a connected peer sends (in manual mode too, to unsubscribe it when
the peer leaves), so a peer that may connect at all can grow the replica without bound: the allow-list is the
bound.

* ``kvtier route`` has one key pair, in a file (``--events-key``; default ``default_key_file()``, created on
  first use, 0600 in this user's 0700 ``kvtier-<uid>`` folder of the system temp directory).
* ``kvtier serve`` allows the public keys it is given (``--events-allow``), and the key in
  ``default_key_file()`` when it exists: a router and replicas run by the same user on one host need no
  configuration, and another user's process cannot write that file. ``allow_any`` restores the old
  behaviour (any client key), at the cost above.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from kvtier.base.errors import ConfigError

KEY_CHARS = 40  #: a CURVE key in Z85


def default_key_file() -> Path:
    """This user's router key file on this host (shared by every ``kvtier route`` the user runs here)."""
    return Path(tempfile.gettempdir()) / f"kvtier-{os.getuid()}" / "route-events.key"


def parse_key(text: str) -> bytes:
    """A Z85 CURVE key (40 characters) as ZMQ takes it; ConfigError for anything else."""
    key = text.strip()
    try:
        if len(key) == KEY_CHARS and len(z85.decode(key)) == 32:
            return key.encode()
    except (ValueError, KeyError, TypeError):
        pass
    raise ConfigError(f"not a CURVE public key (40 characters of Z85): {text[:60]!r}")


def _private_folder(folder: Path, create: bool) -> bool:
    """Whether ``folder`` is a real folder of this user closed to everyone else (made so if ``create``)."""
    if create:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        if create:
            raise ConfigError(f"{folder} is not a folder owned by this user: refusing it for the events key")
        return False
    if stat.S_IMODE(info.st_mode) != 0o700:
        if not create:
            return False
        os.chmod(folder, 0o700)
    return True


def load_or_create(path: Path) -> tuple[bytes, bytes]:
    """The key pair (public, secret) whose secret key ``path`` holds; a new pair is written there (0600, at
    once: routers starting together agree on one) when the file does not exist."""
    _private_folder(path.parent, create=path == default_key_file())
    if not path.exists():
        public, secret = zmq.curve_keypair()
        spare = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secret + b"\n")
        try:
            os.link(spare, path)  # fails if another router was first: its pair stands
        except FileExistsError:
            pass
        finally:
            os.unlink(spare)
    secret = parse_key(path.read_text())
    return zmq.curve_public(secret), secret


@dataclass(frozen=True)
class Allow:
    """Client keys a replica's event sockets accept: ``keys`` (Z85), the key of ``local_key_file`` if it exists
    (re-read when it changes, so a router started after the replica is accepted), or any with ``any``."""

    keys: tuple[str, ...] = ()
    local_key_file: str | None = str(default_key_file())
    any: bool = False

    def __post_init__(self) -> None:
        for key in self.keys:
            parse_key(key)


class Allowed:
    """``allows(public)`` answers for one ``Allow``, with the local file's key read once per change."""

    def __init__(self, allow: Allow) -> None:
        self._allow = allow
        self._keys = {z85.decode(k) for k in allow.keys}
        self._local: tuple[float, bytes | None] = (-1.0, None)

    def allows(self, public: bytes) -> bool:
        """``public``: the client's key, 32 raw bytes (as ZAP gives it)."""
        return self._allow.any or public in self._keys or (public == self._local_key() and public is not None)

    def _local_key(self) -> bytes | None:
        if self._allow.local_key_file is None:
            return None
        path = Path(self._allow.local_key_file)
        try:
            if not _private_folder(path.parent, create=False):
                return None
            info = path.stat()
            if info.st_mtime != self._local[0]:
                key = z85.decode(zmq.curve_public(parse_key(path.read_text())))
                self._local = (info.st_mtime, key)
        except (OSError, ConfigError, ValueError):
            return None
        return self._local[1]
