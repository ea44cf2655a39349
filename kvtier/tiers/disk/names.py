"""The names of the disk tier's chunk files: a chunk's key, and its owner and expiry (files.py has the layout)."""

from __future__ import annotations

import math
import re

from kvtier.base.keys import HASH_BYTES, ChunkHash
from kvtier.tiers.control import DEFAULT_TAGS, Tags

_TENANT = re.compile(r"[0-9a-f]{1,64}")
_EXPIRY = re.compile(r"[0-9]{1,19}")  # milliseconds since the epoch: always fewer digits than an int64 holds


def chunk_name(key: ChunkHash, tags: Tags = DEFAULT_TAGS) -> str:
    """``<hex>`` for the default tags; else ``<hex>.<tenant>.<expiry>`` (either may be empty). A tenant that is
    not a tag of hex digits (``tenant_tag`` makes them) or an expiry past what 19 digits hold is not named: such
    an entry is stored as the default tenant's or without expiry after a restart, as before tags were named."""
    tenant = tags.tenant if _TENANT.fullmatch(tags.tenant) else ""
    when = tags.expires_at
    expiry = str(round(when * 1000)) if when is not None and math.isfinite(when) and 0 <= when < 1e15 else ""
    return key.hex() + (f".{tenant}.{expiry}" if tenant or expiry else "")


def parse_name(name: str) -> tuple[ChunkHash, Tags] | None:
    """The key and tags a chunk file's name says (``chunk_name``'s inverse); None for any other name."""
    key = parse_key(name[: 2 * HASH_BYTES])
    rest = name[2 * HASH_BYTES :]
    if key is None:
        return None
    if not rest:
        return key, DEFAULT_TAGS
    parts = rest.split(".")
    if len(parts) != 3 or parts[0] or not (parts[1] or parts[2]):
        return None
    tenant, expiry = parts[1], parts[2]
    if (tenant and not _TENANT.fullmatch(tenant)) or (expiry and not _EXPIRY.fullmatch(expiry)):
        return None
    return key, Tags(tenant, int(expiry) / 1000 if expiry else None)


def parse_key(name: str) -> ChunkHash | None:
    if len(name) != 2 * HASH_BYTES:
        return None
    try:
        return ChunkHash(bytes.fromhex(name))
    except ValueError:
        return None
