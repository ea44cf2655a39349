"""The event stream on the wire: msgpack (msgspec structs, decoded against their types; never pickle).

Published messages are ZMQ multipart ``[TOPIC, seq (8 bytes, big-endian), Batch]``, as vLLM publishes its KV
events. ``seq`` counts batches from 0 per publisher ``epoch`` (a random id drawn at start), so a subscriber
sees a restart (new epoch) and a lost batch (a gap) and then asks the control socket for a ``Snapshot``:
every tier's keys as of batch ``seq``. Empty batches are heartbeats.

Control socket (ZMQ ROUTER on the replica, DEALER on the router): request ``[b"snapshot"]``, reply
``[b"snapshot", Snapshot]``; anything else gets ``[b"error", message]``.

Decoding is strict: a key is exactly 32 bytes, a tier name at most 64 characters, a snapshot names at most
``MAX_TIERS`` tiers, every field has its type; a message that does not decode raises ``WireError`` and is
dropped by the caller. Both sockets speak CURVE (see publisher.py): the replica's public key is in its
``/kvtier/info``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvtier.base.errors import KVTierError
from kvtier.base.keys import HASH_BYTES, ChunkHash, Namespace
from kvtier.base.layout import KVSpec, dtype_from_name, dtype_name
from kvtier.core.events import ChunkEvent, ChunkEventKind, TierHolding

SNAPSHOT_REQUEST = b"snapshot"
TOPIC = b"kvtier"
MAX_TIERS = 16  #: tiers one snapshot may name (a replica has a handful)
Key = Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
TierName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class WireError(KVTierError):
    """Bytes from the network that are not a valid message."""


class WireEvent(msgspec.Struct, array_like=True, frozen=True):
    stored: bool
    tier: TierName
    key: Key
    position: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Batch(msgspec.Struct, array_like=True, frozen=True):
    epoch: Name
    seq: Annotated[int, msgspec.Meta(ge=0)]
    ts: float
    events: list[WireEvent]


class WireTier(msgspec.Struct, array_like=True, frozen=True):
    name: TierName
    keys: list[Key] | None  #: None: the tier cannot list its keys
    store_id: str | None = None  #: a shared store's id (every replica with the same id reads these keys)


class Snapshot(msgspec.Struct, array_like=True, frozen=True):
    epoch: Name
    seq: Annotated[int, msgspec.Meta(ge=-1)]  #: the last batch it reflects (-1: none sent yet)
    tiers: Annotated[list[WireTier], msgspec.Meta(max_length=MAX_TIERS)]


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(Batch)
_snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)


def wire_event(event: ChunkEvent) -> WireEvent:
    return WireEvent(event.kind is ChunkEventKind.STORED, event.tier, bytes(event.key), event.position)


def encode_batch(batch: Batch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> Batch:
    try:
        return _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"not an event batch: {exc}") from None


def encode_snapshot(epoch: str, seq: int, holdings: list[TierHolding]) -> bytes:
    tiers = [WireTier(h.name, None if h.keys is None else [bytes(k) for k in h.keys], h.store_id)
             for h in holdings]
    return _encoder.encode(Snapshot(epoch, seq, tiers))


def decode_snapshot(payload: bytes) -> Snapshot:
    try:
        return _snapshot_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"not a snapshot: {exc}") from None


def namespace_json(namespace: Namespace) -> dict:
    """A replica's namespace for ``/kvtier/info`` (the salt is per request and never published)."""
    spec = namespace.spec
    return {"model": namespace.model, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "dtype": dtype_name(spec.dtype), "chunk_size": namespace.chunk_size,
            "tp_rank": namespace.tp_rank, "tp_size": namespace.tp_size, "adapter": namespace.adapter}


class _NamespaceJson(msgspec.Struct, forbid_unknown_fields=False):
    model: Name
    layers: Annotated[int, msgspec.Meta(ge=1)]
    kv_heads: Annotated[int, msgspec.Meta(ge=1)]
    head_dim: Annotated[int, msgspec.Meta(ge=1)]
    dtype: Name
    chunk_size: Annotated[int, msgspec.Meta(ge=1)]
    tp_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    adapter: str = ""


def namespace_from_json(value: object) -> Namespace:
    """The Namespace a replica published with ``namespace_json``; WireError if it is not one."""
    try:
        ns = msgspec.convert(value, _NamespaceJson)
        spec = KVSpec(ns.layers, ns.kv_heads, ns.head_dim, dtype_from_name(ns.dtype))
        return Namespace(ns.model, spec, ns.chunk_size, ns.tp_rank, ns.tp_size, ns.adapter)
    except (msgspec.ValidationError, KVTierError) as exc:
        raise WireError(f"not a namespace: {exc}") from None


def holding_from_wire(tier: WireTier) -> TierHolding:
    keys = None if tier.keys is None else [ChunkHash(k) for k in tier.keys]
    return TierHolding(tier.name, keys, tier.store_id)
