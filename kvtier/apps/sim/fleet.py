"""The fleet to simulate: replicas, each one's tier chain, an optional shared tier, and the routing.

YAML (every key optional)::

    replicas: 4
    routing: load-bounded       # round-robin | random | prefix | load-bounded
    load_epsilon: 0.25          # load-bounded: no replica above ceil((1 + eps) x mean in-flight requests)
    load_floor: 2               # ... nor held below this many in flight by that bound (sticky too)
    sticky: false               # keep each session (bench JSON: conversation / document) on one replica
    session_epsilon: 0.25       # sticky: a new session's replica homes at most max((1 + eps) x mean, ceil(mean))
    tier_weights: {disk: 0.9}   # what a cached token in each tier is worth to the router (default 1.0)
    tie_break: home             # home (a prefix's rendezvous home) | random (as llm-d's max-score picker)
                                # (random: drawn from a digest of each prompt, as kvtier route draws)
    replica_names: [10.0.0.1:8000, 10.0.0.2:8000, 10.0.0.3:8000, 10.0.0.4:8000]
                                # the names kvtier route knows the replicas by (host:port of their URLs):
                                # rendezvous homes and random draws hash them, so with the run's names a
                                # replay draws what the router drew (default: 0, 1, 2, ...)
    decode_stream_tokens: 128   # what one decoding request costs its replica, in prefill tokens (kvtier
                                # route's default is 128; default here 0: decoding is free)
    kv_bytes_per_token: 131072  # the served model's KV per token (Llama-3-8B, bf16): turns bytes into chunks
    prefill_tokens_per_s: 20000 # each replica's prefill rate (prefills run one at a time) ...
    decode_tokens_per_s: 30     # ... and each request's decode rate (batched): in-flight requests, waits
    vllm_block_size: 32         # the replicas are vLLM replicas of this --block-size, routed on their events:
                                # a new prefix's tie-break hashes its first block, as `kvtier route` keys it
                                # (default: none, kvtier replicas: the first chunk's key)
    vllm_device_blocks: 160     # ... each with a device prefix cache of this many blocks (vLLM's KV cache:
                                # --num-gpu-blocks-override, or what vLLM logs at start), kept as vLLM's block
                                # pool keeps it (kvtier.apps.sim.device); the router weighs its hits as the
                                # tier ``device`` (default: none, no device cache in front of kvtier's tiers)
    tiers:                      # each replica's own chain, fastest first
      - kind: memory            # memory | disk
        chunks: 2500            # capacity in chunks, or capacity_bytes: 64GiB (with codec_ratio)
        policy: arc-lfu         # default: the tiers' default (arc-lfu)
      - kind: disk
        capacity_bytes: 2TiB
        codec_ratio: 1.9        # the tier's codec: chunks are this many times smaller than raw KV
        policy: lru
        write: back             # through (default) | back
        admission: second-hit   # always | second-hit (default: the real tier kind's default)
    shared:                     # one more tier every replica sees, after its own (Redis/Valkey, a pool)
      chunks: 100000
      policy: lru
      admission_max_bytes_per_s: 2GiB  # a byte-rate cap per replica, in the served model's KV bytes

How tiers are simulated. Every tier is kvtier's real ``MemoryTier`` (buffer, allocator, eviction policy,
pins) sized to hold exactly its capacity in chunks of a tiny KV spec, inside a real ``KVCache``. A ``disk``
tier is such a memory tier as well: what the simulator needs from a disk is its capacity accounting and
eviction order, which live in the same index code; files, fsyncs and the write queue (which drops stores
when full) are not simulated, so a simulated disk never loses a store. The shared tier is one tier object
placed at the end of every replica's chain, as a Redis/Valkey store would be.

Admission runs kvtier's own policies (kvtier.policy.admission) in each replica's chain, so a replica's
``second-hit`` sketch and rate cap see only its own requests, as in a real fleet. A rate cap is given in the
served model's KV bytes (``kv_bytes_per_token``) and converted to the simulator's tiny chunks; its clock is the
trace's arrival time.

Routing is kvtier.fleet.scoring's, fed what ``kvtier route`` sees: per replica its cached tokens, its requests in
flight, the prompt tokens it has yet to compute (each request's prompt less what the router expected cached,
until its first token) and its decode streams (from first token to last), under the replica's name. A request's
first token and end come from the load model, or, for requests a recorded run measured (a bench JSON's
``ttft_s`` and ``e2e_s``), from the recording: what the router's load bound saw. Where a recorded run names the
replica that served each request (``kvtier bench`` keeps kvtier route's ``x-kvtier-replica``) and the fleet
names its replicas the same, the replay counts the requests it placed where the router did.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.base.errors import ConfigError
from kvtier.core.config import build_dataclass, read_yaml_mapping
from kvtier.fleet.scoring import Routing, RoutingConfig
from kvtier.policy import DEFAULT_POLICY, POLICIES
from kvtier.policy.admission import AdmissionSettings
from kvtier.tiers import WriteMode


class TierKind(enum.Enum):
    MEMORY = "memory"
    DISK = "disk"


@dataclass(frozen=True)
class SimTier:
    """One simulated tier. Capacity in ``chunks``, or in ``capacity_bytes`` of KV compressed ``codec_ratio``-fold;
    ``admission`` None takes the default of the real tier it stands for (memory, disk; redis for the shared tier);
    ``admission_max_bytes_per_s`` and ``admission_burst_bytes`` are in the served model's raw KV bytes."""

    kind: TierKind = TierKind.MEMORY
    chunks: int | None = None
    capacity_bytes: int | None = None
    codec_ratio: float = 1.0
    policy: str = DEFAULT_POLICY
    write: WriteMode = WriteMode.THROUGH
    admission: str | None = None
    admission_max_bytes_per_s: int | None = None
    admission_burst_bytes: int | None = None

    def __post_init__(self) -> None:
        AdmissionSettings(self.admission or "always", max_bytes_per_s=self.admission_max_bytes_per_s,
                          burst_bytes=self.admission_burst_bytes)  # ConfigError for a bad one
        if (self.chunks is None) == (self.capacity_bytes is None):
            raise ConfigError("a simulated tier needs exactly one of chunks or capacity_bytes")
        if self.chunks is not None and self.chunks < 0:
            raise ConfigError(f"chunks must not be negative, got {self.chunks}")
        if self.codec_ratio <= 0:
            raise ConfigError(f"codec_ratio must be positive, got {self.codec_ratio}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown eviction policy {self.policy!r}; known: {sorted(POLICIES)}")

    def capacity_chunks(self, chunk_kv_bytes: int) -> int:
        """Chunks this tier holds when one chunk of raw KV is ``chunk_kv_bytes`` bytes."""
        if self.chunks is not None:
            return self.chunks
        assert self.capacity_bytes is not None
        return int(self.capacity_bytes * self.codec_ratio // chunk_kv_bytes)


@dataclass(frozen=True)
class FleetConfig:
    replicas: int = 1
    tiers: tuple[SimTier, ...] = (SimTier(chunks=10_000),)
    shared: SimTier | None = None
    routing: RoutingConfig = RoutingConfig()
    kv_bytes_per_token: int = 131_072
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 30.0
    vllm_block_size: int | None = None
    #: each vLLM replica's device prefix cache, in blocks of ``vllm_block_size`` (None: not simulated)
    vllm_device_blocks: int | None = None
    #: the names kvtier route knows the replicas by (empty: their indices); see the YAML above
    replica_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be at least 1, got {self.replicas}")
        if not self.tiers:
            raise ConfigError("each replica needs at least one tier")
        if min(self.kv_bytes_per_token, self.prefill_tokens_per_s, self.decode_tokens_per_s) <= 0:
            raise ConfigError("kv_bytes_per_token, prefill_tokens_per_s and decode_tokens_per_s must be positive")
        if self.vllm_block_size is not None and self.vllm_block_size < 1:
            raise ConfigError(f"vllm_block_size must be positive, got {self.vllm_block_size}")
        if self.vllm_device_blocks is not None and (self.vllm_device_blocks < 0 or self.vllm_block_size is None):
            raise ConfigError(f"vllm_device_blocks must be a non-negative number of blocks, with vllm_block_size "
                              f"set; got {self.vllm_device_blocks} blocks of {self.vllm_block_size} tokens")
        if self.replica_names and (len(self.replica_names) != self.replicas or len(set(self.replica_names))
                                   != self.replicas or not all(self.replica_names)):
            raise ConfigError(f"replica_names must name each of the {self.replicas} replicas once, "
                              f"got {list(self.replica_names)}")
        if self.routing.decode_stream_tokens < 0:
            raise ConfigError(f"decode_stream_tokens must not be negative, got {self.routing.decode_stream_tokens}")

    def replica_index(self, name: str | None) -> int | None:
        """The replica the fleet names ``name`` (None when it names none so)."""
        return self.replica_names.index(name) if name in self.replica_names else None

    def replica_name(self, index: int) -> str:
        """The name the router knows replica ``index`` by (its index when the fleet names none)."""
        return self.replica_names[index] if self.replica_names else str(index)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> FleetConfig:
        values = dict(values)
        routing = {
            "routing": values.pop("routing", Routing.LOAD_BOUNDED.value),
            "epsilon": values.pop("load_epsilon", 0.25),
            "load_floor": values.pop("load_floor", 2),
            "sticky": values.pop("sticky", False),
            "session_epsilon": values.pop("session_epsilon", 0.25),
            "tier_weights": tuple(dict(values.pop("tier_weights", None) or {}).items()),
            "tie_break": values.pop("tie_break", "home"),
            "decode_stream_tokens": values.pop("decode_stream_tokens", 0.0),
        }
        values["routing"] = build_dataclass(RoutingConfig, routing, "fleet.routing")
        if values.get("replica_names") is not None:
            values["replica_names"] = tuple(str(name) for name in values["replica_names"])
        values["tiers"] = tuple(_tier(t, f"fleet.tiers[{i}]") for i, t in enumerate(values.pop("tiers", None) or []))
        if not values["tiers"]:
            del values["tiers"]
        if values.get("shared") is not None:
            values["shared"] = _tier(values["shared"], "fleet.shared")
        return build_dataclass(cls, values, "fleet")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> FleetConfig:
        return cls.from_dict(read_yaml_mapping(path, "fleet"))


def _tier(values: Any, owner: str) -> SimTier:
    if isinstance(values, SimTier):
        return values
    if not isinstance(values, Mapping):
        raise ConfigError(f"{owner}: expected a mapping")
    return build_dataclass(SimTier, values, owner)
