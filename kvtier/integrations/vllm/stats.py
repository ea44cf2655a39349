"""Connector statistics in vLLM's own stats channel (logged by vLLM with its other KV transfer metrics).

Each worker counts, per logging interval: tokens loaded from kvtier into vLLM's blocks, blocks it could not
fill (recomputed by vLLM), tokens newly stored, and requests saved. Counters sum across workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

FIELDS = ("loaded_tokens", "failed_blocks", "stored_tokens", "saved_requests")


@dataclass
class KVTierStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for name in FIELDS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"kvtier_{name}": self.data.get(name, 0) for name in FIELDS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in FIELDS)
