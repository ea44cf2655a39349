"""The disk tier's cache control (kvtier/tiers/control.py): pins, owners and expiries, kept across restarts.

The index's ledger holds them in RAM; this module keeps them in ``<root>/<codec>/control.json`` (JSON, never
pickle: it is read back at start), written atomically (temp file, fsync, rename) after every pin and unpin and
at ``close``. Owners and expiries of entries stored since the last write are lost by a crash (those entries come
back owned by the default tenant, without expiry); pins are not, since each pin is written before it returns.
The file is read after the directory is re-indexed: entries gone meanwhile are ignored, and a damaged file is
logged and ignored (the chunks stay, unpinned).
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

CONTROL_NAME = "control.json"


class DiskControl:
    """The ``Controlled`` methods of DiskTier (a base class of it): ``_index``, ``name`` and ``control_path`` are
    the tier's."""

    _index: DiskIndex
    name: str
    control_path: str

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
        """Write the pins, owners and expiries (a failure is logged: they stay in RAM)."""
        data = self._index.export_control()
        temp = f"{self.control_path}.tmp"
        try:
            with open(temp, "w", encoding="utf-8") as fh:
                json.dump(data, fh, separators=(",", ":"))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temp, self.control_path)
        except OSError as exc:
            log.warning("disk tier %s: cannot write %s: %s", self.name, self.control_path, exc)

    def load_control(self) -> None:
        """Apply the file's pins, owners and expiries to the entries indexed now."""
        try:
            with open(self.control_path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("disk tier %s: ignoring unreadable %s: %s", self.name, self.control_path, exc)
            return
        if isinstance(data, dict) and data.get("version") == 1:
            self._index.restore_control(data)
            log.info("disk tier %s: restored %d pinned bytes", self.name, self._index.usage().pinned_bytes)
        else:
            log.warning("disk tier %s: ignoring %s of an unknown format", self.name, self.control_path)
