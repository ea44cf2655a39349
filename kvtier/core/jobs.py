"""What the pipeline (pipeline.py) is asked to do and what it answers: a load or a store job, their results, the
tuning of its windows, and the optional capabilities of sinks and sources it checks, each a named protocol."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from kvtier.base.errors import BlobError, ConfigError, KVTierError
from kvtier.base.keys import NO_EXTRAS, ChunkHash, ExtraKeys
from kvtier.tiers import Tier
from kvtier.tiers.control import DEFAULT_TAGS, Tags


@dataclass(frozen=True)
class PipelineTuning:
    """How a Pipeline cuts its work into windows and overlaps them. Every count and size is at least 1
    (``read_ahead`` at least 0).

    * ``window_bytes``: KV bytes per task, at least: big enough that a task's overhead is noise, small enough
      that a few windows are in flight for a prefix of a hundred MiB.
    * ``max_window_bytes``: KV bytes per task, at most: a long prefix loaded from a tier with
      ``large_load_windows`` gets windows up to this size while every worker still has ``windows_per_worker``
      of them (``Pipeline.windows``).
    * ``decoders``: windows decoding at once, one per core by default (more only contend for the cores and the
      GIL).
    * ``read_ahead``: windows read ahead of the decoders, so a slow tier's reads overlap the decodes; each holds
      its read buffers until decoded.
    * ``store_ahead``: windows encoded ahead of the one being written on store (bounds the encoded payloads held).
    * ``device_window_bytes``: KV bytes per window of a store from a source on a GPU into a tier in this
      process's memory: a window's chunks are gathered in GPU memory before their copies to the host run, and
      at most three windows are there at once (one being copied, one gathered ahead, one being gathered).
    """

    window_bytes: int = 16 << 20
    max_window_bytes: int = 64 << 20
    windows_per_worker: int = 3
    decoders: int = field(default_factory=lambda: os.cpu_count() or 1)
    read_ahead: int = 3
    store_ahead: int = 4
    device_window_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        sizes = (self.window_bytes, self.max_window_bytes, self.windows_per_worker, self.decoders, self.store_ahead,
                 self.device_window_bytes)
        if min(sizes) < 1 or self.read_ahead < 0:
            raise ConfigError(f"pipeline tuning needs sizes and counts >= 1 (read_ahead >= 0): {self}")

    @property
    def workers(self) -> int:
        """Tasks in flight: the decoders and the windows read ahead of them."""
        return self.decoders + self.read_ahead


@dataclass(frozen=True)
class Entry:
    """One entry to write into a tier: its key, the token ids its blob records (and every read checks), and
    its tensor (a chunk or a segment of canonical KV, or one kind of a state snapshot)."""

    key: ChunkHash
    tokens: np.ndarray
    tensor: torch.Tensor


class Promoter(Protocol):
    """Where a load hands the chunks it found below the first tier (``kvtier.core.chain.TierChain``)."""

    def promote(self, found_in: int, entries: Sequence[Entry]) -> None:
        """Copy ``entries``, found in tier ``found_in``, into every faster tier. Called from a worker inside the
        slower tier's ``get`` block, once per window or run of chunks: the tensors may view that tier's memory
        or a scratch buffer, valid only during the call."""


@runtime_checkable
class LendingSink(Protocol):
    """Optional KVSink capability (kvtier.core.cache): CPU memory to decode chunks straight into. It may be left
    holding the bytes of a chunk that failed verification (a raw chunk is checksummed while it is copied there):
    only the chunks the load reports as arrived are valid."""

    def destination(self, start: int, end: int) -> torch.Tensor | None: ...


@runtime_checkable
class SettlingSink(Protocol):
    """Optional KVSink capability: a sink whose ``write`` may go on reading a chunk until ``settle()``."""

    def settle(self) -> None: ...


@runtime_checkable
class ConcurrentSink(Protocol):
    """Optional KVSink capability: ``concurrent_writes`` True where disjoint token ranges may be written from
    several threads at once."""

    concurrent_writes: bool


@runtime_checkable
class DeviceSource(Protocol):
    """Optional KVSource capability: ``device``, where its chunks are (the CPU for sources without it)."""

    device: torch.device | str


def source_device(source: object) -> torch.device:
    """Where ``source``'s chunks are."""
    return torch.device(source.device) if isinstance(source, DeviceSource) else torch.device("cpu")


@dataclass(frozen=True)
class LoadJob:
    """One load: chunk ``keys[i]`` is in ``tiers[where[i]]`` (None: not loaded) and is tokens
    ``[i * chunk_size, (i + 1) * chunk_size)`` of ``token_ids`` and of ``sink`` (a KVSink). Chunks found below
    the first tier go to ``promoter`` (None: no promotion)."""

    tiers: Sequence[Tier]
    keys: Sequence[ChunkHash]
    where: Sequence[int | None]
    token_ids: np.ndarray
    sink: object
    promoter: Promoter | None = None


@dataclass(frozen=True)
class Corrupt:
    """A chunk that failed verification in ``tiers[tier]``: a miss, for the chain to count and delete."""

    tier: int
    key: ChunkHash
    error: BlobError


@dataclass(frozen=True)
class Failure:
    """A tier that raised on ``op``: for the chain to count."""

    tier: Tier
    op: str
    error: KVTierError


@dataclass(frozen=True)
class LoadResult:
    """What a load did: True per chunk that arrived verified, the chunks that failed verification and the
    tiers that failed."""

    ok: list[bool]
    corrupt: list[Corrupt]
    failures: list[Failure]


@dataclass(frozen=True)
class StoreJob:
    """Chunks to store: chunk ``i`` is ``keys[i]``, tokens ``[i * chunk_size, (i + 1) * chunk_size)`` of
    ``token_ids`` and of ``source`` (a KVSource); ``tags``: their owner and expiry, recorded by the tiers that
    keep them (kvtier/tiers/control.py); ``extras``: the extra keys the keys were derived with (their spans
    overlapping a chunk go with its stored event)."""

    keys: Sequence[ChunkHash]
    token_ids: np.ndarray
    source: object
    tags: Tags = DEFAULT_TAGS
    extras: ExtraKeys = NO_EXTRAS


@dataclass(frozen=True)
class PutResult:
    """The chunk indices a tier newly stored, and the failure that ended the store early (None: it did not)."""

    done: list[int]
    failure: Failure | None = None
