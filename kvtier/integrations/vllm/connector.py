"""KVTierConnector: vLLM's KVConnectorBase_V1 over kvtier, one instance per role.

vLLM builds the connector twice: in the scheduler (role SCHEDULER) and in every worker (role WORKER),
usually in different processes. Each role delegates to its own small object (scheduler.py, worker.py);
this class only adapts vLLM's calls to them. See the package docstring for the configuration.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvtier.api.admin import admin_key_from
from kvtier.base.errors import ConfigError
from kvtier.core.cache import KVCache
from kvtier.integrations.vllm.admin import AdminServer, token_prompt
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.events import KVTierKVEvents, SchedulerEvents, TierEvents
from kvtier.integrations.vllm.groups import GroupLayout, group_layout, paged_groups
from kvtier.integrations.vllm.lookup_socket import LookupClient, socket_path
from kvtier.integrations.vllm.lookups import Lookups
from kvtier.integrations.vllm.mamba import check_chunk_size
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMeta
from kvtier.integrations.vllm.prom import KVTierPromMetrics
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.stats import KVTierStats, MetricsFeed
from kvtier.integrations.vllm.threads import set_workers_on_host
from kvtier.integrations.vllm.uncached import UncachedScheduler
from kvtier.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered prefix caching for vLLM: loads cached prefixes (asynchronously by default), saves prompt chunks as
    prefill computes them and the rest when a request finishes; prefill/decode disaggregation through the same
    tiers with vLLM's ``kv_transfer_params`` (pd.py). Supports vLLM's hybrid KV cache manager: a full-attention
    group is cached as KV chunks, sliding-window groups as window snapshots (groups.py), Mamba groups as conv and
    SSM state snapshots at chunk boundaries (mamba.py)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.groups: GroupLayout = group_layout(kv_cache_config)
        if self.groups.cached:  # a model served uncached moves no chunk
            self.config.check_block_size(self.block_size)
        if self.groups.ssm and self.groups.cached:
            check_chunk_size(self.config.cache.chunk_size, self.groups.ssm_block)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("KVTierConnector does not support pipeline parallelism yet")
        self.tp_size = parallel.tensor_parallel_size
        if self.groups.states and self.groups.cached and self.config.load_mode != "async":
            raise ConfigError("KVTierConnector loads models with sliding-window or SSM layers asynchronously only "
                              "(vLLM takes a failed load of several KV cache groups per request): drop load_mode "
                              "'sync'")
        self.engine_id = str(transfer.engine_id)
        model = vllm_config.model_config
        self.model_id = self.config.model_id or f"{model.model}@{model.revision or 'main'}"
        self._scheduler: SchedulerSide | UncachedScheduler | None = None
        self._worker: WorkerSide | None = None
        self._feed: MetricsFeed | None = None
        self._tier_events: TierEvents | None = None  # worker side, rank 0: kvtier's tier events for vLLM's
        self._scheduler_events = SchedulerEvents()  # scheduler side: what the workers sent
        self._metrics_server: AdminServer | None = None  # worker side: /metrics and the admin API
        if not self.groups.cached:
            arch = ", ".join(getattr(model, "architectures", None) or [str(model.model)])
            log.warning("kvtier: %s keeps SSM (Mamba) state, which KVTierConnector restores only with vLLM's prefix "
                        "caching on (mamba_cache_mode 'align'), one full-attention KV cache group and no sliding "
                        "window: it is served uncached (every request computed as by vLLM alone)", arch)
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = UncachedScheduler()
        elif role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                # A kvtier miss or corrupt chunk is always recomputable; failing the request would be wrong.
                log.info("kvtier: setting kv_load_failure_policy to 'recompute'")
                transfer.kv_load_failure_policy = "recompute"
            paths = [socket_path(self.config.socket_dir, self.engine_id, r) for r in range(self.tp_size)]
            lookups = Lookups(LookupClient(paths), self.config.lookup_timeout_s)
            self._scheduler = SchedulerSide(self.config.cache.chunk_size, self.block_size, lookups,
                                            load_async=self.config.load_mode == "async",
                                            load_timeout_s=self.config.load_timeout_s, tp_size=self.tp_size,
                                            groups=self.groups, snapshots=self.config.window_snapshots)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save dropped by preemption is only a future miss

    # ==============================  worker side  ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        if not self.groups.cached:
            return  # served uncached (see __init__): no cache, no lookups, no transfers
        set_workers_on_host(self.tp_size)  # a rank cannot see its siblings' cores: kvtier's threads stay put
        if self.groups.ssm:  # a Mamba layer's entry is vLLM's raw pool; the layer holds its (conv, ssm) views
            layers = self._vllm_config.compilation_config.static_forward_context
            kv_caches = {**kv_caches, **{n: tuple(layers[n].kv_cache) for g in self.groups.ssm
                                         for n in self.groups.layers[g]}}
        paged, windows, spec = paged_groups(self.groups, kv_caches, self.block_size,
                                            rows_split=current_platform.is_cpu())
        rank = get_tensor_model_parallel_rank()
        cache = KVCache(spec, self.model_id, self.config.cache, tp_rank=rank, tp_size=self.tp_size)
        path = socket_path(self.config.socket_dir, self.engine_id, rank)
        # a lookup never covers more than a whole request: a longer one is not the scheduler asking
        self._worker = WorkerSide(paged, cache, path, self._vllm_config.model_config.max_model_len,
                                  self.config.load_timeout_s, self.config.load_nice, windows=windows)
        self._feed = MetricsFeed(cache.metrics)
        events = self._vllm_config.kv_events_config
        if rank == 0 and events is not None and events.enable_kv_cache_events:
            self._tier_events = TierEvents(cache, self.config.event_media, self.config.event_block_size,
                                           self.config.event_ownership)
        if self.config.metrics_port is not None:
            self._metrics_server = self._admin_server(cache, rank)
        log.info("kvtier: %d layers, spec %s, tiers %s", len(kv_caches), spec, [t.name for t in cache.tiers])

    def _admin_server(self, cache: KVCache, rank: int) -> AdminServer:
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        model = self._vllm_config.model_config
        prompt = token_prompt(model.get_vocab_size(), model.max_model_len,
                              lambda: cached_tokenizer_from_config(model))
        assert self.config.metrics_port is not None
        return AdminServer(cache, self.config.metrics_port + rank, self.config.metrics_host, name=self.model_id,
                           prompt=prompt, admin_key=admin_key_from(self.config.admin_key_file))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVTierMetadata)
        if self._worker is not None and kv_connector_metadata.preempted:
            self._worker.preempted(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        if self._worker is None:
            return  # a model served uncached
        self._worker.submit_saves(meta.saves, meta.delayed)
        for spec in meta.loads:
            if spec.timeout_s is None:  # synchronous: before this step's forward pass
                self._worker.load_sync([spec])
            else:
                self._worker.loads.submit(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a load is whole before vLLM schedules its request (async) or before the forward pass (sync)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # saves read finished requests' blocks on a background thread (see worker.py)

    def wait_for_save(self) -> None:
        # after the forward pass: sliding windows are copied now, before the next step frees their blocks; other
        # saved blocks stay allocated until get_finished reports them. A disaggregated prefill's prompt is stored
        # now: vLLM answers once this step is over, and its decode instance loads the prompt right after
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KVTierMetadata) and meta.windows:
            self._worker.snapshot_windows(meta.windows)
        if self._worker is not None and isinstance(meta, KVTierMetadata) and meta.transfers:
            self._worker.store_transfers(meta.transfers)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return (self._worker.finished_saves() or None), (self._worker.finished_loads(finished_req_ids) or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        jobs = self._worker.take_done_jobs() if self._worker is not None else None
        return KVTierWorkerMeta(jobs) if jobs else None

    def get_kv_connector_stats(self) -> KVTierStats | None:
        if self._scheduler is not None:
            counters = self._scheduler.take_counters()
            return KVTierStats(data={"counters": counters}) if counters else None
        if self._worker is None or self._feed is None:
            return None
        data = {**self._worker.take_counts(), **self._feed.take()}
        return KVTierStats(data=data) if any(data.values()) else None

    def get_kv_connector_kv_cache_events(self) -> KVTierKVEvents | None:
        return self._tier_events.take() if self._tier_events is not None else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler_events.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if self._tier_events is not None:
            self._tier_events.close()
            self._tier_events = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close()

    # ==============================  scheduler side  ==============================
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is None:
            return
        self._scheduler_events.add(connector_output.kv_cache_events)
        if connector_output.invalid_block_ids:
            self._scheduler.load_failed(set(connector_output.invalid_block_ids))
        if connector_output.failed_recving:
            self._scheduler.loads_failed(set(connector_output.failed_recving))
        if connector_output.finished_recving:
            self._scheduler.loads_done(set(connector_output.finished_recving))
        meta = connector_output.kv_connector_worker_meta
        self._scheduler.jobs_done(meta if isinstance(meta, KVTierWorkerMeta) else None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self._scheduler is not None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        params = self._scheduler.pd.finished(request, normal)
        return self._scheduler.finished(request, block_ids), params

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager: only the full-attention group's blocks are saved from here (windows and Mamba
        states were copied as the prompt was computed)."""
        full = self.groups.full
        return self.request_finished(request, block_ids[full] if full is not None else [])
