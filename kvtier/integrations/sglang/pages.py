"""SGLang host-pool pages as kvtier's canonical chunks: views into the pool, never copies.

SGLang's host KV pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` in
``sglang/srt/mem_cache/pool_host``) keeps one tensor, ``kv_buffer``, in one of these layouts (``size`` is the
pool's token capacity, a page is ``page_size`` consecutive token slots starting at a multiple of it):

=====================  ===========================================  ==========================================
layout                 MHA ``kv_buffer``                            MLA ``kv_buffer``
=====================  ===========================================  ==========================================
``layer_first``        ``[2, layers, size, heads, head_dim]``       ``[layers, size, 1, kv_dim]``
``page_first``         ``[2, size, layers, heads, head_dim]``       ``[size, layers, 1, kv_dim]``
``page_first_direct``  ``[2, pages, layers, page, heads, head_dim]`` ``[pages, layers, page, 1, kv_dim]``
=====================  ===========================================  ==========================================

A page is stored as kvtier's canonical chunk ``[layers, 2, page, heads, head_dim]``, so its bytes do not
depend on the layout of the pool that wrote it: a page written from a ``layer_first`` pool reads correctly
into a ``page_first`` one. MLA's single latent ``[page, 1, kv_dim]`` per layer is split in two halves (K
slot: the first ``kv_dim / 2`` values, V slot: the rest), i.e. ``KVSpec(layers, 1, kv_dim / 2)``; ``kv_dim``
(``kv_lora_rank + qk_rope_head_dim``, 576 for DeepSeek) must be even.

Other layouts (``page_head``, ``page_unified``, NPU splits) and MHA pools whose V width differs from K's are
refused with ``ConfigError`` at registration: the backend then serves nothing rather than guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.base.errors import ConfigError
from kvtier.base.keys import ChunkHash
from kvtier.base.layout import KVSpec

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PoolGeometry:
    """What of a host pool decides the bytes of a page: the pool's layout only decides where they sit."""

    layout: str
    page_size: int
    num_layers: int
    num_heads: int  #: 1 for MLA
    head_dim: int  #: kv_dim for MLA
    dtype: torch.dtype
    mla: bool

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"kvtier cannot read SGLang host layout {self.layout!r}; supported: {LAYOUTS}")
        if self.mla and self.head_dim % 2:
            raise ConfigError(f"MLA kv_dim {self.head_dim} must be even to map onto kvtier's K/V chunk")

    @property
    def spec(self) -> KVSpec:
        if self.mla:
            return KVSpec(self.num_layers, 1, self.head_dim // 2, self.dtype)
        return KVSpec(self.num_layers, self.num_heads, self.head_dim, self.dtype)

    def buffer_shape(self, size: int) -> tuple[int, ...]:
        """The shape of a ``kv_buffer`` of this geometry holding ``size`` tokens (the table above)."""
        L, P, H, D = self.num_layers, self.page_size, self.num_heads, self.head_dim  # noqa: N806
        if self.mla:
            return {"layer_first": (L, size, 1, D), "page_first": (size, L, 1, D),
                    "page_first_direct": (size // P, L, P, 1, D)}[self.layout]
        return {"layer_first": (2, L, size, H, D), "page_first": (2, size, L, H, D),
                "page_first_direct": (2, size // P, L, P, H, D)}[self.layout]

    def page(self, kv_buffer: torch.Tensor, start: int) -> torch.Tensor:
        """The canonical view ``[layers, 2, page, heads, head_dim]`` of the page whose first token slot is
        ``start`` (a multiple of ``page_size``). Writing into it writes the pool."""
        P = self.page_size  # noqa: N806
        if self.mla:
            if self.layout == "layer_first":
                latent = kv_buffer[:, start : start + P]  # [L, P, 1, D]
            elif self.layout == "page_first":
                latent = kv_buffer[start : start + P].transpose(0, 1)
            else:
                latent = kv_buffer[start // P]  # [L, P, 1, D]
            return latent.unflatten(-1, (2, self.head_dim // 2)).permute(0, 3, 1, 2, 4)
        if self.layout == "layer_first":
            return kv_buffer[:, :, start : start + P].transpose(0, 1)
        if self.layout == "page_first":
            return kv_buffer[:, start : start + P].permute(2, 0, 1, 3, 4)
        return kv_buffer[:, start // P].transpose(0, 1)

    def flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """The canonical view of one page handed over flat by SGLang's older interface (``get_data_page(i,
        flat=True)`` / ``get_dummy_flat_data_page()``): the page's slice of ``kv_buffer`` in the pool's layout,
        flattened. Raises ConfigError for a tensor of another size or dtype."""
        shape = self.buffer_shape(self.page_size)
        if flat.dtype != self.dtype or flat.numel() != torch.Size(shape).numel():
            raise ConfigError(f"flat page of {flat.numel()} {flat.dtype} is not the pool's {shape} {self.dtype}")
        return self.page(flat.reshape(shape), 0)


def geometry_of(pool: Any) -> PoolGeometry:
    """The geometry of a registered SGLang host pool (read from its attributes; ConfigError if unsupported)."""
    try:
        layout, page_size, dtype = pool.layout, int(pool.page_size), pool.dtype
        layers = int(pool.layer_num)
        if hasattr(pool, "kv_cache_dim"):  # MLATokenToKVPoolHost
            return PoolGeometry(layout, page_size, layers, 1, int(pool.kv_cache_dim), dtype, mla=True)
        heads, head_dim = int(pool.head_num), int(pool.head_dim)
        v_head_dim = int(getattr(pool, "v_head_dim", head_dim) or head_dim)
    except AttributeError as exc:
        raise ConfigError(f"not an SGLang host KV pool kvtier can read: {exc}") from None
    if v_head_dim != head_dim:
        raise ConfigError(f"MHA pools with V width {v_head_dim} != K width {head_dim} are not supported")
    return PoolGeometry(layout, page_size, layers, heads, head_dim, dtype, mla=False)


def check_buffer(geometry: PoolGeometry, kv_buffer: Any) -> int:
    """The token slots of ``kv_buffer`` if it is a CPU tensor of ``geometry``'s layout and dtype; ConfigError
    otherwise."""
    if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.device.type != "cpu":
        raise ConfigError("the host pool's kv_buffer must be a CPU tensor")
    # the axis that counts token slots (pages for page_first_direct), per layout: see the module's table
    axis = {"layer_first": 1, "page_first": 0, "page_first_direct": 0}[geometry.layout] + (0 if geometry.mla else 1)
    if kv_buffer.dim() <= axis:
        raise ConfigError(f"host kv_buffer {tuple(kv_buffer.shape)} is not a {geometry.layout} buffer")
    tokens = kv_buffer.shape[axis] * (geometry.page_size if geometry.layout == "page_first_direct" else 1)
    if tuple(kv_buffer.shape) != geometry.buffer_shape(tokens) or kv_buffer.dtype != geometry.dtype:
        raise ConfigError(f"host kv_buffer {tuple(kv_buffer.shape)} {kv_buffer.dtype} is not a {geometry.layout} "
                          f"buffer of {geometry}")
    return tokens


def key_token_ids(keys: Sequence[ChunkHash], page_size: int) -> np.ndarray:
    """The token ids recorded in each page's blob: its key's eight 32-bit words, repeated over the page's
    ``page_size`` slots (SGLang passes no token ids; these make a tier that keeps no checksum, the memory tier,
    check the key too)."""
    words = np.frombuffer(b"".join(keys), dtype="<u4").reshape(len(keys), 8)
    return np.ascontiguousarray(np.tile(words, (1, -(-page_size // 8)))[:, :page_size].reshape(-1))
