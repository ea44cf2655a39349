"""SGLang's host KV pool as the tests build it, and the backend built through SGLang's own loader.

SGLang 0.5.23's host pools (``sglang.srt.mem_cache.pool_host.mha`` / ``.mla``) do not import on a CPU-only
machine: ``pool_host`` imports ``sglang.srt.configs``, whose ``nano_nemotron_vl`` imports
``sglang.srt.multimodal.internvl_utils``, which imports ``torchvision`` at module level; the torchvision
that matches this machine's torch (2.13, CPU) is PyPI's CUDA build, whose operators do not load against the
CPU torch (``operator torchvision::nms does not exist``). So ``HostPool`` allocates ``kv_buffer`` in the
documented layout of ``MHATokenToKVPoolHost.init_kv_buffer`` / ``MLATokenToKVPoolHost.init_kv_buffer`` and
carries the attributes the backend reads (``layout``, ``page_size``, ``layer_num``, ``head_num``,
``head_dim``, ``v_head_dim`` or ``kv_cache_dim``, ``dtype``), plus the pool's ``get_data_page`` for the older
interface. Everything else (``HiCacheStorageConfig``, ``StorageBackendFactory``'s ``dynamic`` loader,
``get_hash_str`` page keys, ``PoolTransfer``) is SGLang's own code.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from kvtier.integrations.sglang.pages import PoolGeometry


class HostPool:
    """A host KV pool of ``pages`` pages in SGLang's documented layout (see the module docstring)."""

    def __init__(self, layout: str, *, mla: bool = False, pages: int = 16, page_size: int = 4, layers: int = 3,
                 heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.page_size, self.layer_num, self.dtype = layout, page_size, layers, dtype
        self.size = pages * page_size
        if mla:
            self.kv_cache_dim = head_dim
            self.geometry = PoolGeometry(layout, page_size, layers, 1, head_dim, dtype, mla=True)
        else:
            self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, head_dim
            self.geometry = PoolGeometry(layout, page_size, layers, heads, head_dim, dtype, mla=False)
        self.kv_buffer = torch.zeros(self.geometry.buffer_shape(self.size), dtype=dtype)

    def fill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=gen))

    def raw_page(self, start: int) -> torch.Tensor:
        """The page's bytes as SGLang's pool slices them (``get_data_page(start, flat=False)``)."""
        P = self.page_size  # noqa: N806
        mha = not hasattr(self, "kv_cache_dim")
        if self.layout == "layer_first":
            return (self.kv_buffer[:, :, start : start + P] if mha else self.kv_buffer[:, start : start + P]).clone()
        if self.layout == "page_first":
            return (self.kv_buffer[:, start : start + P] if mha else self.kv_buffer[start : start + P]).clone()
        return (self.kv_buffer[:, start // P : start // P + 1] if mha
                else self.kv_buffer[start // P : start // P + 1]).clone()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.raw_page(index)
        return page.flatten() if flat else page

    def host_indices(self, first_page: int, n: int) -> torch.Tensor:
        return torch.arange(first_page * self.page_size, (first_page + n) * self.page_size, dtype=torch.int64)


class MambaHostPool:
    """A Mamba state host pool as SGLang 0.5.23 hands it to a storage backend (``pool_host/mamba.py``, which
    does not import here either): one page per state slot (``page_size`` 1); a page's flat bytes are its
    temporal (recurrent) state followed by each convolution state, in the ``layer_first`` layout
    (``[layers, slots, ...]`` per buffer). ``get_data_page`` / ``get_dummy_flat_data_page`` /
    ``set_from_flat_data_page`` keep that contract; the buffers are filled at random."""

    page_size = 1
    layout = "layer_first"

    def __init__(self, slots: int = 8, layers: int = 2, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.temporal_buffer = torch.randn(layers, slots, 4, 8, generator=gen).to(torch.float32)
        self.conv_buffer = [torch.randn(layers, slots, 3, 16, generator=gen).to(torch.bfloat16)]

    def _page_tensors(self, index: int) -> list[torch.Tensor]:
        return [buf[:, index : index + 1] for buf in (self.temporal_buffer, *self.conv_buffer)]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in self._page_tensors(index)])

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.get_data_page(0))

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        flat, at = data_page.contiguous().view(torch.uint8).reshape(-1), 0
        for tensor in self._page_tensors(index):
            n = tensor.numel() * tensor.element_size()
            tensor.copy_(flat[at : at + n].clone().view(tensor.dtype).reshape(tensor.shape))
            at += n


def storage_config(extra: dict[str, Any] | None = None, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   model: str = "org/model-a") -> HiCacheStorageConfig:
    """What SGLang's cache controller builds for a backend, with kvtier's ``dynamic`` extra config."""
    config = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage",
              "interface_v1": 1, **(extra or {})}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=model, extra_config=config)


def backend(pool: HostPool, extra: dict[str, Any] | None = None, **config: Any):
    """The backend as SGLang builds and attaches it: the ``dynamic`` factory, then ``register_mem_pool_host``."""
    sc = storage_config(extra, mla=hasattr(pool, "kv_cache_dim"), **config)
    made = StorageBackendFactory.create_backend("dynamic", sc, pool)
    made.register_mem_pool_host(pool)
    return made


def page_keys(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's chained page hashes of ``tokens`` (its own function)."""
    return get_hash_str(tokens, None, page_size=page_size)
