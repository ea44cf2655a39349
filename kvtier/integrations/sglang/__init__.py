"""kvtier as SGLang's HiCache storage backend (the L3 tier behind SGLang's GPU and host caches; SGLang 0.5.23).

Load it with::

    python -m sglang.launch_server --model-path MODEL --page-size 64 --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage", "interface_v1": 1,
        "tiers": [{"kind": "memory", "capacity_bytes": "8GiB"}, {"kind": "disk", "path": "/var/cache/kvtier"}]}'

This is the only package in kvtier that imports SGLang; ``pages`` and ``config`` import without it, so the
backend class is imported on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierStorage":
        from kvtier.integrations.sglang.backend import KVTierStorage

        return KVTierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
