"""The Mooncake tier against a real mooncake_master: keys and namespaces, value safety, a full pool, transfer
buffers, the pool's figures in metrics, and configuration."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvtier import CacheConfig, ConfigError, KVCache, KVSpec
from kvtier.codecs import BytesPayload, get_codec
from kvtier.codecs import blob as blob_module
from kvtier.codecs.blob import blob_bytes, encode_blob
from kvtier.tiers import MooncakeTierConfig
from kvtier.tiers.mooncake.client import advertised_hostname
from kvtier.tiers.mooncake.config import TransferProtocol, segment_size
from harness.process import wait_for
from harness.mooncake_master import master_binary
from tests.tiers.mooncake.conftest import require_mooncake
from tests.tiers.mooncake.helpers import CHUNK, MiB, make_cache, make_tier, prompt, tier_config


@pytest.fixture
def master(mooncake_master):
    yield mooncake_master
    assert mooncake_master.keys() == [], "a test left values in the pool (a tier was not closed)"


def chunk_blob(keys, tokens: list[int], kv: torch.Tensor, i: int, codec: str = "raw") -> bytes:
    """The sealed blob of chunk ``i``, as the tier stores it."""
    ids = np.array(tokens[i * CHUNK : (i + 1) * CHUNK], dtype="<u4")
    return bytes(blob_bytes(encode_blob(keys[i], ids, get_codec(codec), kv[:, :, i * CHUNK : (i + 1) * CHUNK])))


# -- keys and namespaces ---------------------------------------------------------------------------------------
def test_keys_are_prefix_codec_namespace_and_chunk_hash(master):
    tokens, kv = prompt(2)
    with make_cache(master, key_prefix="team-a:") as cache:
        assert cache.store(tokens, kv) == len(tokens)
        namespace = cache.namespace.root.hex()[:16]  # the model's namespace tag: a clear removes a model's keys
        assert master.keys() == sorted(f"team-a:raw:{namespace}:{key.hex()}" for key in cache.keys(tokens))


def test_models_and_tenants_never_read_each_other(master):
    tokens, kv = prompt(3)
    with make_cache(master) as a, make_cache(master, model="other@1", segment_bytes=0) as b:
        a.store(tokens, kv, salt=b"tenant-1")
        assert a.lookup(tokens, salt=b"tenant-2") == 0
        assert a.lookup(tokens) == 0
        assert b.lookup(tokens, salt=b"tenant-1") == 0  # another model
        assert a.lookup(tokens, salt=b"tenant-1") == len(tokens)


# -- value safety ----------------------------------------------------------------------------------------------
KINDS = ("garbage", "truncated", "flipped_bit", "other_key", "other_codec")


def test_planted_truncated_or_foreign_values_are_misses(master):
    """One prompt per kind of bad value, planted at its chunk 1 through the tier itself."""
    with make_cache(master) as cache:
        prompts = [prompt(3, seed=seed) for seed in range(len(KINDS))]
        for kind, (tokens, kv) in zip(KINDS, prompts):
            keys = cache.keys(tokens)
            good = chunk_blob(keys, tokens, kv, 1)
            planted = {
                "garbage": b"not a kvtier value at all" * 10,
                "truncated": good[: len(good) // 2],
                "flipped_bit": good[:-1] + bytes([good[-1] ^ 1]),
                "other_key": chunk_blob(keys, tokens, kv, 0),  # a valid blob of chunk 0 under chunk 1's key
                "other_codec": chunk_blob(keys, tokens, kv, 1, "int8"),  # the right chunk, another codec's bytes
            }[kind]
            assert cache.store(tokens[:CHUNK], kv[:, :, :CHUNK]) == CHUNK
            assert cache.tiers[0].put([(keys[1], BytesPayload(planted))]) == [True]
        for kind, (tokens, kv) in zip(KINDS, prompts):
            out, n = cache.retrieve(tokens)
            assert n == CHUNK, kind  # the prefix ends at the bad chunk
            assert torch.equal(out[:, :, :CHUNK], kv[:, :, :CHUNK]), kind
            assert cache.lookup(tokens) == CHUNK, kind  # the bad value was removed from the pool
            assert cache.store(tokens, kv) == 2 * CHUNK, kind  # stored again, whole again
            out, n = cache.retrieve(tokens)
            assert n == len(tokens) and torch.equal(out, kv), kind
        assert cache.metrics.total("kvtier_corrupt_chunks_total") == len(KINDS)


def test_a_bit_flipped_in_the_pool_is_caught_while_the_chunk_is_copied_out(master, monkeypatch):
    """Chunks whose runs are long enough for the streaming copy are sealed while they are copied into the transfer
    buffer and verified while they are copied out of it (one pass over their bytes each way): a bit flipped in the
    payload of a stored value is still a miss that ends the prefix, and the value is deleted."""
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.float16)  # runs of 32 KiB per chunk
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 50_000, (3 * 64,), generator=gen).tolist()
    kv = torch.randn(spec.chunk_shape(len(tokens)), generator=gen).to(spec.dtype)
    verified = []
    real = blob_module.copy_visiting
    monkeypatch.setattr(blob_module, "copy_visiting", lambda *a: verified.append(1) or real(*a))
    with KVCache(spec, "fused@1", CacheConfig(chunk_size=64, tiers=(tier_config(master),))) as cache:
        assert cache.store(tokens, kv) == len(tokens)
        out = torch.zeros_like(kv)
        assert cache.retrieve(tokens, out)[1] == len(tokens) and torch.equal(out, kv)
        assert len(verified) == 3, "the chunks were not verified in the copy's pass"
        keys = cache.keys(tokens)
        with cache.tiers[0].get([keys[1]]) as (value,):
            flipped = bytearray(value)
        flipped[len(flipped) // 2 + 12345] ^= 0x20  # in the payload, past the first piece
        cache.tiers[0].delete([keys[1]])
        assert cache.tiers[0].put([(keys[1], BytesPayload(bytes(flipped)))]) == [True]
        out.zero_()
        assert cache.retrieve(tokens, out)[1] == 64  # the prefix ends at the flipped chunk
        assert torch.equal(out[:, :, :64], kv[:, :, :64])
        assert cache.metrics.total("kvtier_corrupt_chunks_total") == 1
        assert cache.lookup(tokens) == 64  # the bad value was removed from the pool
        cache.tiers[0].delete(keys)


def test_value_larger_than_a_replica_accepts_is_skipped_and_a_miss_left_in_place(master):
    tokens, kv = prompt(2)
    with make_cache(master) as writer:
        blob_size = len(chunk_blob(writer.keys(tokens), tokens, kv, 0))
        with make_cache(master, segment_bytes=0, max_value_bytes=blob_size - 1) as small:
            assert small.store(tokens, kv) == 0  # too large for it: skipped, never sent
            assert small.metrics.get("kvtier_skipped_stores_total", tier="mooncake", reason="too_large") == 2
            assert writer.store(tokens, kv) == len(tokens)
            assert small.retrieve(tokens)[1] == 0  # a miss for it ...
            assert writer.retrieve(tokens)[1] == len(tokens)  # ... that it did not delete


# -- capacity --------------------------------------------------------------------------------------------------
def test_full_pool_skips_stores_and_evicts_to_make_room(master):
    """16 MiB of pool and 1 MiB values: a put that finds no room is skipped (counted); Mooncake's eviction
    thread then frees values and puts fit again. Nothing raises.

    Mooncake never evicts a value whose lease (granted by a read, 5 s by default) is running, and its eviction
    thread runs between puts: so every put is followed by a read of all that was stored, or on a slow machine
    eviction keeps pace with the puts and the pool is never seen full."""
    value = BytesPayload(bytes(MiB))
    tier = make_tier(master, buffer_bytes=16 * MiB)
    try:
        keys = [i.to_bytes(32, "little") for i in range(200)]
        stored: list[bytes] = []
        for key in keys[:20]:
            if tier.put([(key, value)])[0]:
                stored.append(key)
            with tier.get(stored) as got:
                assert all(v is not None for v in got)  # read back whole, and leased
        assert 8 <= len(stored) < 20  # the first ones fit, then the pool is full
        assert tier._metrics.get("kvtier_skipped_stores_total", tier="mooncake", reason="pool_full") > 0
        assert wait_for(lambda: tier.put([(keys[20], value)])[0], timeout=60.0, interval=0.2)  # leases ran out
        stats = tier.stats()
        assert stats.capacity_bytes == 16 * MiB and stats.used_bytes <= stats.capacity_bytes
        assert not all(tier.contains(stored))  # evicted to make room
    finally:
        tier.close()


def test_batch_beyond_the_transfer_buffer(master):
    """Values move through one registered buffer of buffer_bytes: a batch larger than it is moved in slices that
    fit (puts of half the buffer, gets of the whole), so every value is stored and read back."""
    values = [bytes([i]) * (600 << 10) for i in range(5)]  # 3 MiB in all
    keys = [bytes([i]) * 32 for i in range(5)]
    small = make_tier(master, segment_bytes=32 * MiB, buffer_bytes=2 * MiB)
    large = make_tier(master, segment_bytes=0, buffer_bytes=8 * MiB)
    try:
        assert small.put([(k, BytesPayload(v)) for k, v in zip(keys, values)]) == [True] * 5
        assert small._metrics.get("kvtier_skipped_stores_total", tier="mooncake", reason="no_buffer") == 0
        with small.get(keys) as got:
            assert [bytes(v) for v in got] == values
        assert small._metrics.get("kvtier_mooncake_no_buffer_total", tier="mooncake") == 0
        with large.get(keys) as got:
            assert [bytes(v) for v in got] == values
        assert small._buffers.registered_bytes == 2 * MiB and large._buffers.registered_bytes == 8 * MiB
        assert small._buffers.largest_free == 2 * MiB  # every slice's room handed back
        small.delete(keys)
    finally:
        large.close()
        small.close()


def test_transfers_take_turns_and_one_without_a_turn_keeps_no_buffer(master):
    """Batches of one tier move max_transfers at a time; one that gets no turn before its deadline is a skipped
    store or a miss (not a failure of the pool), and its share of the registered buffer is free again at once."""
    keys = [bytes([i]) * 32 for i in range(4)]
    values = [bytes([i + 1]) * (256 << 10) for i in range(4)]
    tier = make_tier(master, timeout_s=0.3, max_transfers=1)
    try:
        assert tier.put([(keys[0], BytesPayload(values[0]))]) == [True]
        turns = tier._client._transfers
        assert turns.acquire(False, 5)  # another request's transfer holds the only turn
        try:
            assert tier.put([(keys[1], BytesPayload(values[1]))]) == [False]
            with tier.get(keys[:1]) as got:
                assert got == [None]
        finally:
            turns.release()
        assert tier._metrics.get("kvtier_skipped_stores_total", tier="mooncake", reason="busy") == 1
        assert tier._metrics.get("kvtier_mooncake_busy_total", tier="mooncake", op="get") == 1
        assert tier._metrics.total("kvtier_tier_errors_total") == 0
        assert tier._buffers.largest_free == tier._buffers.registered_bytes == 16 * MiB

        def read(i: int) -> bytes | None:
            with tier.get([keys[i]]) as got:
                return None if got[0] is None else bytes(got[0])

        with ThreadPoolExecutor(4) as pool:  # batches from four threads queue for the turn and all arrive intact
            stored = list(pool.map(lambda i: tier.put([(keys[i], BytesPayload(values[i]))]), range(4)))
            assert stored == [[True]] * 4
            assert list(pool.map(read, range(4))) == values
        tier.delete(keys)
    finally:
        tier.close()


def test_pool_figures_in_stats_and_metrics(master):
    tokens, kv = prompt(4)
    with make_cache(master, segment_bytes=32 * MiB) as a, make_cache(master, segment_bytes=48 * MiB) as b:
        a.store(tokens, kv)
        stats = b.tiers[0].stats()  # the whole pool, seen from either replica
        assert stats.capacity_bytes == 80 * MiB
        assert stats.entries == 4
        assert stats.used_bytes == 4 * len(chunk_blob(a.keys(tokens), tokens, kv, 0))
        gauges = b.metrics.snapshot()
        assert gauges['kvtier_tier_capacity_bytes{tier="mooncake"}'] == 80 * MiB
        assert gauges['kvtier_tier_entries{tier="mooncake"}'] == 4
        assert gauges['kvtier_mooncake_segment_bytes{tier="mooncake"}'] == 48 * MiB
        assert gauges['kvtier_mooncake_joined{tier="mooncake"}'] == 1


# -- configuration ---------------------------------------------------------------------------------------------
def test_config_from_env_and_yaml(tmp_path):
    env = {"KVTIER_TIERS": "memory,mooncake", "KVTIER_MOONCAKE_MASTER_ADDRESS": "mc-master:50051",
           "KVTIER_MOONCAKE_METADATA_SERVER": "http://mc-master:8080/metadata",
           "KVTIER_MOONCAKE_SEGMENT_BYTES": "8GiB", "KVTIER_MOONCAKE_PROTOCOL": "rdma",
           "KVTIER_MOONCAKE_TIMEOUT_S": "0.25"}
    cfg = CacheConfig.from_env(env).tiers[1]
    assert isinstance(cfg, MooncakeTierConfig)
    assert (cfg.master_address, cfg.segment_bytes, cfg.protocol, cfg.timeout_s) == (
        "mc-master:50051", 8 << 30, TransferProtocol.RDMA, 0.25)
    assert cfg.master_metrics_url == "http://mc-master:9003/metrics"
    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers:\n  - kind: mooncake\n    master_address: 10.0.0.5:50051\n"
                    "    metadata_server: P2PHANDSHAKE\n    segment_share: 0.25\n    local_hostname: 10.0.0.7\n")
    cfg = CacheConfig.from_yaml(path).tiers[0]
    assert (cfg.segment_share, advertised_hostname(cfg), cfg.metadata_server) == (0.25, "10.0.0.7", "P2PHANDSHAKE")


def test_segment_size_from_bytes_or_share():
    assert segment_size(MooncakeTierConfig(segment_bytes=64 * MiB), 0) == 64 * MiB
    assert segment_size(MooncakeTierConfig(segment_share=0.25), 1 << 30) == 256 * MiB
    assert segment_size(MooncakeTierConfig(segment_share=0.01), 1 << 30) == 0  # under Mooncake's 16 MiB
    assert segment_size(MooncakeTierConfig(), 0) == 1 << 30
    assert advertised_hostname(MooncakeTierConfig(master_address="127.0.0.1:1")) == "127.0.0.1"


@pytest.mark.parametrize("bad", [
    {"master_address": "no-port"}, {"segment_bytes": 8 * MiB}, {"segment_bytes": MiB, "segment_share": 0.5},
    {"segment_share": 1.5}, {"segment_device": "gpu0"}, {"key_prefix": "a b"}, {"timeout_s": 0},
    {"buffer_bytes": 1024}, {"codec": "nope"}, {"metadata_server": " "}, {"max_transfers": 0},
])
def test_bad_config_is_rejected(bad):
    with pytest.raises(ConfigError):
        MooncakeTierConfig(**bad)


def test_import_kvtier_without_mooncake():
    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.store'] = None\n"
        "from kvtier import CacheConfig, ConfigError, KVCache, KVSpec\n"
        "cfg = CacheConfig(tiers=({'kind': 'mooncake', 'master_address': '127.0.0.1:1'},))\n"
        "try:\n"
        "    KVCache(KVSpec(1, 1, 8, 'float16'), 'm', cfg)\n"
        "except ConfigError as exc:\n"
        "    assert 'pip install' in str(exc) and 'libibverbs1' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('expected ConfigError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_docs_page_examples_parse():
    """The Mooncake tier page's YAML and environment examples are valid configurations."""
    import re
    from pathlib import Path

    import yaml

    section = (Path(__file__).resolve().parents[3] / "docs" / "tiers" / "mooncake.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1)
    config = CacheConfig.from_dict(yaml.safe_load(block))
    assert [t.kind for t in config.tiers] == ["memory", "mooncake"] and config.tiers[1].segment_bytes == 64 << 30
    config = CacheConfig.from_env(dict(re.findall(r"export (KVTIER_\w+)=(\S+)", section)))
    assert config.tiers[1].segment_share == 0.5 and config.tiers[1].master_address == "mc-master:50051"
    require_mooncake()
    flags = re.search(r"mooncake_master (.*?)\n```", section, re.DOTALL).group(1)
    master = subprocess.run([master_binary(), "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in re.findall(r"--(\w+)=", flags):  # every flag shown exists in the installed master
        assert f"-{flag} (" in master, flag
