"""Byte sizes as people write them ("512MiB", "4GiB") and the longest retention time: limits read without importing
any tier (the router needs them)."""

from __future__ import annotations

import re

from kvtier.base.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """``"4GiB"`` -> 4294967296; ints pass through. Raises ConfigError for anything else."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must not be negative: {value}")
        return value
    match = _SIZE.match(str(value).replace("_", ""))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (try 512MiB, 4GiB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


#: The longest retention time a store may ask for (about 100 years): within what every tier can represent (Redis
#: takes milliseconds as a 64-bit integer; a float clock loses no second there), so a TTL that passes this check
#: never fails in a tier. Every server checks request TTLs against it (a 400) and ``expires_at`` here.
MAX_TTL_S = 100 * 365 * 86400
