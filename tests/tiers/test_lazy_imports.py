"""Importing the tiers package or the cache config imports no tier, and no Redis or Mooncake client, until a
tier is configured (its config module only) or built (its tier). Run in fresh interpreters: this process has
imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kvtier.tiers

KINDS = ("memory", "disk", "redis", "mooncake")
#: What reading a tier's config may import of its folder: the package, the config and (Redis) the limits of
#: split values the config is checked against. Everything else in the folder is the tier's implementation.
CONFIG_SIDE = {"__init__", "config", "limits"}
#: Modules of the tiers package beside the kinds' folders that only tiers use (the memory tier's buffer).
TIER_SIDE = {"kvtier.tiers.slab"}


def implementation_modules() -> set[str]:
    root = Path(kvtier.tiers.__file__).parent
    found = {f"kvtier.tiers.{kind}.{path.stem}" for kind in KINDS for path in (root / kind).glob("*.py")
             if path.stem not in CONFIG_SIDE}
    assert {f"kvtier.tiers.{kind}.tier" for kind in KINDS} <= found  # the walk sees the tiers at all
    return found | TIER_SIDE


def loaded_after(script: str) -> set[str]:
    """The modules loaded once ``script`` has run in a fresh interpreter."""
    code = script + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def clients(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in ("redis", "mooncake", "valkey", "glide")}


def test_importing_tiers_and_the_config_imports_no_tier():
    loaded = loaded_after("import kvtier.tiers\nimport kvtier.core.config")
    assert not loaded & implementation_modules()
    assert not clients(loaded)
    assert "kvtier.tiers.memory.config" in loaded  # the default config: a config, not a tier
    assert not {f"kvtier.tiers.{kind}.config" for kind in ("disk", "redis", "mooncake")} & loaded


def test_configuring_every_kind_imports_configs_only(tmp_path):
    loaded = loaded_after(
        "from kvtier.core.config import CacheConfig\n"
        f"CacheConfig.from_dict({{'tiers': [{{'kind': 'memory'}}, {{'kind': 'disk', 'path': {str(tmp_path)!r}}},"
        " {'kind': 'redis'}, {'kind': 'mooncake'}]})\n")
    assert {f"kvtier.tiers.{kind}.config" for kind in KINDS} <= loaded
    assert not loaded & implementation_modules()
    assert not clients(loaded)


def test_building_a_tier_imports_that_tier_only():
    loaded = loaded_after(
        "import torch\n"
        "from kvtier.base.layout import KVSpec\n"
        "from kvtier.base.metrics import Metrics\n"
        "from kvtier.tiers import TierContext\n"
        "from kvtier.tiers.memory.config import MemoryTierConfig\n"
        "ctx = TierContext(KVSpec(2, 2, 8, torch.float16), Metrics(), 'memory')\n"
        "tier = MemoryTierConfig(capacity_bytes=1 << 20, prefault=False).build(ctx)\n"
        "assert type(tier).__module__ == 'kvtier.tiers.memory.tier', type(tier)\n"
        "tier.close()\n")
    assert {"kvtier.tiers.memory.tier", "kvtier.tiers.slab"} <= loaded
    assert not loaded & (implementation_modules() - {"kvtier.tiers.memory.tier", "kvtier.tiers.slab"})
    assert not clients(loaded)
