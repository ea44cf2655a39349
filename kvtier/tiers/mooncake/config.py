"""The ``mooncake`` tier kind's configuration, and how this node's contribution to the pool is sized."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.base.errors import ConfigError
from kvtier.tiers.base import check_device
from kvtier.tiers.remote import MiB, RemoteTierConfig

#: Mooncake refuses smaller segments (its allocator works in 16 MiB slabs); 0 contributes nothing.
MIN_SEGMENT_BYTES = 16 * MiB
DEFAULT_SEGMENT_BYTES = 1 << 30
#: Mooncake's own local buffer (staging for calls the tier does not use); its minimum.
ENGINE_LOCAL_BUFFER_BYTES = 16 * MiB
#: The master's admin/metrics port unless it was started with another ``--metrics_port``.
DEFAULT_METRICS_PORT = 9003


class TransferProtocol(enum.Enum):
    """How values move between replicas (the transfer engine's protocol)."""

    TCP = "tcp"  #: any network; what the tests use
    RDMA = "rdma"  #: InfiniBand / RoCE NICs (auto-discovered; filter with MC_MS_FILTERS)


@dataclass(frozen=True)
class MooncakeTierConfig(RemoteTierConfig):
    """A Mooncake Store pool: every replica pointed at one master shares it (see tier.py).

    ``master_address``: the master's RPC ``host:port``. ``metadata_server``: the transfer engine's metadata
    service, ``http://host:port/metadata`` (the master's embedded one) or ``P2PHANDSHAKE``. ``local_hostname``:
    the address other replicas reach this one at (default: the one this host uses to reach the master).
    ``segment_bytes`` / ``segment_share``: what this replica contributes to the pool, in bytes or as a share
    of the memory free at start (at most one of them; neither: 1 GiB; 0: nothing). Mooncake's smallest
    segment is 16 MiB; a share that comes to less contributes nothing. ``segment_device``: ``cpu``, or
    ``cuda:N`` for spare GPU memory (needs a Mooncake build with VRAM segments). ``buffer_bytes``: the
    registered memory values move through (see buffers.py). ``max_transfers``: batches this replica moves at
    once; the others wait their turn within their deadline (docs/benchmarks/tiers.md has how many pay over
    TCP; more may pay with RDMA and cores to spare). ``metrics_url``: the
    master's Prometheus endpoint, read for the pool's used bytes and capacity (default: the master's host,
    port 9003). Key prefix, deadlines and circuit breaker: RemoteTierConfig.
    """

    kind = "mooncake"
    master_address: str = "127.0.0.1:50051"
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    local_hostname: str | None = None
    protocol: TransferProtocol = TransferProtocol.TCP
    segment_bytes: int | None = None
    segment_share: float | None = None
    segment_device: str = "cpu"
    buffer_bytes: int = 256 * MiB
    max_transfers: int = 1
    metrics_url: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        master_host_port(self)
        if not self.metadata_server.strip():
            raise ConfigError("mooncake metadata_server is required (http://host:port/metadata or P2PHANDSHAKE)")
        if self.segment_bytes is not None and self.segment_share is not None:
            raise ConfigError("mooncake: give segment_bytes or segment_share, not both")
        if self.segment_bytes is not None and 0 < self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ConfigError("mooncake segment_bytes must be 0 (contribute nothing) or at least 16 MiB")
        if self.segment_share is not None and not 0 < self.segment_share < 1:
            raise ConfigError("mooncake segment_share must lie between 0 and 1 (a share of free memory)")
        check_device(self.segment_device, "mooncake segment_device")
        if self.max_transfers < 1:
            raise ConfigError("mooncake max_transfers must be >= 1")
        if self.buffer_bytes < MiB:
            raise ConfigError("mooncake buffer_bytes must be at least 1 MiB")

    @property
    def master_metrics_url(self) -> str:
        return self.metrics_url or f"http://{master_host_port(self)[0]}:{DEFAULT_METRICS_PORT}/metrics"


def master_host_port(config: MooncakeTierConfig) -> tuple[str, int]:
    host, sep, port = config.master_address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"mooncake master_address must be host:port, not {config.master_address!r}")
    return host, int(port)


def segment_size(config: MooncakeTierConfig, free_bytes: int) -> int:
    """Bytes this replica contributes: ``segment_bytes``, or ``segment_share`` of ``free_bytes`` (the memory
    free on ``segment_device`` now); 0 when a share comes to less than Mooncake's smallest segment."""
    if config.segment_share is not None:
        wanted = int(config.segment_share * free_bytes)
        return wanted if wanted >= MIN_SEGMENT_BYTES else 0
    return DEFAULT_SEGMENT_BYTES if config.segment_bytes is None else config.segment_bytes
