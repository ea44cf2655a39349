"""The scheduler side of a model the connector serves without caching: every lookup a miss, nothing loaded or saved.

A model with SSM (Mamba) KV cache groups needs its recurrent state at the load point restored with the attention
KV; the connector restores it (mamba.py) only where vLLM keeps that state per block (its Mamba prefix-caching mode
``align``) beside one full-attention group and no sliding window (groups.GroupLayout.cached). Any other such model
runs exactly as vLLM alone runs it (its hybrid KV cache manager on), and kvtier stays out of the way.
"""

from __future__ import annotations

from typing import Any

from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMeta
from kvtier.integrations.vllm.pd import PDRequests


class UncachedScheduler:
    """SchedulerSide's interface, caching nothing."""

    kv_cache_manager: Any = None

    def __init__(self) -> None:
        self.pd = PDRequests()  #: never holds a request (``new_request`` records none): no P/D for such a model

    def new_request(self, request: Any) -> None:
        return

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def after_alloc(self, request: Any, tables: tuple[list[int], ...], num_external_tokens: int) -> None:
        return

    def build_meta(self, out: Any) -> KVTierMetadata:
        return KVTierMetadata()

    def load_failed(self, block_ids: set[int]) -> None:
        return

    def loads_failed(self, req_ids: set[str]) -> None:
        return

    def loads_done(self, req_ids: set[str]) -> None:
        return

    def jobs_done(self, meta: KVTierWorkerMeta | None) -> None:
        return

    def finished(self, request: Any, block_ids: list[int]) -> bool:
        return False

    def take_counters(self) -> list[list[Any]]:
        return []

    def close(self) -> None:
        return
