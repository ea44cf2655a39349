"""CacheConfig: a small frozen config built from keyword arguments, a YAML file or KVTIER_* variables.

YAML (or a dict)::

    chunk_size: 256
    tiers:
      - kind: memory
        capacity_bytes: 4GiB
      - kind: disk            # added by later tiers' modules
        path: /var/cache/kvtier
        capacity_bytes: 200GiB
        codec: lossless
        write: back

Models with SSM layers also read ``state_snapshots: last`` (or ``every``, ``every-8``, ``last+every-16``;
see kvtier.base.state.SnapshotPolicy), ``KVTIER_STATE_SNAPSHOTS`` in the environment.

Environment: ``KVTIER_CHUNK_SIZE=256``, ``KVTIER_TIERS=memory,disk`` (default ``memory``) and one variable
per tier field, ``KVTIER_<KIND>_<FIELD>``, e.g. ``KVTIER_MEMORY_CAPACITY_BYTES=4GiB``,
``KVTIER_DISK_PATH=/var/cache/kvtier``. Sizes accept ``4GiB``, ``512MB``, ``1_000_000`` and plain ints.
Everything is parsed and checked here; nothing past this module sees strings for modes or sizes.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.base.errors import ConfigError
from kvtier.base.sizes import parse_size  # re-exported: the size fields of configs
from kvtier.base.state import SnapshotPolicy
from kvtier.tiers import TIER_KINDS, TierConfig
from kvtier.tiers.memory.config import MemoryTierConfig


def _coerce(owner: str, name: str, hint: Any, value: Any) -> Any:
    """Turn a YAML/env value into the type a config field declares."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        hint = args[0]
    try:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return value if isinstance(value, hint) else hint(str(value).lower())
        if hint is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(value)
            return text in ("1", "true", "yes", "on")
        if hint is int:
            return parse_size(value) if name.endswith(("_bytes", "_bytes_per_s")) else int(value)
        if hint is float:
            return float(value)
        if hint is Path:
            return Path(value).expanduser()
        if hint is str:
            return str(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{owner}.{name}: cannot use {value!r} ({exc})") from None
    return value


def build_dataclass(cls: type, values: Mapping[str, Any], owner: str) -> Any:
    """Instantiate a frozen config dataclass from loosely typed values, rejecting unknown keys."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(values) - fields
    if unknown:
        raise ConfigError(f"{owner}: unknown option(s) {sorted(unknown)}; known: {sorted(fields)}")
    kwargs = {name: _coerce(owner, name, hints[name], value) for name, value in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{owner}: {exc}") from None


def read_yaml_mapping(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The mapping a YAML file holds (empty for an empty file); ConfigError naming ``what`` otherwise."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            values = yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return values


def tier_config(spec: Mapping[str, Any] | TierConfig) -> TierConfig:
    if isinstance(spec, TierConfig):
        return spec
    values = dict(spec)
    kind = values.pop("kind", None)
    if kind not in TIER_KINDS:
        raise ConfigError(f"tier kind {kind!r} unknown; known: {sorted(TIER_KINDS)}")
    return build_dataclass(TIER_KINDS[kind], values, f"tiers[{kind}]")


@dataclass(frozen=True)
class CacheConfig:
    """``chunk_size``: tokens per chunk (the unit of hashing, storage and hits); ``tiers``: fastest first;
    ``state_snapshots``: where models with SSM layers store state snapshots (kvtier.base.state.SnapshotPolicy);
    ``tenants``: tenant name -> its cache salt in hex (what ``store(salt=...)`` is given), for the tenants that
    metrics and stats name and tier ``tenant_shares`` override (every other tenant is ``other``; ``default`` is
    the empty salt)."""

    chunk_size: int = 256
    tiers: tuple[TierConfig, ...] = (MemoryTierConfig(),)
    state_snapshots: SnapshotPolicy = SnapshotPolicy()
    tenants: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        tiers = tuple(tier_config(t) for t in self.tiers)
        if not tiers:
            raise ConfigError("at least one tier is needed")
        object.__setattr__(self, "tiers", tiers)
        object.__setattr__(self, "state_snapshots", SnapshotPolicy.parse(self.state_snapshots))
        self.tenant_salts()  # raises ConfigError for a malformed entry

    def tenant_salts(self) -> dict[str, bytes]:
        """``tenants`` as name -> salt bytes; ConfigError for a name or salt that cannot be used."""
        if not isinstance(self.tenants, Mapping):
            raise ConfigError("tenants must map tenant names to cache salts in hex")
        out: dict[str, bytes] = {}
        for name, salt in self.tenants.items():
            if not isinstance(name, str) or not name or name in ("default", "other"):
                raise ConfigError(f"tenant name {name!r} must be a non-empty string other than default/other")
            try:
                out[name] = bytes.fromhex(str(salt))
            except ValueError:
                raise ConfigError(f"tenants[{name}]: {salt!r} is not a salt in hex") from None
            if not out[name]:
                raise ConfigError(f"tenants[{name}]: the empty salt is the default tenant")
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CacheConfig:
        values = dict(values)
        tiers = values.pop("tiers", None)
        if tiers is not None:
            if not isinstance(tiers, list | tuple):
                raise ConfigError("tiers must be a list of tier mappings")
            values["tiers"] = tuple(tier_config(t) for t in tiers)
        return build_dataclass(cls, values, "kvtier")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> CacheConfig:
        return cls.from_dict(read_yaml_mapping(path, "config"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CacheConfig:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if "KVTIER_CHUNK_SIZE" in env:
            values["chunk_size"] = env["KVTIER_CHUNK_SIZE"]
        if "KVTIER_STATE_SNAPSHOTS" in env:
            values["state_snapshots"] = env["KVTIER_STATE_SNAPSHOTS"]
        kinds = [k.strip() for k in env.get("KVTIER_TIERS", "memory").split(",") if k.strip()]
        tiers = []
        for kind in kinds:
            prefix = f"KVTIER_{kind.upper()}_"
            tier = {name[len(prefix):].lower(): value for name, value in env.items() if name.startswith(prefix)}
            tiers.append({"kind": kind, **tier})
        values["tiers"] = tiers
        return cls.from_dict(values)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> CacheConfig:
        """YAML file if given, else ``KVTIER_CONFIG`` if set, else the environment; then keyword overrides."""
        path = path or os.environ.get("KVTIER_CONFIG")
        base = cls.from_yaml(path) if path else cls.from_env()
        if not overrides:
            return base
        merged = {"chunk_size": base.chunk_size, "tiers": list(base.tiers),
                  "state_snapshots": base.state_snapshots, "tenants": base.tenants, **overrides}
        return cls.from_dict(merged)
