"""Eviction policies behind one protocol, looked up by name in ``POLICIES`` (a lazy registry: a policy's
module is imported the first time a tier asks for it).

``POLICIES[name]`` is a zero-argument factory of a fresh policy; ``make_policy(name)`` calls it, or raises a
ConfigError naming the known policies. A new policy is one module here and one ``POLICIES.register`` line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.base.registry import Registry, lazy_exports
from kvtier.policy.base import EvictionPolicy

#: What a memory or disk tier evicts by unless configured otherwise; docs/policies.md has the measurements
#: behind the choice.
DEFAULT_POLICY = "arc-lfu"

POLICIES: Registry[Callable[[], EvictionPolicy]] = Registry("eviction policy")
POLICIES.register("lru", "kvtier.policy.lru", "LRUPolicy")
POLICIES.register("s3fifo", "kvtier.policy.s3fifo", "S3FIFOPolicy")
POLICIES.register("arc", "kvtier.policy.arc", "ARCPolicy")
POLICIES.register("arc-lfu", "kvtier.policy.arc", "ARCPolicy", history=True)
POLICIES.register("tinylfu", "kvtier.policy.tinylfu", "TinyLFUPolicy")


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy of the registered ``name``; ConfigError for an unknown one."""
    return POLICIES.lookup(name)()


__getattr__ = lazy_exports(__name__, globals(), {
    "ARCPolicy": "kvtier.policy.arc", "LRUPolicy": "kvtier.policy.lru", "S3FIFOPolicy": "kvtier.policy.s3fifo",
    "TinyLFUPolicy": "kvtier.policy.tinylfu",
})

if TYPE_CHECKING:
    from kvtier.policy.arc import ARCPolicy
    from kvtier.policy.lru import LRUPolicy
    from kvtier.policy.s3fifo import S3FIFOPolicy
    from kvtier.policy.tinylfu import TinyLFUPolicy

__all__ = ["ARCPolicy", "DEFAULT_POLICY", "EvictionPolicy", "LRUPolicy", "POLICIES", "S3FIFOPolicy", "TinyLFUPolicy",
           "make_policy"]
