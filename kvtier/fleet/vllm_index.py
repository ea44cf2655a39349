"""What one vLLM replica holds, per medium, in the router's own keys, recomputed from its KV events' token ids.

vLLM's block hashes are not kvtier's keys (they depend on vLLM's hash function, seed and version, and the
connector's forwarded tier events carry kvtier's chunk keys instead). As llm-d does, the router recomputes keys
of its own from the token ids every ``BlockStored`` carries:

* the router's keys for a replica are kvtier chain keys (kvtier.base.keys) in ``vllm_namespace(block_size)``,
  one per ``block_size`` tokens, where ``block_size`` is the replica's vLLM block size: a request's keys are
  ``vllm_namespace(block_size).chunk_hashes(prompt)``, and the prefix a replica holds is counted in blocks;
* a ``BlockStored`` of ``n`` blocks of ``B`` tokens (``B`` a multiple of ``block_size``: vLLM's own events have
  ``B = block_size``, the kvtier connector's have ``B`` = its chunk size) continues the chain of its parent: the
  router keys of its tokens are ``chunk_hashes(parent's last router key, token_ids, block_size)`` (the
  namespace's root when it has no parent). Each of the event's block hashes is remembered with its ``B /
  block_size`` router keys, so a later event naming it as parent, or removing it, is understood;
* a ``BlockStored`` without token ids (a chunk the connector moved between tiers) or a ``BlockRemoved`` names
  blocks by hash: their remembered router keys are added to or removed from that medium;
* ``AllBlocksCleared`` (vLLM's prefix cache reset) empties the device media (``GPU``).

What is not indexed, and counted (``counts``): a store whose parent hash is unknown (``orphan``: its chain
started before the router listened and was not replayed), one with a LoRA adapter or extra keys (multimodal
inputs, a cache salt: ``unindexed``; the router hashes prompts without them, so such blocks could never match),
one whose token ids are not ``len(block_hashes) x B`` or whose ``B`` is not a multiple of ``block_size``
(``malformed``), a removal or token-less store of an unknown hash (``unknown``).

Bounds: residency lives in a ``ReplicaHoldings`` (kvtier.fleet.index: media are its tiers, capped keys, "first
learnt stays"; a medium the replica was not configured with is dropped and counted there). The hash-to-keys map
holds at most as many router keys as the holdings' cap; beyond, the least recently stored block is forgotten:
its keys leave the media that held them (the router stops believing what it can no longer follow).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.base.keys import ChunkHash, Namespace, chunk_hashes
from kvtier.base.layout import KVSpec
from kvtier.events.wire import Batch, WireEvent
from kvtier.fleet.index import PreparedSnapshot, ReplicaHoldings, ShardedKeys
from kvtier.fleet.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, VllmBatch

#: vLLM's own name for its device cache (``vllm.distributed.kv_events.MEDIUM_GPU``; on CPU builds too).
DEVICE_MEDIUM = "GPU"
#: The medium of the kvtier connector's shared stores (kvtier.integrations.vllm.events).
SHARED_MEDIUM = "SHARED"
_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8")


def vllm_namespace(block_size: int) -> Namespace:
    """The router's key space for vLLM replicas of block size ``block_size`` (only compared with itself)."""
    return Namespace("kvtier-route-vllm-events", _SPEC, block_size)


@dataclass
class _Block:
    keys: tuple[ChunkHash, ...]
    media: set[str] = field(default_factory=set)


class VllmReplicaIndex:
    """Feeds one vLLM replica's ``ReplicaHoldings`` from its decoded event batches (``apply``)."""

    def __init__(self, holdings: ReplicaHoldings, block_size: int, media: Sequence[str],
                 device_media: Sequence[str] = (DEVICE_MEDIUM,), shared: Mapping[str, str] | None = None,
                 count: Callable[[str], None] = lambda what: None) -> None:
        """``media``: the replica's media, fastest first (events naming others are dropped by the holdings);
        ``shared``: medium -> store id, for media that are a store other replicas read too (the fleet's
        ``SharedStores``: a block any replica stored there counts for all replicas naming the same id);
        ``count(what)`` is told of each block not indexed (the reasons above) and each evicted."""
        self.holdings, self.namespace = holdings, vllm_namespace(block_size)
        self.block_size, self.media, self.device_media = block_size, tuple(media), tuple(device_media)
        self.shared = dict(shared or {})
        self.max_keys = holdings.max_keys
        self.counts: dict[str, int] = {}
        self._counted = count
        self._blocks: OrderedDict[bytes | int, _Block] = OrderedDict()
        self._mapped = 0  # router keys in self._blocks

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n
        if what != "stored":
            self._counted(what)

    def reset(self) -> None:
        """Forget everything: the replica's state is unknown (start, restart, a gap replay could not fill)."""
        self._blocks.clear()
        self._mapped = 0
        local = {m: ShardedKeys(self.max_keys) for m in self.media if m not in self.shared}
        shared = {m: (self.shared[m], []) for m in self.media if m in self.shared}
        self.holdings.reset(PreparedSnapshot(list(self.media), local, shared, 0))

    def cost(self, event: Event) -> int:
        """About how many router keys applying ``event`` touches, at least 1: what a subscriber budgets per
        event-loop turn (a batch applied in pieces gives the same index as applied whole)."""
        return max(1, len(getattr(event, "block_hashes", ())), len(getattr(event, "token_ids", ())) // self.block_size)

    def apply(self, batch: VllmBatch) -> None:
        out: list[WireEvent] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event, out)
            elif isinstance(event, BlockRemoved):
                medium = event.medium or DEVICE_MEDIUM
                for block_hash in event.block_hashes:
                    block = self._blocks.get(block_hash)
                    if block is None:
                        self._count("unknown")
                        continue
                    block.media.discard(medium)
                    out.extend(WireEvent(False, medium, bytes(k)) for k in block.keys)
            elif isinstance(event, AllBlocksCleared):
                self._flush(out)
                for medium in self.device_media:
                    self.holdings.clear(medium)
                for block in self._blocks.values():
                    block.media.difference_update(self.device_media)
        self._flush(out)

    def _flush(self, out: list[WireEvent]) -> None:
        if out:
            self.holdings.apply(Batch("vllm", 0, 0.0, list(out)))
            out.clear()

    def _stored(self, event: BlockStored, out: list[WireEvent]) -> None:
        medium = event.medium or DEVICE_MEDIUM
        if event.lora_name or event.lora_id or (event.extra_keys and any(k is not None for k in event.extra_keys)):
            self._count("unindexed")
            return
        if not event.token_ids:  # a block moved between media: known by its hash alone
            for block_hash in event.block_hashes:
                block = self._blocks.get(block_hash)
                if block is None:
                    self._count("unknown")
                    continue
                self._touch(block_hash, block, medium, out)
            return
        size, n = event.block_size, len(event.block_hashes)
        if size % self.block_size or len(event.token_ids) != size * n:
            self._count("malformed")
            return
        if event.parent_block_hash is None:
            root = self.namespace.root
        else:
            parent = self._blocks.get(event.parent_block_hash)
            if parent is None:
                self._count("orphan")
                return
            root = parent.keys[-1]
        keys = chunk_hashes(root, event.token_ids, self.block_size)
        per = size // self.block_size
        for i, block_hash in enumerate(event.block_hashes):
            own = tuple(keys[i * per:(i + 1) * per])
            block = self._blocks.get(block_hash)
            if block is None or block.keys != own:
                if block is not None:
                    self._mapped -= len(block.keys)
                block = self._blocks[block_hash] = _Block(own, block.media if block is not None else set())
                self._mapped += len(own)
            self._touch(block_hash, block, medium, out)
        self._count("stored", n)
        self._evict(out)

    def _touch(self, block_hash: bytes | int, block: _Block, medium: str, out: list[WireEvent]) -> None:
        block.media.add(medium)
        self._blocks.move_to_end(block_hash)
        out.extend(WireEvent(True, medium, bytes(k)) for k in block.keys)

    def _evict(self, out: list[WireEvent]) -> None:
        while self._mapped > self.max_keys and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self._mapped -= len(block.keys)
            self._count("evicted")
            for medium in block.media:
                out.extend(WireEvent(False, medium, bytes(k)) for k in block.keys)

    def blocks(self) -> int:
        """Blocks whose hash the index can resolve."""
        return len(self._blocks)
