"""The connector's engine-independent parts: paged layout conversions and the lookup socket."""

from __future__ import annotations

import socket

import pytest
import torch

from kvtier import CacheConfig, KVCache
from kvtier.base.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.lookup_socket import LookupClient, LookupServer, socket_path
from kvtier.integrations.vllm.paged import PagedKV, PagedSink, PagedSource

BLOCKS, HEADS, KB, DIM, LAYERS = 12, 2, 32, 16, 3


def cpu_layers() -> list[torch.Tensor]:
    """The CPU backend's tensors: [blocks, heads, block_size, 2 * head_dim], K rows then V rows per head."""
    return [torch.randn(BLOCKS, HEADS, KB, 2 * DIM) for _ in range(LAYERS)]


def test_gather_reads_the_cpu_backends_k_and_v_rows():
    layers = cpu_layers()
    paged = PagedKV(layers, 64, rows_split=True)  # scheduler blocks of 64 = 2 kernel blocks of 32
    block_ids = [4, 1, 3]
    kv = PagedSource(paged, block_ids).chunk(64, 192)
    assert kv.shape == (LAYERS, 2, 128, HEADS, DIM)
    for token in (0, 31, 32, 100, 127):
        absolute = 64 + token
        kernel_block = block_ids[absolute // 64] * 2 + (absolute % 64) // KB
        slab = layers[2][kernel_block].reshape(HEADS, 2 * KB, DIM)  # how the CPU kernel reads the block
        assert torch.equal(kv[2, 0, token], slab[:, absolute % KB])
        assert torch.equal(kv[2, 1, token], slab[:, KB + absolute % KB])


def test_gather_reads_k_and_v_side_by_side_for_cuda_style_layouts():
    layers = [torch.randn(BLOCKS, KB, HEADS, 2 * DIM).transpose(1, 2) for _ in range(LAYERS)]  # [B, H, N, 2D]
    kv = PagedKV(layers, KB, rows_split=False).gather([7, 2], 0, 64)
    assert torch.equal(kv[1, 0, 40], layers[1][2][:, 8, :DIM])
    assert torch.equal(kv[1, 1, 40], layers[1][2][:, 8, DIM:])


def test_sink_scatters_chunks_and_leaves_vllm_prefix_blocks_alone():
    source = PagedKV(cpu_layers(), 64, rows_split=True)
    kv = source.gather([0, 1, 2], 0, 192)
    dest_layers = [torch.zeros(BLOCKS, HEADS, KB, 2 * DIM) for _ in range(LAYERS)]
    dest = PagedKV(dest_layers, 64, rows_split=True)
    sink = PagedSink(dest, [5, 3, 4], first_token=64)  # vLLM already holds the first block
    sink.write(0, 128, kv[:, :, :128])
    sink.write(128, 192, kv[:, :, 128:])
    assert torch.equal(dest.gather([5, 3, 4], 64, 192), kv[:, :, 64:])
    assert not dest_layers[0][10:12].any()  # block 5 = kernel blocks 10 and 11: untouched


def test_layout_checks():
    with pytest.raises(ConfigError):
        PagedKV(cpu_layers(), 48, rows_split=True)  # not a multiple of the kernel block
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra({"chunk_size": 96}).check_block_size(64)
    config = ConnectorConfig.from_extra({"chunk_size": 128, "model_id": "m@1", "tiers": [{"kind": "memory"}]})
    assert (config.model_id, config.cache.chunk_size) == ("m@1", 128)
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra({"chunk_sizes": 128})
    assert config.load_nice == 19 and ConnectorConfig.from_extra({"load_nice": 0}).load_nice == 0
    for bad in (-1, 20, 5.0, True):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra({"load_nice": bad})



def test_event_block_size_divides_the_chunk():
    assert ConnectorConfig.from_extra({"chunk_size": 128}).event_block_size is None
    assert ConnectorConfig.from_extra({"chunk_size": 128, "event_block_size": 32}).event_block_size == 32
    for bad in (48, 0, -32, 32.0, True, "32"):
        with pytest.raises(ConfigError, match="event_block_size"):
            ConnectorConfig.from_extra({"chunk_size": 128, "event_block_size": bad})

def test_lookup_socket_answers_from_the_workers_cache(tmp_path):
    paged = PagedKV(cpu_layers(), 32, rows_split=True)
    cache = KVCache(paged.spec, "m@1", CacheConfig(chunk_size=64))
    tokens = list(range(200))
    cache.store(tokens, PagedSource(paged, list(range(7))))
    cache.store(tokens, PagedSource(paged, list(range(7))), salt=b"tenant")
    path = socket_path(str(tmp_path), "engine-id", 0)
    server = LookupServer(cache, path)
    client = LookupClient([path])
    try:
        assert client.lookup(tokens) == 192
        assert client.lookup(tokens[:100]) == 64
        assert client.lookup([9, *tokens[1:]]) == 0
        assert client.lookup(tokens, salt=b"tenant") == 192
        assert client.lookup(tokens, salt=b"other") == 0
        with socket.socket(socket.AF_UNIX) as rogue:  # garbage on the socket closes that connection only
            rogue.connect(path)
            rogue.sendall(b"\xff" * 8)
        assert client.lookup(tokens) == 192
    finally:
        client.close()
        server.close()
    assert LookupClient([path], timeout_s=0.5).lookup(tokens) == 0  # no worker: a miss, not an error
