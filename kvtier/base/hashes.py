"""The type every stored entry is keyed by. Apart from keys.py, which derives chunk hashes, so that modules
deriving other keys from them (state.py's snapshot keys) need not import the namespace and its spec."""

from typing import NewType

ChunkHash = NewType("ChunkHash", bytes)
"""A 32-byte SHA-256 digest naming one chunk of KV in one namespace, after one exact token history."""

HASH_BYTES = 32

__all__ = ["HASH_BYTES", "ChunkHash"]
