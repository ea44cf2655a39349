"""Anonymous memory on transparent huge pages, for the large host buffers the tiers keep.

A 4 KiB page costs a TLB entry and, when fresh, a fault and a zeroed page; a 2 MiB page covers 512 of them.
Both tiers that keep large host buffers use this: the disk tier's read buffers (faults in fresh buffers had
bound its reads, ``tiers/disk/files.py``) and the memory tier's slab (copies into and out of it miss the TLB
less, ``tiers/slab.py``).
"""

from __future__ import annotations

import mmap

#: The transparent huge page size on x86-64 and most arm64 kernels; buffers at least this large use them.
HUGE_PAGE = 2 << 20


def huge_page_map(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` rounded up to whole huge pages, advised ``MADV_HUGEPAGE``.

    Unfaulted: each huge page is faulted (and zeroed by the kernel) on first touch. Where the kernel has no
    transparent huge pages (or Python no ``MADV_HUGEPAGE``), the same mapping on plain pages.
    """
    buf = mmap.mmap(-1, -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out of this kernel: plain pages
            pass
    return buf
