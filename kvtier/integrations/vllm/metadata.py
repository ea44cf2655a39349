"""What the scheduler tells workers each step (loads, saves, preemptions), and what workers tell it back.

Token ids travel as little-endian u32 bytes (compact under vLLM's own serialisation between processes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.base.keys import NO_EXTRAS, ExtraKeys, Tokens, token_array


def pack_tokens(tokens: Tokens) -> bytes:
    return token_array(tokens).tobytes()


def unpack_tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4")


def pack_extras(extras: ExtraKeys) -> bytes:
    return extras.encode() if extras else b""


def unpack_extras(data: bytes) -> ExtraKeys:
    """The ExtraKeys of a spec (InvalidArgument if they do not decode: the scheduler wrote them)."""
    return ExtraKeys.decode(data) if data else NO_EXTRAS


@dataclass(frozen=True)
class LoadSpec:
    """Load the chunks covering tokens ``[first_token, end)`` into ``block_ids``.

    ``tokens`` are the request's tokens up to the end of the last chunk to read (whole chunks).
    Blocks below ``first_token`` (vLLM's own prefix-cache hit) are not written. Whatever of
    ``[first_token, end)`` does not arrive intact is reported as load errors, block by block.
    ``timeout_s`` (asynchronous loads only): the load is cut short that long after the worker received it.
    ``salt`` and ``extras`` (an ExtraKeys encoding, empty for none): what the keys are derived with besides the
    tokens (kvtier.integrations.vllm.inputs).
    """

    req_id: str
    tokens: bytes
    salt: bytes
    block_ids: list[int]
    first_token: int
    end: int
    timeout_s: float | None = None
    extras: bytes = b""
    #: with sliding-window KV cache groups (vLLM's hybrid manager): each such group's block table; ``block_ids``
    #: is then the full-attention group's (empty for a model whose every layer slides). Such a load restores the
    #: window snapshot at the end of ``tokens`` and reports a failure per request, not per block.
    window_block_ids: tuple[list[int], ...] = ()
    #: a disaggregated decode (kvtier.integrations.vllm.pd): after the full chunks of ``tokens``, the whole
    #: blocks of the partial last chunk up to ``end`` are read under this nonce
    tail_nonce: bytes = b""


@dataclass(frozen=True)
class WindowSave:
    """After this step's forward pass, copy the sliding-window groups' windows before ``boundaries`` (tokens, at
    chunk boundaries, ascending) out of ``block_ids`` (one table per sliding-window group, as this step holds
    them: vLLM frees blocks that leave the window when it schedules the next step) and store them as snapshots
    under the chain of ``tokens`` (the request's tokens up to the last boundary). ``salt``, ``extras`` as for
    LoadSpec."""

    req_id: str
    tokens: bytes
    salt: bytes
    boundaries: list[int]
    block_ids: tuple[list[int], ...]
    extras: bytes = b""


@dataclass(frozen=True)
class SaveSpec:
    """Store the full chunks of ``tokens`` (all computed) from ``block_ids``, as save job ``job``.

    vLLM does not reuse the blocks while the job runs: they belong to a running request (a preemption waits for
    the job, ``handle_preemptions``) or to a finished one whose blocks are freed only when the worker reports
    it in ``get_finished`` (``KVTierMetadata.delayed``). ``ttl_s``: the request's retention time (its
    ``kv_transfer_params``, inputs.request_ttl), None for none; ``extras`` as for LoadSpec."""

    req_id: str
    job: int
    tokens: bytes
    salt: bytes
    block_ids: list[int]
    ttl_s: float | None = None
    extras: bytes = b""


@dataclass(frozen=True)
class TransferSpec:
    """Store the whole prompt ``tokens`` of a disaggregated prefill from ``block_ids`` before this step ends
    (``wait_for_save``): its full chunks under their usual keys, the partial last one under ``nonce``
    (kvtier.integrations.vllm.pd). ``salt``, ``ttl_s`` and ``extras`` as for SaveSpec."""

    req_id: str
    tokens: bytes
    salt: bytes
    block_ids: list[int]
    nonce: bytes
    ttl_s: float | None = None
    extras: bytes = b""


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: requests vLLM stopped running this step: their blocks may be reused by this step's forward pass
    preempted: set[str] = field(default_factory=set)
    #: finished requests whose blocks vLLM keeps until the worker reports them done saving
    delayed: set[str] = field(default_factory=set)
    #: sliding-window snapshots to take after this step's forward pass
    windows: list[WindowSave] = field(default_factory=list)
    #: disaggregated prefills whose prompt this step completes: stored before the step ends
    transfers: list[TransferSpec] = field(default_factory=list)


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Save jobs done (stored, failed or cancelled) since the last step, counted once per TP rank."""

    jobs: Counter[int] = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMeta)
        return KVTierWorkerMeta(self.jobs + other.jobs)
