"""The memory tier: chunks in one preallocated host (or device) buffer, evicted by a policy."""

from kvtier.tiers.memory.tier import MemoryTier, MemoryTierConfig

__all__ = ["MemoryTier", "MemoryTierConfig"]
