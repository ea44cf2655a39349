"""Eviction policies behind one protocol, looked up by name."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.errors import ConfigError
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.lru import LRUPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None


__all__ = ["EvictionPolicy", "LRUPolicy", "POLICIES", "make_policy"]
