"""The retrieve/store pipeline through a real KVCache: many windows in flight give the same bytes as one,
verification comes before the sink, pins are released on every path, and a failure ends the prefix."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.errors import TierError
from kvtier.base.metrics import Metrics
from kvtier.codecs import BytesPayload
from kvtier.codecs.blob import parse_blob
from kvtier.core.bounded import batches
from kvtier.core.jobs import PipelineTuning
from kvtier.core.pipeline import Pipeline
from kvtier.tiers import BoundedGets, DiskTierConfig, MemoryTierConfig
from tests.codecs.conftest import kv_like
from tests.codecs.test_cache import cache_roundtrip

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
CHUNK = 16
N_CHUNKS = 12


#: Every chunk its own window, so a dozen small chunks exercise many tasks in flight.
ONE_CHUNK = PipelineTuning(window_bytes=1, max_window_bytes=1)


def memory_cache(codec: str = "raw", tuning: PipelineTuning = ONE_CHUNK, **kw) -> KVCache:
    tiers = (MemoryTierConfig(capacity_bytes=8 << 20, codec=codec, prefault=False),)
    return KVCache(SPEC, model="m", config=CacheConfig(chunk_size=CHUNK, tiers=tiers), tuning=tuning, **kw)


def data(seed: int = 0) -> tuple[list[int], torch.Tensor]:
    tokens = N_CHUNKS * CHUNK
    return list(range(seed, seed + tokens)), kv_like(layers=2, tokens=tokens, heads=2, dim=64, seed=seed)


@pytest.mark.parametrize("codec", ["raw", "lossless", "int8"])
def test_many_windows_from_disk_give_what_each_chunk_decodes_to(tmp_path, codec: str) -> None:
    tiers = (MemoryTierConfig(capacity_bytes=8 << 20, prefault=False),
             DiskTierConfig(path=tmp_path, codec=codec, fsync=False, admission="always"))
    tokens, kv = data()
    with KVCache(SPEC, model="m", config=CacheConfig(chunk_size=CHUNK, tiers=tiers), tuning=ONE_CHUNK) as cache:
        assert cache.store(tokens, kv) == len(tokens)
        cache.tiers[1].flush()
        cache.tiers[0].delete(cache.keys(tokens))  # only the disk holds the prefix now
        out, n = cache.retrieve(tokens)
        assert n == len(tokens)
        for i in range(N_CHUNKS):
            part = slice(i * CHUNK, (i + 1) * CHUNK)
            assert torch.equal(out[:, :, part], cache_roundtrip(codec, kv[:, :, part]))
        assert cache.tiers[0].stats().entries == N_CHUNKS  # every chunk was promoted into memory
        assert cache.metrics.get("kvtier_hit_tokens_total", tier="disk") == len(tokens)


def test_corrupt_chunk_ends_the_prefix_and_later_windows_are_not_read() -> None:
    one_worker = PipelineTuning(window_bytes=1, max_window_bytes=1, decoders=1, read_ahead=0)
    with memory_cache("int8", one_worker) as cache:  # windows one after another: which are read is certain
        tokens, kv = data()
        cache.store(tokens, kv)
        keys = cache.keys(tokens)
        tier = cache.tiers[0]
        with tier.get([keys[4]]) as [view]:
            blob = bytearray(view)
        start = parse_blob(blob, keys[4], verify=False)[0].header_len
        blob[start] = 99  # the int8 payload's version byte
        tier.delete([keys[4]])
        tier.put([(keys[4], BytesPayload(blob))])
        reads = []
        real_get = tier.get
        tier.get = lambda ks: (reads.extend(ks), real_get(ks))[1]
        out, n = cache.retrieve(tokens)
        assert n == 4 * CHUNK
        assert reads == keys[:5]  # nothing after the corrupt chunk's window was read
        assert torch.equal(out[:, :, : 4 * CHUNK], cache.retrieve(tokens[: 4 * CHUNK])[0])
        assert cache.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 1


class RecordingSink:
    """A sink that is not thread-safe: it records whether two writes ever overlapped."""

    def __init__(self, out: torch.Tensor, fail_at: int | None = None) -> None:
        self.out, self.fail_at = out, fail_at
        self.active, self.overlapped, self.written = 0, False, []
        self._lock = threading.Lock()

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        with self._lock:
            self.active += 1
            self.overlapped |= self.active > 1
        try:
            time.sleep(0.002)  # widen the window in which a second writer could enter
            if start == self.fail_at:
                raise RuntimeError("engine refused the chunk")
            self.out[:, :, start:end].copy_(chunk)
            self.written.append(start)
        finally:
            with self._lock:
                self.active -= 1


def test_a_sink_without_concurrent_writes_gets_one_write_at_a_time() -> None:
    with memory_cache("lossless") as cache:
        tokens, kv = data()
        cache.store(tokens, kv)
        sink = RecordingSink(torch.empty_like(kv))
        assert cache.retrieve(tokens, sink) == (None, len(tokens))
        assert not sink.overlapped and sorted(sink.written) == list(range(0, len(tokens), CHUNK))
        assert torch.equal(sink.out, kv)


def test_pins_are_released_when_the_sink_raises() -> None:
    with memory_cache() as cache:
        tokens, kv = data()
        cache.store(tokens, kv)
        with pytest.raises(RuntimeError, match="engine refused"):
            cache.retrieve(tokens, RecordingSink(torch.empty_like(kv), fail_at=5 * CHUNK))
        cache.tiers[0].delete(cache.keys(tokens))
        assert cache.tiers[0].stats().used_bytes == 0  # a pinned entry would keep its bytes until released


@pytest.mark.parametrize("codec", ["int8", "raw"])
def test_a_failing_get_ends_the_prefix_at_its_window(codec: str) -> None:
    """Decoded chunks load in windows, so a get that fails ends the prefix at its window. Raw chunks of the
    memory tier are one window (checked together, then copied back to back), so it ends the tier's part."""
    with memory_cache(codec) as cache:
        tokens, kv = data()
        cache.store(tokens, kv)
        keys = cache.keys(tokens)
        tier = cache.tiers[0]
        real_get = tier.get

        def get(ks):
            if keys[7] in ks:
                raise TierError("device gone")
            return real_get(ks)

        tier.get = get
        out, n = cache.retrieve(tokens, torch.zeros_like(kv))
        assert n == (7 * CHUNK if codec == "int8" else 0)
        assert torch.equal(out[:, :, :n], cache_roundtrip(codec, kv[:, :, :n]))
        assert cache.metrics.get("kvtier_tier_errors_total", tier="memory", op="get") == 1


@pytest.mark.parametrize("codec", ["raw", "cachegen"])
def test_store_in_windows_matches_a_direct_encode(codec: str) -> None:
    with memory_cache(codec) as cache:
        tokens, kv = data(3)
        assert cache.store(tokens, kv) == len(tokens)
        assert cache.tiers[0].stats().entries == N_CHUNKS
        out, n = cache.retrieve(tokens)
        assert n == len(tokens)
        for i in range(N_CHUNKS):
            part = slice(i * CHUNK, (i + 1) * CHUNK)
            assert torch.equal(out[:, :, part], cache_roundtrip(codec, kv[:, :, part]))


def test_a_failing_put_skips_the_rest_of_the_store() -> None:
    with memory_cache("int8") as cache:
        tokens, kv = data()
        tier = cache.tiers[0]
        real_put, calls = tier.put, []

        def put(items):
            calls.append(len(items))
            if len(calls) == 3:
                raise TierError("full disk")
            return real_put(items)

        tier.put = put
        assert cache.store(tokens, kv) == 2 * CHUNK  # the two windows put before the failure
        assert cache.metrics.get("kvtier_tier_errors_total", tier="memory", op="put") == 1
        assert cache.lookup(tokens) == 2 * CHUNK


def test_many_windows_load_under_the_callers_inference_mode() -> None:
    """An engine retrieves inside torch.inference_mode: the tensor retrieve allocates is then an inference
    tensor, which the workers may write only in inference mode too."""
    tokens, kv = data(3)
    with memory_cache() as cache:
        assert cache.store(tokens, kv) == len(tokens)
        with torch.inference_mode():
            out, n = cache.retrieve(tokens)
        assert n == len(tokens) and out.is_inference()
        assert torch.equal(out, kv)


class ConcurrencySink:
    """A thread-safe sink without a destination: records how many writes ran at once and which buffers the
    chunks came in."""

    concurrent_writes = True

    def __init__(self, out: torch.Tensor) -> None:
        self.out, self.active, self.most, self.buffers, self.seen = out, 0, 0, set(), []
        self._lock = threading.Lock()

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        with self._lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.buffers.add(chunk.data_ptr())
            self.seen.append(chunk)  # held, so a fresh tensor per chunk could not reuse a freed one's address
        time.sleep(0.005)  # a slow engine copy: writers that may overlap do
        self.out[:, :, start:end].copy_(chunk)
        with self._lock:
            self.active -= 1


@pytest.mark.parametrize("decoders", [1, 2])
def test_windows_decode_in_at_most_one_slot_per_core_while_others_read_ahead(decoders: int) -> None:
    tuning = PipelineTuning(window_bytes=1, max_window_bytes=1, decoders=decoders, read_ahead=3)
    with memory_cache("int8", tuning) as cache:
        tokens, kv = data()
        cache.store(tokens, kv)
        sink = ConcurrencySink(torch.empty_like(kv))
        assert cache.retrieve(tokens, sink) == (None, len(tokens))
        assert sink.most == decoders
        assert torch.equal(sink.out, cache.retrieve(tokens)[0])


def test_a_sink_without_a_destination_gets_chunks_in_reused_buffers() -> None:
    """Decoding allocates no chunk per chunk: each worker decodes into its own scratch chunk, again and again."""
    # fewer workers than chunks, whatever the machine (a 16-core one has 19 workers by default)
    tuning = PipelineTuning(window_bytes=1, max_window_bytes=1, decoders=2, read_ahead=3)
    with memory_cache("int8", tuning) as cache:
        tokens, kv = data()
        cache.store(tokens, kv)
        sink = ConcurrencySink(torch.empty_like(kv))
        assert cache.retrieve(tokens, sink) == (None, len(tokens))
        assert len(sink.buffers) <= tuning.workers < N_CHUNKS
        for i in range(N_CHUNKS):
            part = slice(i * CHUNK, (i + 1) * CHUNK)
            assert torch.equal(sink.out[:, :, part], cache_roundtrip("int8", kv[:, :, part]))


class ThreadSink:
    """Records the thread of every write."""

    concurrent_writes = True

    def __init__(self, out: torch.Tensor) -> None:
        self.out, self.threads = out, set()

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self.threads.add(threading.get_ident())
        self.out[:, :, start:end].copy_(chunk)


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_copy_only_windows_run_in_the_calling_thread_and_decoding_ones_on_the_pool(codec: str) -> None:
    """raw chunks in memory are one copy each, with nothing to overlap: no thread hop. Decoding is spread."""
    with memory_cache(codec) as cache:
        tokens, kv = data()
        cache.store(tokens, kv)
        sink = ThreadSink(torch.empty_like(kv))
        assert cache.retrieve(tokens, sink) == (None, len(tokens))
        assert (sink.threads == {threading.get_ident()}) == (codec == "raw")
        assert torch.equal(sink.out, cache.retrieve(tokens)[0])


class WrongDestinationSink:
    """Lends memory of the wrong shape (a bug in an engine's sink)."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self.out[:, :, start:end].copy_(chunk)

    def destination(self, start: int, end: int) -> torch.Tensor:
        return self.out[:, :, start : end + 1]


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_a_sink_lending_the_wrong_memory_is_its_error_and_the_chunks_stay_cached(codec: str) -> None:
    with memory_cache(codec) as cache:
        tokens, kv = data()
        cache.store(tokens, kv)
        with pytest.raises(ValueError, match="sink lent"):
            cache.retrieve(tokens, WrongDestinationSink(torch.empty_like(kv)))
        assert cache.lookup(tokens) == len(tokens)  # nothing was taken for a corrupt chunk and deleted
        assert cache.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 0


def test_load_windows_grow_with_the_prefix_up_to_the_cap_and_store_windows_do_not() -> None:
    """Windows of two chunks at least and eight at most, equal in size, and never fewer than 15 (3 per worker)
    while they can grow."""
    chunk_bytes = SPEC.bytes_per_token * CHUNK
    tuning = PipelineTuning(window_bytes=2 * chunk_bytes, max_window_bytes=8 * chunk_bytes, decoders=2, read_ahead=3)
    pipeline = Pipeline(SPEC, CHUNK, Metrics(), tuning)  # 5 workers, 3 windows per worker: 15 at least
    for n, size in [(0, 2), (1, 2), (29, 2), (45, 3), (90, 6), (120, 8), (1000, 8)]:
        idx = list(range(n))
        windows = list(pipeline.windows(idx, grow=True))
        assert [i for w in windows for i in w] == idx  # every chunk once, in order
        assert [len(w) for w in windows] == [size] * (n // size) + ([n % size] if n % size else [])
        assert [len(w) for w in pipeline.windows(idx, grow=False)] == [2] * (n // 2) + [1] * (n % 2)  # stores
    pipeline.close()


def test_windows_and_whole_entry_reads_hold_no_more_than_one_bounded_get() -> None:
    """A tier with BoundedGets: windows (grown or not) and the chain's batches of entries stay within one get."""
    chunk_bytes = SPEC.bytes_per_token * CHUNK
    tuning = PipelineTuning(window_bytes=4 * chunk_bytes, max_window_bytes=8 * chunk_bytes, decoders=2)
    pipeline = Pipeline(SPEC, CHUNK, Metrics(), tuning)
    bounded = SimpleNamespace(max_get_bytes=3 * pipeline.blob_bytes + pipeline.blob_bytes // 2)
    assert isinstance(bounded, BoundedGets) and pipeline.per_get(bounded) == 3
    assert pipeline.per_get(SimpleNamespace(max_get_bytes=1)) == 1  # a chunk larger than a get: one at a time
    for grow in (True, False):
        assert [len(w) for w in pipeline.windows(list(range(200)), grow=grow, most=3)] == [3] * 66 + [2]
    sizes = [pipeline.blob_bytes] * 5 + [10 * pipeline.blob_bytes, pipeline.blob_bytes]
    assert list(batches(bounded, sizes)) == [[0, 1, 2], [3, 4], [5], [6]]
    assert list(batches(SimpleNamespace(), sizes)) == [list(range(7))]
    pipeline.close()


def test_a_long_load_reads_in_grown_windows_and_gives_the_same_bytes() -> None:
    """Through a real cache: the store puts one-chunk windows, the load gets three chunks at a time (12 chunks,
    two workers, two windows per worker), and every chunk arrives as it decodes alone. A tier without
    ``large_load_windows`` (a network tier) keeps one-chunk windows."""
    chunk_bytes = SPEC.bytes_per_token * CHUNK
    tuning = PipelineTuning(window_bytes=1, max_window_bytes=3 * chunk_bytes, decoders=1, read_ahead=1,
                            windows_per_worker=2)
    with memory_cache("int8", tuning) as cache:
        tokens, kv = data(5)
        tier = cache.tiers[0]
        puts: list[int] = []
        gets: list[int] = []
        real_put, real_get = tier.put, tier.get
        tier.put = lambda items: (puts.append(len(items)), real_put(items))[1]
        tier.get = lambda keys: (gets.append(len(keys)), real_get(keys))[1]
        assert cache.store(tokens, kv) == len(tokens)
        out, n = cache.retrieve(tokens)
        assert n == len(tokens)
        assert puts == [1] * N_CHUNKS and gets == [3] * (N_CHUNKS // 3)
        for i in range(N_CHUNKS):
            part = slice(i * CHUNK, (i + 1) * CHUNK)
            assert torch.equal(out[:, :, part], cache_roundtrip("int8", kv[:, :, part]))
        gets.clear()
        assert cache.retrieve(tokens[: 6 * CHUNK])[1] == 6 * CHUNK  # six chunks: too few to grow
        assert gets == [1] * 6
        gets.clear()
        tier.large_load_windows = False
        assert cache.retrieve(tokens)[1] == len(tokens)
        assert gets == [1] * N_CHUNKS


class GpuLikeSource:
    """A KVSource that says its chunks are not in host memory (they are: the pipeline's choices are tested)."""

    device = "meta"

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv, self.threads = kv, set()

    def chunk(self, start: int, end: int) -> torch.Tensor:
        self.threads.add(threading.get_ident())
        return self.kv[:, :, start:end]


def test_a_store_from_a_gpu_is_put_in_bounded_windows_gathered_ahead_on_the_pool(monkeypatch) -> None:
    chunk_bytes = SPEC.bytes_per_token * CHUNK
    two_chunks = PipelineTuning(window_bytes=1, max_window_bytes=1, device_window_bytes=2 * chunk_bytes)
    with memory_cache("raw", two_chunks) as cache:
        tokens, kv = data()
        puts = []
        put = cache.tiers[0].put
        monkeypatch.setattr(cache.tiers[0], "put", lambda items: puts.append(len(items)) or put(items))
        source = GpuLikeSource(kv)
        assert cache.store(tokens, source) == len(tokens)
        assert puts == [2] * (N_CHUNKS // 2)
        assert threading.get_ident() not in source.threads  # gathered on the pool, beside the puts
        assert torch.equal(cache.retrieve(tokens)[0], kv)
