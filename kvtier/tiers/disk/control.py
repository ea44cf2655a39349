"""The disk tier's cache control (kvtier/tiers/control.py): pins, owners and expiries, kept across restarts.

The index's ledger holds them in RAM. Owners and expiries are written with each chunk, in its file's name
(files.py), by the same atomic rename, so they survive any crash, and come back with the names when the
directory is re-indexed. Pins are kept in ``<root>/<codec>/pins.json`` (JSON, never pickle: it is read back at
start), written atomically (temp file, fsync, rename) after every pin, unpin and clear (small: pins are few), so
a crash never loses a pin either. A damaged file is logged and ignored (the chunks stay, unpinned).

Older versions kept owners and expiries in ``tags.json``, written at close: at start its entries are moved into
the names of the files they describe (a rename each; an entry whose file is gone, or named with tags already, is
ignored) and the file is removed, so old directories keep their tags.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from kvtier.base.keys import ChunkHash
from kvtier.tiers.control import Tags, TierUsage
from kvtier.tiers.disk.files import ChunkPaths
from kvtier.tiers.disk.index import DiskIndex
from kvtier.tiers.disk.names import parse_key

log = logging.getLogger(__name__)

PINS_NAME = "pins.json"
TAGS_NAME = "tags.json"


class DiskControl:
    """The ``Controlled`` methods of DiskTier (a base class of it): ``_index``, ``name``, ``paths`` and
    ``control_dir`` (where the files go) are the tier's."""

    _index: DiskIndex
    name: str
    control_dir: str
    paths: ChunkPaths

    def tags_of(self, keys: Sequence[ChunkHash]) -> list[Tags | None]:
        return self._index.tags_of(keys)

    def pin(self, keys: Sequence[ChunkHash]) -> int:
        pinned = self._index.control_pin(keys)
        if pinned:
            self.save_control()
        return pinned

    def unpin(self, keys: Sequence[ChunkHash]) -> int:
        freed = self._index.control_unpin(keys)
        if freed:
            self.save_control()
        return freed

    def pinned(self, keys: Sequence[ChunkHash]) -> list[bool]:
        return self._index.pinned(keys)

    def clear(self, *, tenant: str | None = None, everything: bool = False) -> int:
        """The directory belongs to one cache, so its namespace is everything it holds."""
        removed = self._index.clear(None if everything else tenant)
        self.save_control()
        return removed

    def usage(self) -> TierUsage:
        return self._index.usage()

    def save_control(self) -> None:
        """Write the pins; a failure is logged: they stay in RAM."""
        self._write_control(PINS_NAME, self._index.export_control(tags=False))

    def load_control(self) -> None:
        """Move an older version's ``tags.json`` into the files' names, then apply the pins to the entries indexed
        now (owners first: restoring a tag re-adds its entry)."""
        tags = self._read_control(TAGS_NAME)
        if tags is not None:
            self._migrate_tags(tags)
        pins = self._read_control(PINS_NAME)
        if pins is not None:
            self._index.restore_control({"version": 1, "pinned": pins.get("pinned")})
        log.info("disk tier %s: %d pinned bytes after restart", self.name, self._index.usage().pinned_bytes)

    def _read_control(self, name: str) -> dict[str, object] | None:
        path = os.path.join(self.control_dir, name)
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("disk tier %s: ignoring unreadable %s: %s", self.name, path, exc)
            return None
        if isinstance(data, dict) and data.get("version") == 1:
            return data
        log.warning("disk tier %s: ignoring %s of an unknown format", self.name, path)
        return None

    def _migrate_tags(self, data: dict[str, object]) -> None:
        """Rename the files ``tags.json`` (an older version's) gives owners or expiries, then remove it."""
        entries = data.get("tags")
        moved = 0
        for hexkey, value in (entries.items() if isinstance(entries, dict) else ()):
            key, tags = parse_key(hexkey) if isinstance(hexkey, str) else None, _tags(value)
            if key is not None and tags is not None:
                moved += self._index.retag(key, tags, lambda new, key=key: self._rename(key, new))
        try:
            os.unlink(os.path.join(self.control_dir, TAGS_NAME))
        except OSError as exc:
            log.warning("disk tier %s: cannot remove the old %s: %s", self.name, TAGS_NAME, exc)
        log.info("disk tier %s: moved the owners and expiries of %d chunks into their names", self.name, moved)

    def _rename(self, key: ChunkHash, tags: Tags) -> bool:
        try:
            os.rename(self.paths.path(key), self.paths.path(key, tags))
        except OSError as exc:
            log.warning("disk tier %s: cannot rename chunk %s to record its owner: %s", self.name, key.hex(), exc)
            return False
        return True

    def _write_control(self, name: str, data: dict[str, object]) -> None:
        """Write ``data`` atomically; with nothing to record the file is removed, so a tier whose entries carry
        no pins, owners or expiries leaves only its chunks behind (and an emptied state is not restored)."""
        path = os.path.join(self.control_dir, name)
        if not any(value for field, value in data.items() if field != "version"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("disk tier %s: cannot remove %s: %s", self.name, path, exc)
            return
        temp = f"{path}.tmp"
        try:
            with open(temp, "w", encoding="utf-8") as fh:
                json.dump(data, fh, separators=(",", ":"))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temp, path)
        except OSError as exc:
            log.warning("disk tier %s: cannot write %s: %s", self.name, path, exc)


def _tags(value: object) -> Tags | None:
    """``[tenant, expires_at]`` as ``tags.json`` held it; None if malformed."""
    if not (isinstance(value, list) and len(value) == 2):
        return None
    tenant, when = value
    if not isinstance(tenant, str) or isinstance(when, bool) or not (when is None or isinstance(when, int | float)):
        return None
    return Tags(tenant, when)
