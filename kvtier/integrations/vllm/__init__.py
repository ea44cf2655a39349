"""kvtier as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1`` and ``SupportsHMA``: the hybrid KV cache manager
stays on).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": 256, "tiers": [{"kind": "memory", "capacity_bytes": "8GiB"}]}}'

This is the only package in kvtier that imports vLLM; its engine-independent modules (paged, lookup,
config) import without it, so the connector class is imported on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
