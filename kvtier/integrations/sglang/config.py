"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config`` JSON, parsed once per rank.

SGLang's own keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ``tp_lcm_size``) are
dropped; kvtier's own keys are taken out; everything else goes to :meth:`kvtier.CacheConfig.from_dict`
(``tiers``, codecs per tier), so the extra config reads like a kvtier config file:

* ``model_id`` names the weights in every page key. Default: SGLang's ``model_name``. Set it when servers load
  the same weights from different paths and should share a disk, Redis or Mooncake tier.
* ``tenant`` (a string) salts every key of this server: servers with different tenants never see each other's
  pages even in a shared tier. SGLang's own per-request ``cache_salt`` is already inside its page keys.
* ``chunk_size``, if given, must equal SGLang's ``--page-size``: a kvtier chunk is one SGLang page.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.base.errors import ConfigError
from kvtier.core.config import CacheConfig

#: keys SGLang reads from the same JSON (the dynamic loader and its zero-copy switch)
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")
_OWN_KEYS = ("model_id", "tenant")


@dataclass(frozen=True)
class BackendConfig:
    """``cache_values``: the tier chain's settings as given (``chunk_size`` comes from SGLang's page size)."""

    cache_values: Mapping[str, Any]
    model_id: str | None = None
    tenant: str = ""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> BackendConfig:
        values = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}
        own = {key: values.pop(key) for key in _OWN_KEYS if key in values}
        for key, value in own.items():
            if not isinstance(value, str) or (key == "model_id" and not value):
                raise ConfigError(f"hicache extra config: {key} must be a {'non-empty ' * (key == 'model_id')}string")
        CacheConfig.from_dict(values)  # unknown keys, tiers and sizes fail here, at SGLang's start
        return cls(cache_values=values, **own)

    def cache_config(self, page_size: int) -> CacheConfig:
        """The tier chain's config for SGLang pages of ``page_size`` tokens."""
        chunk = self.cache_values.get("chunk_size")
        if chunk is not None and int(chunk) != page_size:
            raise ConfigError(f"kvtier chunk_size {chunk} must equal SGLang's page size {page_size} (or be left out)")
        return CacheConfig.from_dict({**self.cache_values, "chunk_size": page_size})
