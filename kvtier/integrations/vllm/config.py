"""The connector's settings: ``kv_connector_extra_config`` parsed once, on both sides of vLLM.

Everything but the connector's own keys goes to :meth:`kvtier.CacheConfig.from_dict` (``chunk_size``,
``tiers``), so the extra config reads like a kvtier config file with two additions:

* ``model_id`` names the weights in every chunk key. Default: vLLM's model path plus ``@revision``. Set it
  when several servers load the same weights from different paths and should share a disk or Redis tier.
* ``socket_dir`` is where each worker listens for the scheduler's lookups (a Unix socket per TP rank, in a
  folder ``kvtier-<uid>`` inside it that only this user can enter).
* ``metrics_port``: if set, tensor-parallel rank ``r`` serves its cache's full metrics (histograms included,
  kvtier's exact names) at ``http://<metrics_host>:<metrics_port + r>/metrics``; ``metrics_host`` defaults
  to loopback. vLLM's own ``/metrics`` carries the counters and gauges either way (prom.py). The same port
  answers kvtier's admin API (``/admin/v1``, admin.py) with the key in the file ``admin_key_file`` (its first
  line), else ``KVTIER_ADMIN_KEY`` in the workers' environment; without either, admin calls are refused (403).
* ``load_mode``: ``"async"`` (the default) loads a hit on the worker's own thread while vLLM runs other
  requests, the request waiting in ``WAITING_FOR_REMOTE_KVS``; ``"sync"`` loads it in ``start_load_kv``, before
  the forward pass of the step that computes the rest of its prompt (every request in that step waits).
* ``load_timeout_s``: an asynchronous load not done this long after the worker received it is cut short:
  whatever had not arrived verified is reported as load errors and recomputed by vLLM.
* ``load_nice``: the niceness (0-19, default 19) of the worker's loading thread and of the threads it starts
  (the retrieve pipeline's and the tiers' readers, on Linux): on a CPU build the forward pass keeps the cores
  while a load competes for them (docs/benchmarks/vllm-serve.md); 0 loads at the engine's own priority. A load
  still running a quarter of the way to its deadline (starved by other processes) ends the niceness for good,
  where the OS allows lowering it (root, CAP_SYS_NICE).
* ``lookup_timeout_s``: a request's first lookup not answered this long after the request arrived is a miss.
* ``state_snapshots``: for models with sliding-window or Mamba layers (vLLM's hybrid KV cache manager), the
  chunk boundaries whose windows or Mamba states are stored (kvtier.base.state.SnapshotPolicy); default
  ``every``: a window costs at most a chunk of those layers, and a prompt can hit only at a boundary with one.
* ``event_media``: ``{tier name: medium}``, the medium each tier's events carry in vLLM's KV events (when
  ``--kv-events-config`` enables them) over the defaults (``memory`` -> ``CPU``, ``disk`` -> ``DISK``, a shared
  store -> ``SHARED``, any other tier its name in capitals: kvtier.integrations.vllm.events).
* ``event_block_size``: the size in tokens of the blocks those events publish (a divisor of ``chunk_size``;
  default the chunk size): a chunk becomes that many blocks. vllm-router indexes only blocks of its
  ``--kv-event-block-size``, so behind it set vLLM's ``--block-size`` here.
* ``event_ownership``: which tiers' events carry ``ownership: "kvtier"``: ``"shared"`` (the default: shared
  stores only), ``"all"`` or ``"none"``. Routers weight a block with an ownership as an external tier whatever
  its medium (kvtier.integrations.vllm.events).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.base.errors import ConfigError
from kvtier.base.state import SnapshotPolicy
from kvtier.core.config import CacheConfig

_OWN_KEYS = ("model_id", "socket_dir", "metrics_host", "admin_key_file")
LOAD_MODES = ("async", "sync")
#: which tiers' KV events carry kvtier's ownership: shared stores only, every tier, or none
#: (kvtier.integrations.vllm.events)
OWNERSHIP_MODES = ("shared", "all", "none")


@dataclass(frozen=True)
class ConnectorConfig:
    cache: CacheConfig
    model_id: str | None = None
    socket_dir: str = tempfile.gettempdir()
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    admin_key_file: str | None = None
    load_mode: str = "async"
    load_timeout_s: float = 30.0
    lookup_timeout_s: float = 1.0
    event_media: dict[str, str] | None = None
    event_block_size: int | None = None
    event_ownership: str = "shared"
    load_nice: int = 19
    #: the chunk boundaries whose sliding windows are stored (models with sliding-window layers): every one,
    #: unless ``state_snapshots`` is given
    window_snapshots: SnapshotPolicy = SnapshotPolicy(interval=1, last=False)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        values = dict(extra or {})
        own = {key: values.pop(key) for key in _OWN_KEYS if key in values}
        for key in own:
            if not isinstance(own[key], str) or not own[key]:
                raise ConfigError(f"kv_connector_extra_config.{key} must be a non-empty string")
        port = values.pop("metrics_port", None)
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ConfigError(f"kv_connector_extra_config.metrics_port must be a port number, got {port!r}")
        mode = values.pop("load_mode", "async")
        if mode not in LOAD_MODES:
            raise ConfigError(f"kv_connector_extra_config.load_mode must be one of {LOAD_MODES}, got {mode!r}")
        media = values.pop("event_media", None)
        if media is not None and (not isinstance(media, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and 0 < len(v) <= 64 for k, v in media.items())):
            raise ConfigError("kv_connector_extra_config.event_media maps tier names to media names (strings of at "
                              f"most 64 characters), got {media!r}")
        blocks = values.pop("event_block_size", None)
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= 0):
            raise ConfigError(f"kv_connector_extra_config.event_block_size must be a positive integer, got {blocks!r}")
        ownership = values.pop("event_ownership", "shared")
        if ownership not in OWNERSHIP_MODES:
            raise ConfigError(f"kv_connector_extra_config.event_ownership must be one of {OWNERSHIP_MODES}, "
                              f"got {ownership!r}")
        nice = values.pop("load_nice", 19)
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ConfigError(f"kv_connector_extra_config.load_nice must be an integer from 0 to 19, got {nice!r}")
        timeouts = {key: _seconds(key, values.pop(key)) for key in ("load_timeout_s", "lookup_timeout_s")
                    if key in values}
        cache = CacheConfig.from_dict(values)
        if blocks is not None and cache.chunk_size % blocks:
            raise ConfigError(f"kv_connector_extra_config.event_block_size {blocks} must divide chunk_size "
                              f"{cache.chunk_size}")
        windows = {"window_snapshots": cache.state_snapshots} if "state_snapshots" in values else {}
        return cls(cache=cache, metrics_port=port, load_mode=mode, event_media=media, event_block_size=blocks,
                   event_ownership=ownership, load_nice=nice, **timeouts,
                   **windows, **own)

    def check_block_size(self, block_size: int) -> None:
        """Chunks must be whole vLLM blocks: a chunk is loaded and reported (on failure) block by block."""
        if self.cache.chunk_size % block_size:
            raise ConfigError(
                f"kvtier chunk_size {self.cache.chunk_size} must be a multiple of vLLM's block size {block_size}"
            )


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 86400:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a positive number of seconds, got {value!r}")
    return float(value)
