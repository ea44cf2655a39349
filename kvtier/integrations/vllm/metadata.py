"""What the scheduler tells workers each step: which chunks to load into which blocks, which to save.

Token ids travel as little-endian u32 bytes (compact under vLLM's own serialisation between processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.base.keys import Tokens, token_array


def pack_tokens(tokens: Tokens) -> bytes:
    return token_array(tokens).tobytes()


def unpack_tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4")


@dataclass(frozen=True)
class LoadSpec:
    """Load the chunks covering tokens ``[first_token, end)`` into ``block_ids``.

    ``tokens`` are the request's tokens up to the end of the last chunk to read (whole chunks).
    Blocks below ``first_token`` (vLLM's own prefix-cache hit) are not written. Whatever of
    ``[first_token, end)`` does not arrive intact is reported as load errors, block by block.
    """

    req_id: str
    tokens: bytes
    salt: bytes
    block_ids: list[int]
    first_token: int
    end: int


@dataclass(frozen=True)
class SaveSpec:
    """Store the full chunks of ``tokens`` (all computed) from ``block_ids``; the blocks stay allocated
    until the worker reports ``req_id`` in ``get_finished``."""

    req_id: str
    tokens: bytes
    salt: bytes
    block_ids: list[int]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
