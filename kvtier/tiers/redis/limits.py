"""The limits of split values (split.py) that the Redis tier's config is checked against, apart from the
split code itself so the config needs none of the tier's machinery."""

#: Redis's default proto-max-bulk-len: no single argument may be larger.
REDIS_MAX_BULK = 512 << 20
#: Bytes of a split value's header (split.py packs it).
HEADER_BYTES = 32
#: Bounds a head must keep whatever it declares, checked before any of its parts is asked for: a planted head
#: declaring a value in 1-byte parts would otherwise cost a command per byte. Writers never go beyond them
#: (``max_part_bytes`` >= MIN_PART_BYTES; a value needing more than MAX_PARTS parts is not stored).
MIN_PART_BYTES = 4096
MAX_PARTS = 4096

__all__ = ["HEADER_BYTES", "MAX_PARTS", "MIN_PART_BYTES", "REDIS_MAX_BULK"]
