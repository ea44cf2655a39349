"""The disk tier's cache control (kvtier/tiers/control.py): pins, owners and expiries, kept across restarts.

The index's ledger holds them in RAM; this module keeps them in two JSON files (never pickle: they are read back
at start) in ``<root>/<codec>/``, each written atomically (temp file, fsync, rename): ``pins.json`` after every
pin, unpin and clear (small: pins are few), ``tags.json`` (owners and expiries, one entry per owned or expiring
chunk) at ``close``. A crash loses the owners and expiries of entries stored since the last clean close (those
entries come back owned by the default tenant, without expiry), never a pin: each pin is written before it
returns. The files are read after the directory is re-indexed: entries gone meanwhile are ignored, and a damaged
file is logged and ignored (the chunks stay, unpinned or untagged).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from kvtier.base.keys import ChunkHash
from kvtier.tiers.control import Tags, TierUsage
from kvtier.tiers.disk.index import DiskIndex

log = logging.getLogger(__name__)

PINS_NAME = "pins.json"
TAGS_NAME = "tags.json"


class DiskControl:
    """The ``Controlled`` methods of DiskTier (a base class of it): ``_index``, ``name`` and ``control_dir`` (where
    the two files go) are the tier's."""

    _index: DiskIndex
    name: str
    control_dir: str

    def tags_of(self, keys: Sequence[ChunkHash]) -> list[Tags | None]:
        return self._index.tags_of(keys)

    def pin(self, keys: Sequence[ChunkHash]) -> int:
        pinned = self._index.control_pin(keys)
        if pinned:
            self.save_control(tags=False)
        return pinned

    def unpin(self, keys: Sequence[ChunkHash]) -> int:
        freed = self._index.control_unpin(keys)
        if freed:
            self.save_control(tags=False)
        return freed

    def pinned(self, keys: Sequence[ChunkHash]) -> list[bool]:
        return self._index.pinned(keys)

    def clear(self, *, tenant: str | None = None, everything: bool = False) -> int:
        """The directory belongs to one cache, so its namespace is everything it holds."""
        removed = self._index.clear(None if everything else tenant)
        self.save_control(tags=False)
        return removed

    def usage(self) -> TierUsage:
        return self._index.usage()

    def save_control(self, *, tags: bool = True) -> None:
        """Write the pins (and, with ``tags``, the owners and expiries); a failure is logged: they stay in RAM."""
        self._write_control(PINS_NAME, self._index.export_control(tags=False))
        if tags:
            self._write_control(TAGS_NAME, self._index.export_control(pins=False))

    def load_control(self) -> None:
        """Apply the files' owners, expiries and pins to the entries indexed now."""
        for name in (TAGS_NAME, PINS_NAME):  # owners first: restoring a tag re-adds its entry, pins after
            path = os.path.join(self.control_dir, name)
            try:
                with open(path, encoding="utf-8") as fh:
                    data = json.load(fh)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                log.warning("disk tier %s: ignoring unreadable %s: %s", self.name, path, exc)
                continue
            if isinstance(data, dict) and data.get("version") == 1:
                self._index.restore_control(data)
            else:
                log.warning("disk tier %s: ignoring %s of an unknown format", self.name, path)
        log.info("disk tier %s: %d pinned bytes after restart", self.name, self._index.usage().pinned_bytes)

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
