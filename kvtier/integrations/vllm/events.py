"""kvtier's tier events through vLLM's own KV-events mechanism, so routers that read vLLM's events (llm-d,
Dynamo, ``vllm serve --kv-events-config``) see what kvtier's tiers hold.

* Worker side: ``TierEvents`` subscribes to the worker's ``KVCache.events`` and turns them into vLLM's
  ``BlockStored`` / ``BlockRemoved`` with the tier's medium (``EventMedia``), ``locality`` ``REMOTE`` and
  ``ownership="kvtier"`` for a shared store (Redis, Mooncake), ``LOCAL`` and no ownership otherwise (see
  Ownership below), one block per kvtier chunk (``block_size`` is the chunk size, ``block_hashes`` the 32-byte
  chunk keys, ``parent_block_hash`` the previous chunk's key, ``token_ids`` the chunk's tokens; none for a chunk
  moved between tiers). ``extra_keys``
  carries, per block, what else the chunk's key was derived with, in vLLM's own event shape (vLLM's
  ``to_event_extra_keys``): the LoRA name (also in ``lora_name``), ``(mm identifier, offset in the block)`` pairs,
  the cache salt (first block) and the prompt-embeddings digest of the block's span; ``None`` for a block with
  none. So a router that hashes ``token_ids`` itself never takes an image or embeddings prompt's blocks for a
  text prompt's. A run of chunks stored together in one chain (one adapter) becomes one ``BlockStored``. vLLM
  collects them after each step (``get_kv_connector_kv_cache_events``) and ships them to the scheduler with the
  step's output.
* Scheduler side: ``update_connector_output`` hands them to ``SchedulerEvents``; vLLM's scheduler takes them
  (``take_events``) and publishes them with its own KV events (ZMQ, when ``--kv-events-config`` enables it).

Media. Routers weight what they index by medium, and know only some names. llm-d's precise prefix scorer
lower-cases the medium and looks it up in ``kvCacheBackendConfigs`` (``gpu`` 1.0, ``cpu`` 0.8 by default; any
other name once configured). Dynamo's KV router maps ``GPU`` to the device tier, ``CPU`` (and ``CPU_PINNED``) to
host memory, ``DISK`` (and ``NVME``, and ``STORAGE`` in recent versions) to disk, ``SHARED`` (and ``REMOTE``,
``EXTERNAL``) to external storage, and takes a name it does not know for the device tier (its newest versions
drop it). vllm-router credits ``CPU`` as host memory, ``DISK`` and ``STORAGE`` as disk and any other name as the
device. So by default the memory tier is ``CPU`` (vLLM's own ``MEDIUM_CPU``: what all three weight as host
memory), the disk tier ``DISK`` (what every Dynamo version and vllm-router map to disk), a shared store (Redis,
Mooncake) ``SHARED``, and any other tier its name in capitals; ``event_media`` in ``kv_connector_extra_config``
renames them. Two tiers never share a medium, so a consumer's removal of a chunk from one tier never removes it
from another (docs/integrations/vllm-fleet.md gives the consumers' configuration).

Ownership. vLLM sets ``ownership`` on the events of a secondary offloading tier, and consumers read it before
the medium: vllm-router credits any block with an ownership as its external tier (``--kv-penalty-external``),
whatever the medium, and Dynamo's newest KV router drops an event whose ownership it does not know (it knows
only its own ``kvcr``). The memory and disk tiers are the replica's own host memory and disk, as vLLM's CPU
offloading (which publishes no ownership) is: by default they carry none, so their media are weighted as what
they are (vllm-router: ``CPU`` host, ``DISK`` disk). A shared store carries ``ownership="kvtier"``: vllm-router
then credits it as external (without one it would take ``SHARED``, a name it does not know, for the device), and
Dynamo drops it either way (it keeps only ``LOCAL`` events). ``event_ownership`` in ``kv_connector_extra_config``
chooses: ``"shared"`` (the default), ``"all"`` (every tier, as before) or ``"none"``.

Only tensor-parallel rank 0 reports: every rank's chunks carry its rank in their keys, so ranks never hold
the same keys, and the ranks' caches change together.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from kvtier.base.errors import ConfigError
from kvtier.base.keys import InputKind, SpanKey
from kvtier.core.cache import KVCache
from kvtier.core.events import ChunkEvent, ChunkEventKind, EntryKind
from kvtier.integrations.vllm.config import OWNERSHIP_MODES
from kvtier.tiers import SharedStore

OWNERSHIP = "kvtier"
MAX_PENDING = 100_000  # events kept between two steps; beyond, the oldest are dropped
#: The media of kvtier's tiers by default (see the module docstring); shared stores are SHARED, other tiers
#: their names in capitals.
DEFAULT_MEDIA = {"memory": "CPU", "disk": "DISK"}
SHARED_MEDIUM = "SHARED"
#: vLLM's own medium for its device cache: no kvtier tier may take it.
DEVICE_MEDIUM = "GPU"


@dataclass(frozen=True)
class EventMedia:
    """The medium of each of a cache's tiers in the events (``names`` overrides the defaults), which tiers are
    shared stores (``locality="REMOTE"``) and which carry kvtier's ownership (``ownership``: one of
    ``OWNERSHIP_MODES``). Two tiers of one cache never share a medium."""

    names: Mapping[str, str] = field(default_factory=dict)
    shared: frozenset[str] = frozenset()
    ownership_mode: str = "shared"

    def medium(self, tier: str) -> str:
        if tier in self.names:
            return self.names[tier]
        return SHARED_MEDIUM if tier in self.shared else DEFAULT_MEDIA.get(tier) or tier.upper()

    def locality(self, tier: str) -> str:
        return "REMOTE" if tier in self.shared else "LOCAL"

    def ownership(self, tier: str) -> str | None:
        mode = self.ownership_mode
        return OWNERSHIP if mode == "all" or (mode == "shared" and tier in self.shared) else None

    def check(self, tiers: Sequence[str]) -> None:
        """ConfigError unless ``tiers`` get distinct media, none of them vLLM's device medium."""
        media = [self.medium(t) for t in tiers]
        if len(set(media)) != len(media) or DEVICE_MEDIUM in media:
            raise ConfigError(f"kvtier's tiers {list(tiers)} would be published as media {media}: each tier needs "
                              f"its own medium, and {DEVICE_MEDIUM} is vLLM's device cache (event_media)")

    @classmethod
    def of(cls, cache: KVCache, names: Mapping[str, str] | None = None, ownership: str = "shared") -> EventMedia:
        if ownership not in OWNERSHIP_MODES:
            raise ConfigError(f"event_ownership must be one of {OWNERSHIP_MODES}, got {ownership!r}")
        media = cls(dict(names or {}), frozenset(t.name for t in cache.tiers if isinstance(t, SharedStore)),
                    ownership)
        media.check([t.name for t in cache.tiers])
        return media


class KVTierKVEvents(KVConnectorKVEvents):
    """A worker's events of one step (vLLM's container type); no aggregation across workers (see above)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self._events = list(events or [])
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVTierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


#: Entry kinds that are not prefix blocks: never reported to vLLM as stored blocks.
_NOT_BLOCKS = (EntryKind.SEGMENT, EntryKind.SNAPSHOT)


def to_vllm(events: Sequence[ChunkEvent], chunk_size: int, media: EventMedia = EventMedia(),
            block_size: int | None = None) -> list[KVCacheEvent]:
    """vLLM events for a batch of kvtier events, consecutive stores of one chain joined into one, each tier
    under its medium in ``media``.

    ``block_size`` (a divisor of ``chunk_size``; default the chunk size) is the size of the blocks published: a
    chunk becomes ``chunk_size // block_size`` blocks, the last one keyed by the chunk's key and the others by
    keys derived from it (:func:`block_keys`), so the next chunk's parent is still its predecessor's key and a
    removal or move names every block. Consumers that index only blocks of their own size (vllm-router's
    ``--kv-event-block-size``) need vLLM's block size here.

    Segments (blending) and state snapshots are not prefix blocks a router can match a prompt against: their
    stores are left out. Removals and demotions carry no entry kind (a blob does not record it) and pass.
    """
    block = block_size or chunk_size
    out: list[KVCacheEvent] = []
    for event in events:
        if event.entry in _NOT_BLOCKS:
            continue
        medium, locality, owner = media.medium(event.tier), media.locality(event.tier), media.ownership(event.tier)
        hashes = block_keys(bytes(event.key), chunk_size // block)
        if event.kind is ChunkEventKind.REMOVED:
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, locality=locality, ownership=owner))
            continue
        tokens = np.frombuffer(event.tokens, "<u4").tolist() if event.tokens is not None else []
        start = (event.position or 0) * chunk_size
        lora, _ = event_extra_keys(event.extras, start)
        extras = [event_extra_keys(event.extras, start + j * block)[1] for j in range(len(hashes))]
        extra = None if all(e is None for e in extras) else extras
        last = out[-1] if out else None
        if (isinstance(last, BlockStored) and last.medium == medium and event.parent is not None
                and last.block_hashes[-1] == event.parent and len(last.token_ids) == block * len(last.block_hashes)
                and len(tokens) == chunk_size and last.lora_name == lora):
            last.block_hashes.extend(hashes)
            last.token_ids.extend(tokens)
            if extra is not None or last.extra_keys is not None:
                last.extra_keys = (last.extra_keys or [None] * (len(last.block_hashes) - len(hashes))) + \
                    (extra or [None] * len(hashes))
            continue
        out.append(BlockStored(block_hashes=hashes,
                               parent_block_hash=bytes(event.parent) if event.parent is not None else None,
                               token_ids=tokens, block_size=block, lora_id=None, medium=medium,
                               lora_name=lora, extra_keys=extra,
                               locality=locality, ownership=owner))
    return out


def block_keys(chunk_key: bytes, blocks: int) -> list[bytes]:
    """The keys of a chunk's ``blocks`` published blocks: the chunk's own key last (the next chunk names it as
    parent), before it ``sha256(chunk key || index)`` for each earlier block (32 bytes, as the chunk keys)."""
    return [hashlib.sha256(chunk_key + i.to_bytes(2, "big")).digest() for i in range(blocks - 1)] + [chunk_key]


_EVENT_ORDER = (InputKind.LORA, InputKind.MULTIMODAL, InputKind.CACHE_SALT, InputKind.PROMPT_EMBEDS)


def event_extra_keys(spans: Sequence[SpanKey], block_start: int) -> tuple[str | None, tuple | None]:
    """A chunk's span keys as vLLM publishes a block's extra keys (module docstring): ``(lora_name, keys)``,
    either None when absent."""
    if not spans:
        return None, None
    lora, keys = None, []
    for kind in _EVENT_ORDER:
        for span in spans:
            if span.kind is not kind:
                continue
            if kind is InputKind.LORA:
                lora = span.value.decode(errors="replace")
                keys.append(lora)
            elif kind is InputKind.MULTIMODAL:
                keys.append((span.value.decode(errors="replace"), span.start - block_start))
            elif kind is InputKind.CACHE_SALT:
                keys.append(span.value.decode(errors="replace"))
            else:
                keys.append(span.value)
    return lora, tuple(keys) or None


class TierEvents:
    """Worker side: collects a cache's events between steps (they come from the save thread, the disk tier's
    threads and the forward path alike)."""

    def __init__(self, cache: KVCache, media: Mapping[str, str] | None = None, block_size: int | None = None,
                 ownership: str = "shared") -> None:
        """``media``: tier name -> medium, over the defaults (ConfigError if two tiers would share one);
        ``block_size``: the published blocks' size (:func:`to_vllm`; default the chunk size); ``ownership``:
        which tiers' events carry kvtier's ownership (``OWNERSHIP_MODES``)."""
        self._chunk_size = cache.chunk_size
        self._block_size = block_size
        self._media = EventMedia.of(cache, media, ownership)
        self._pending: list[ChunkEvent] = []
        self._lock = threading.Lock()
        self._unsubscribe = cache.events.subscribe(self._collect)

    def _collect(self, events: Sequence[ChunkEvent]) -> None:
        with self._lock:
            self._pending.extend(events)
            if len(self._pending) > MAX_PENDING:
                del self._pending[: len(self._pending) - MAX_PENDING]

    def take(self) -> KVTierKVEvents | None:
        """The events since the last call, as vLLM events, or None."""
        with self._lock:
            pending, self._pending = self._pending, []
        return KVTierKVEvents(to_vllm(pending, self._chunk_size, self._media, self._block_size)) if pending else None

    def close(self) -> None:
        self._unsubscribe()


class SchedulerEvents:
    """Scheduler side: what the workers sent, until vLLM's scheduler takes it."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def add(self, events: KVConnectorKVEvents | None) -> None:
        if isinstance(events, KVTierKVEvents):
            self._events.extend(events.get_all_events())

    def take(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        return events
