"""vLLM's KV events on the wire, decoded with definitions of kvtier's own (msgspec; never pickle, never vLLM).

vLLM's ``ZmqEventPublisher`` (``--kv-events-config``) sends ZMQ multipart ``[topic, seq, payload]``: ``seq`` an
8-byte big-endian counter of batches from 0 per process, ``payload`` a msgpack ``KVEventBatch``: the array
``[ts, events, data_parallel_rank]``, each event a map tagged by its ``type``: ``BlockStored`` (block hashes, the
parent's hash, the blocks' token ids, block size, LoRA, ``medium`` ...), ``BlockRemoved`` (hashes, ``medium``)
or ``AllBlocksCleared``. Its replay socket (ROUTER) answers ``[b"", start_seq]`` with every buffered batch from
``start_seq`` on, each ``[b"", topic, seq, payload]``, then ``[b"", b"", -1 (8 bytes, signed), b""]``.

Contract of ``decode_batch``:

* the batch must be the array above; anything else raises ``VllmWireError`` (the caller counts a drop);
* each event is decoded on its own: one of an unknown type or with a field of the wrong type or beyond the
  bounds below is skipped and counted in ``VllmBatch.dropped``, the rest of the batch stands;
* ``decode_raw_batch`` and ``decode_event`` are its two steps, for a caller that decodes a big batch's events a
  slice at a time (the router's subscriber: the first step is one call, about 0.1 s for 100,000 events);
* bounds: a block hash is bytes of at most 64 or an integer (vLLM's ``ExternalBlockHash``); an event names at
  most ``MAX_BLOCKS`` blocks and ``MAX_TOKENS`` token ids, a medium of at most 64 characters; unknown fields
  are ignored (later vLLM versions add some).

``tests/integrations/test_vllm_fleet_events.py`` checks these definitions against vLLM's own classes.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvtier.base.errors import KVTierError

MAX_BLOCKS = 8192
MAX_TOKENS = 1 << 20
END_SEQ = -1  #: the replay socket's end marker (8 bytes, big-endian, signed)

BlockHash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)] | int
Medium = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class VllmWireError(KVTierError):
    """Bytes that are not a vLLM event batch."""


class BlockStored(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS)]
    parent_block_hash: BlockHash | None
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    lora_id: int | None = None
    medium: Medium | None = None
    lora_name: str | None = None
    extra_keys: list | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS)]
    medium: Medium | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type", frozen=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class RawBatch(msgspec.Struct, array_like=True, frozen=True):
    """A batch whose events are still undecoded (``decode_event`` decodes one)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class VllmBatch(msgspec.Struct, frozen=True):
    """A decoded batch: its events in order, and how many of its events were dropped as undecodable."""

    ts: float
    events: list[Event]
    dropped: int = 0


_batch = msgspec.msgpack.Decoder(RawBatch)
_event = msgspec.msgpack.Decoder(Event)


def decode_raw_batch(payload: bytes) -> RawBatch:
    """The batch in ``payload``, its events undecoded; VllmWireError if it is not a batch at all."""
    try:
        return _batch.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise VllmWireError(f"not a vLLM event batch: {exc}") from None


def decode_event(item: msgspec.Raw) -> Event | None:
    """One event of a ``RawBatch``; None if it is not one (unknown type, wrong field types, beyond the bounds)."""
    try:
        return _event.decode(item)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_batch(payload: bytes) -> VllmBatch:
    """The batch in ``payload`` (see the module's contract); VllmWireError if it is not a batch at all."""
    raw = decode_raw_batch(payload)
    events = [event for event in map(decode_event, raw.events) if event is not None]
    return VllmBatch(raw.ts, events, len(raw.events) - len(events))


def decode_seq(frame: bytes) -> int:
    """The sequence number frame of a message (8 bytes, big-endian; the replay end marker is -1)."""
    if len(frame) != 8:
        raise VllmWireError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
