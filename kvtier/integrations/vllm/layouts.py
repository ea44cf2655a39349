"""vLLM 0.32's paged KV tensors, built the way its GPU workers build them, on any device and without vLLM.

vLLM allocates every layer of a KV cache group in one int8 buffer, views it as a logical ``[L, B, H, N, C]``
tensor (C in bytes) whose physical order is one of its ``KVCacheLayout`` stride orders, and hands the
connector each layer's ``[B, H, N, C]`` slice viewed as the KV dtype (``vllm.v1.kv_cache_interface``'s
``create_kv_cache_views``). Tests and ``benchmarks/cuda_transfer.py`` build them here where vLLM's CUDA build
cannot be installed; ``tests/integrations/test_paged_layouts.py`` checks that these views are vLLM's own,
stride for stride, where vLLM is installed.
"""

from __future__ import annotations

import torch

#: vLLM 0.32's KVCacheLayout members: logical [L, B, H, N, C] axes in physical (memory) order
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides of logical ``shape`` with its axes laid out in ``order`` (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides)


def vllm_layers(layout: str, layers: int, blocks: int, heads: int, block_size: int, head_dim: int,
                dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> list[torch.Tensor]:
    """One ``[blocks, heads, block_size, 2 * head_dim]`` view per layer of one random buffer, as vLLM lays it."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape = (layers, blocks, heads, block_size, 2 * head_dim * itemsize)
    nbytes = 1
    for dim in shape:
        nbytes *= dim
    raw = torch.empty(nbytes, dtype=torch.int8, device=device)
    if dtype.is_floating_point:  # no NaN or inf patterns: equality checks compare values
        raw.view(dtype).normal_()
    else:
        raw.random_(-128, 128)
    view = torch.as_strided(raw, shape, layout_strides(shape, LAYOUTS[layout]))
    return [view[i].view(dtype) for i in range(layers)]


def reference_token(layer: torch.Tensor, block: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[heads, head_dim]`` of one token, read through vLLM's logical ``[B, H, N, K|V]`` view."""
    head_dim = layer.shape[-1] // 2
    return layer[block, :, row, :head_dim], layer[block, :, row, head_dim:]
