"""Where the memory tier keeps its bytes: one preallocated buffer, in host RAM or on a GPU.

* Host (``cpu``): on transparent huge pages (``huge_pages``) and, where CUDA is present, pinned, so copies
  between it and a GPU run by DMA at the link's speed and asynchronously. The pages are pinned where they
  are (``cudaHostRegister``), exactly ``capacity`` bytes: torch's pinned allocator rounds every allocation up
  to a power of two (a 40 GiB tier would pin 64 GiB) and keeps 4 KiB pages. An entry is written in place
  (``Payload.write_into`` its slot) and read as a view of its slot: one copy in, one copy out.
* GPU (``cuda:N``), for a node whose spare VRAM should hold KV: the buffer lives on that device. The tier
  protocol hands out bytes the CPU reads (memoryviews), so an entry is staged through a reused pinned host
  buffer on the way in and copied into pinned host memory on the way out: one more copy per hop, over PCIe,
  in exchange for capacity that host RAM lacks. Both copies run on kvtier's side stream (``kvtier.native.gpu``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from kvtier.base.errors import ConfigError
from kvtier.codecs import Payload
from kvtier.codecs.base import write_payloads
from kvtier.native import gpu
from kvtier.native.hugepages import HUGE_PAGE, huge_page_map
from kvtier.tiers.base import check_device


class HostSlab:
    """``huge_pages``: back a buffer of 2 MiB or more with transparent huge pages.

    A chunk's copy in or out of the slab walks 32 MiB (an 8B-shaped chunk of 256 tokens), which on 4 KiB pages
    is 8,192 TLB entries against 16. The price is paid at start, when the buffer is prefaulted. What that
    gains and costs is measured on docs/benchmarks/tiers.md ("Why the code is shaped this way").

    ``pinning``: how the buffer is pinned where CUDA is present (``registered``: its own pages, pinned in
    place; ``allocated``: torch's pinned allocator, where registering failed), else ``none``.
    """

    def __init__(self, capacity: int, prefault: bool, huge_pages: bool = True) -> None:
        cuda = torch.cuda.is_available()  # pinned host memory lets host<->GPU copies run by DMA, asynchronously
        self._map = None
        self.pinning = "none"
        if huge_pages and capacity >= HUGE_PAGE:
            self._map = huge_page_map(capacity)  # the tensor holds the mapping while any view of it lives
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8, count=capacity)
        else:
            self.buffer = torch.empty(capacity, dtype=torch.uint8)
        if prefault:
            self.buffer.zero_()  # fault the pages in now, not on the first stores (pinning faults them too)
        if cuda and capacity:
            try:
                if _register(self.buffer):
                    self.pinning = "registered"
                else:
                    self.buffer, self._map = torch.zeros(capacity, dtype=torch.uint8, pin_memory=True), None
                    self.pinning = "allocated"
            except RuntimeError:  # CUDA cannot start in this process (a child forked after the parent used it)
                pass
        self._view = memoryview(self.buffer.numpy()) if capacity else memoryview(b"")

    def write_many(self, items: Sequence[tuple[int, Payload]]) -> None:
        """Write payloads at their offsets, their bulk copies together in one call (``write_payloads``)."""
        write_payloads([(self._view[offset : offset + payload.nbytes], payload) for offset, payload in items])

    def read(self, offset: int, nbytes: int) -> memoryview:
        """A view of the entry: valid while the entry's slot is not reused (the tier pins it)."""
        return self._view[offset : offset + nbytes]


class DeviceSlab:
    def __init__(self, capacity: int, device: str, prefault: bool) -> None:
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        if prefault:
            self.buffer.zero_()
        self._staging = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self._lock = threading.Lock()  # one staged write at a time: the staging buffer is shared

    def _write(self, offset: int, payload: Payload) -> None:
        n = payload.nbytes
        with self._lock:
            if self._staging.numel() < n:
                self._staging = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            payload.write_into(memoryview(self._staging.numpy())[:n])
            gpu.copy_pairs([(self.buffer[offset : offset + n], self._staging[:n])])  # done before staging is reused

    def write_many(self, items: Sequence[tuple[int, Payload]]) -> None:
        """Write payloads at their offsets, each staged through the pinned buffer."""
        for offset, payload in items:
            self._write(offset, payload)

    def read(self, offset: int, nbytes: int) -> memoryview:
        """A pinned host copy of the entry: valid for as long as the caller keeps the view."""
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        gpu.copy_pairs([(host, self.buffer[offset : offset + nbytes])])
        return memoryview(host.numpy())


def _register(buffer: torch.Tensor) -> bool:
    """Pin ``buffer``'s pages in place for CUDA (unpinned again when the tensor is freed); False if CUDA refused."""
    cudart = torch.cuda.cudart()
    register, unregister = getattr(cudart, "cudaHostRegister", None), getattr(cudart, "cudaHostUnregister", None)
    if register is None or unregister is None:
        return False
    ptr = buffer.data_ptr()
    if int(register(ptr, buffer.numel(), 0)) != 0:
        return False
    weakref.finalize(buffer, unregister, ptr)  # runs once no view of the buffer is left, before its memory goes
    return True


def make_slab(capacity: int, device: str, prefault: bool, huge_pages: bool = True) -> HostSlab | DeviceSlab:
    check_device(device)
    if device == "cpu":
        return HostSlab(capacity, prefault, huge_pages)
    if not torch.cuda.is_available():
        raise ConfigError(f"memory tier device {device}: CUDA is not available here")
    if int(device.split(":")[1]) >= torch.cuda.device_count():
        raise ConfigError(f"memory tier device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    return DeviceSlab(capacity, device, prefault)
