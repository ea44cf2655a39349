"""The disk tier's config: where its directory is, how large it may grow, how it writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.base.errors import ConfigError
from kvtier.policy import DEFAULT_POLICY, make_policy
from kvtier.tiers.control import ControlledTierConfig


@dataclass(frozen=True)
class DiskTierConfig(ControlledTierConfig):
    """The local-disk tier (see tier.py).

    ``path``: root directory (chunks go to ``<path>/<codec>/``, or ``<path>/rank<r>/<codec>/`` for tensor
    parallel rank ``r``; a directory belongs to one process);
    ``capacity_bytes``: hard limit on stored blob bytes; ``policy``: eviction policy; ``write_queue_depth``:
    stores queued for the writers before new ones are dropped; ``write_threads`` / ``read_threads``: parallel
    file writes / reads; ``o_direct``: bypass the page cache; ``fsync``: make each chunk durable before it
    is visible (off: a machine crash may lose recent chunks; the checksum turns any damage into misses).
    Pin budget and tenant shares: ControlledTierConfig."""

    kind = "disk"
    #: Below a faster tier, a disk takes only chunks sighted twice (why: docs/benchmarks/admission.md).
    default_admission = "second-hit"
    path: Path | None = None
    capacity_bytes: int = 64 << 30
    policy: str = DEFAULT_POLICY
    write_queue_depth: int = 16
    write_threads: int = 2
    read_threads: int = 4
    o_direct: bool = True
    fsync: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path is None:
            raise ConfigError("tiers[disk]: path is required (YAML path: ..., or KVTIER_DISK_PATH)")
        if min(self.write_queue_depth, self.write_threads, self.read_threads) < 1:
            raise ConfigError("write_queue_depth, write_threads and read_threads must be at least 1")
        make_policy(self.policy)
