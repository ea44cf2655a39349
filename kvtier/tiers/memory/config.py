"""The memory tier's config: how large its buffer is, where it lives, what it evicts by."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.policy import DEFAULT_POLICY
from kvtier.tiers.base import check_device
from kvtier.tiers.control import ControlledTierConfig


@dataclass(frozen=True)
class MemoryTierConfig(ControlledTierConfig):
    """``capacity_bytes``: hard limit of the buffer; ``policy``: eviction policy name; ``prefault``: touch
    every page of the buffer at start (off only where start-up time matters more, as in tests); ``device``:
    ``cpu`` (host RAM) or ``cuda:N`` (a GPU's spare memory); ``huge_pages``: a host buffer that is not pinned
    sits on transparent huge pages, which speeds up every copy in and out and may slow the start (slab.py).
    Pin budget and tenant shares: ControlledTierConfig."""

    kind = "memory"
    capacity_bytes: int = 1 << 30
    policy: str = DEFAULT_POLICY
    prefault: bool = True
    device: str = "cpu"
    huge_pages: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_device(self.device)

