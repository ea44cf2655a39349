"""Eviction policies behind one protocol, looked up by name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvtier.base.errors import ConfigError
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.tinylfu import TinyLFUPolicy

#: What a memory or disk tier evicts by unless configured otherwise; README "Choosing an eviction policy" has
#: the measurements behind it.
DEFAULT_POLICY = "arc-lfu"

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "arc-lfu": partial(ARCPolicy, history=True),
    "tinylfu": TinyLFUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None


__all__ = ["ARCPolicy", "DEFAULT_POLICY", "EvictionPolicy", "LRUPolicy", "POLICIES", "S3FIFOPolicy", "TinyLFUPolicy",
           "make_policy"]
