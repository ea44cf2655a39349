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

A snapshot of millions of keys is not decoded in one call (one call holds the GIL for all of them, stalling a
router's event loop even from a worker thread): ``decode_snapshot_head`` checks the whole message's structure and
leaves each tier's keys as raw msgpack, and ``snapshot_keys`` decodes those in pieces of at most ``KEYS_PIECE``
keys (one call each), as many as the caller wants. Keys are msgpack ``bin 8`` of 32 bytes, as msgspec encodes them,
so a tier's keys are fixed-size records; any other encoding of them is a ``WireError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import msgspec

from kvtier.base.errors import KVTierError
from kvtier.base.keys import HASH_BYTES, ChunkHash, Namespace
from kvtier.base.layout import KVSpec
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


class BatchHead(msgspec.Struct, array_like=True, frozen=True):
    """A ``Batch`` whose events are left raw, one span each (``decode_batch_head``; ``decode_events``)."""

    epoch: Name
    seq: Annotated[int, msgspec.Meta(ge=0)]
    ts: float
    events: list[msgspec.Raw]


class WireTier(msgspec.Struct, array_like=True, frozen=True):
    name: TierName
    keys: list[Key] | None  #: None: the tier cannot list its keys
    store_id: str | None = None  #: a shared store's id (every replica with the same id reads these keys)


class RawTier(msgspec.Struct, array_like=True, frozen=True):
    name: TierName
    keys: msgspec.Raw  #: the tier's keys as msgpack (nil: it cannot list them), decoded by ``snapshot_keys``
    store_id: str | None = None

    @property
    def listed(self) -> bool:
        """Whether the tier listed its keys (``WireTier.keys`` not None)."""
        return bytes(memoryview(self.keys)[:1]) != b"\xc0"


class SnapshotHead(msgspec.Struct, array_like=True, frozen=True):
    """A ``Snapshot`` whose tiers' keys are left undecoded (``decode_snapshot_head``)."""

    epoch: Name
    seq: Annotated[int, msgspec.Meta(ge=-1)]
    tiers: Annotated[list[RawTier], msgspec.Meta(max_length=MAX_TIERS)]


class Snapshot(msgspec.Struct, array_like=True, frozen=True):
    epoch: Name
    seq: Annotated[int, msgspec.Meta(ge=-1)]  #: the last batch it reflects (-1: none sent yet)
    tiers: Annotated[list[WireTier], msgspec.Meta(max_length=MAX_TIERS)]


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(Batch)
_batch_head_decoder = msgspec.msgpack.Decoder(BatchHead)
_events_decoder = msgspec.msgpack.Decoder(list[WireEvent])
_snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)
_head_decoder = msgspec.msgpack.Decoder(SnapshotHead)
_keys_decoder = msgspec.msgpack.Decoder(list[Key])
KEYS_PIECE = 16_384  #: keys ``snapshot_keys`` decodes per call
_KEY_RECORD = 2 + HASH_BYTES  # msgpack bin 8: 0xc4, the length, the bytes


def wire_event(event: ChunkEvent) -> WireEvent:
    return WireEvent(event.kind is ChunkEventKind.STORED, event.tier, bytes(event.key), event.position)


def encode_batch(batch: Batch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> Batch:
    try:
        return _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"not an event batch: {exc}") from None


def decode_batch_head(payload: bytes | memoryview) -> BatchHead:
    """A batch's epoch, seq and time, its events split into raw spans and not decoded: about a quarter of the
    time of ``decode_batch`` (a 16 MB batch of 330k events: ~75 ms against ~270 ms in one call), so that the
    events can be decoded a slice per event-loop turn (``decode_events``)."""
    try:
        return _batch_head_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireError(f"not an event batch: {exc}") from None


def decode_events(raw: list[msgspec.Raw]) -> list[WireEvent]:
    """Events of a ``BatchHead`` slice, in one call; WireError for any that is not a valid event."""
    try:
        return _events_decoder.decode(b"\xdd" + len(raw).to_bytes(4, "big") + b"".join(raw))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
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


def decode_snapshot_head(payload: bytes | memoryview) -> SnapshotHead:
    """A snapshot with its tiers' keys left raw (their structure checked, none decoded)."""
    try:
        return _head_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireError(f"not a snapshot: {exc}") from None


def snapshot_keys(keys: msgspec.Raw | list[bytes] | None, limit: int | None = None) -> Iterator[list[bytes]]:
    """The first ``limit`` (None: all) of a tier's keys, in order, in lists of at most ``KEYS_PIECE``, each list
    decoded by one call; raw keys (``RawTier.keys``) that are not an array of 32-byte ``bin 8`` are a
    ``WireError`` (raised by the piece that reaches them). Decoded keys (a list) are sliced alike."""
    if keys is None:
        return
    if isinstance(keys, list):
        for start in range(0, len(keys) if limit is None else min(limit, len(keys)), KEYS_PIECE):
            yield keys[start: start + KEYS_PIECE if limit is None else min(start + KEYS_PIECE, limit)]
        return
    data = memoryview(keys)
    if bytes(data[:1]) == b"\xc0":
        return
    count, body = _array_header(data)
    if len(data) - body != count * _KEY_RECORD:
        raise WireError("not a snapshot: its keys are not 32-byte bin 8 records")
    end = count if limit is None else min(count, limit)
    for start in range(0, end, KEYS_PIECE):
        n = min(KEYS_PIECE, end - start)
        piece = data[body + start * _KEY_RECORD: body + (start + n) * _KEY_RECORD]
        try:
            yield _keys_decoder.decode(b"\xdd" + n.to_bytes(4, "big") + piece)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(f"not a snapshot: {exc}") from None


def listed_keys(keys: msgspec.Raw | list[bytes] | None) -> int:
    """How many keys a tier lists (raw or decoded), without decoding them (0: none, or not an array)."""
    if keys is None or isinstance(keys, list):
        return len(keys or ())
    try:
        return _array_header(memoryview(keys))[0]
    except WireError:
        return 0


def _array_header(data: memoryview) -> tuple[int, int]:
    """A msgpack array's length and where its first element starts."""
    first = data[0] if len(data) else 0
    if 0x90 <= first <= 0x9F:
        return first - 0x90, 1
    if first == 0xDC and len(data) >= 3:
        return int.from_bytes(data[1:3], "big"), 3
    if first == 0xDD and len(data) >= 5:
        return int.from_bytes(data[1:5], "big"), 5
    raise WireError("not a snapshot: a tier's keys are not an array")


def namespace_json(namespace: Namespace) -> dict:
    """A replica's namespace for ``/kvtier/info`` (the salt is per request and never published)."""
    spec = namespace.spec
    return {"model": namespace.model, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "dtype": spec.dtype_key, "chunk_size": namespace.chunk_size,
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
        spec = KVSpec(ns.layers, ns.kv_heads, ns.head_dim, ns.dtype)  # by name: a router never loads torch
        return Namespace(ns.model, spec, ns.chunk_size, ns.tp_rank, ns.tp_size, ns.adapter)
    except (msgspec.ValidationError, KVTierError) as exc:
        raise WireError(f"not a namespace: {exc}") from None


def holding_from_wire(tier: WireTier) -> TierHolding:
    keys = None if tier.keys is None else [ChunkHash(k) for k in tier.keys]
    return TierHolding(tier.name, keys, tier.store_id)
