"""Replay requests through a simulated fleet: route each, serve it on its replica, count what it hit.

Time and load: each replica runs prefills one after another at ``prefill_tokens_per_s``, computing the
tokens its cache did not hold; decoding then runs batched beside other requests at ``decode_tokens_per_s``
per request. A request is in flight from its arrival until its last output token; the router sees every
replica's in-flight count when a request arrives, and the wait before a request's prefill starts is
reported as queueing delay.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.apps.sim.device import DEVICE, FleetDevices
from kvtier.apps.sim.fleet import FleetConfig
from kvtier.apps.sim.replica import SIM_MODEL, SIM_SPEC, Replica, build_shared, written_chunks
from kvtier.apps.sim.trace import TraceRequest
from kvtier.base.errors import ConfigError
from kvtier.base.keys import Namespace
from kvtier.base.metrics import Metrics
from kvtier.fleet.scoring import ReplicaView, RouteRequest
from kvtier.fleet.vllm_index import vllm_namespace


class LoadModel:
    """Per replica, a FIFO queue of prefills followed by batched decoding: in-flight counts, the prompt tokens
    the router counts as still to prefill, and waits. A request with measured times (``measured_ttft_s``,
    ``measured_e2e_s``) is in flight, and prefilling until its first token, exactly as long as it was measured."""

    def __init__(self, replicas: int, prefill_tokens_per_s: float, decode_tokens_per_s: float) -> None:
        self._prefill_rate = prefill_tokens_per_s
        self._decode_rate = decode_tokens_per_s
        self._free_at = [0.0] * replicas
        self._prefilling: list[list[tuple[float, int]]] = [[] for _ in range(replicas)]  # (first token, tokens)
        self._running: list[list[tuple[float, float]]] = [[] for _ in range(replicas)]  # (first token, last)

    def in_flight(self, now: float) -> list[int]:
        return [len(running) for running in self._unfinished(now)]

    def prefill_tokens(self, now: float) -> list[int]:
        """Per replica, the router's count of prompt tokens its in-flight requests have yet to compute."""
        for queue in self._prefilling:
            while queue and queue[0][0] <= now:
                heapq.heappop(queue)
        return [sum(tokens for _, tokens in queue) for queue in self._prefilling]

    def decode_streams(self, now: float) -> list[int]:
        """Per replica, its requests past their first token and not yet finished."""
        return [sum(1 for first, _ in running if first <= now) for running in self._unfinished(now)]

    def _unfinished(self, now: float) -> list[list[tuple[float, float]]]:
        """Per replica, (first token, last token) of its requests not finished by ``now`` (finished ones dropped)."""
        self._running = [[span for span in running if span[1] > now] for running in self._running]
        return self._running

    def admit(self, replica: int, request: TraceRequest, computed_tokens: int,
              routed_tokens: int = 0) -> tuple[float, float]:
        """Queue a request that computes ``computed_tokens``, counted by the router as ``routed_tokens`` to
        prefill; returns how long it waits before its prefill starts (by the load model), and when it ends."""
        now = request.arrival_s
        start = max(now, self._free_at[replica])
        self._free_at[replica] = prefilled = start + computed_tokens / self._prefill_rate
        first, finish = prefilled, prefilled + request.output_tokens / self._decode_rate
        if request.measured_e2e_s is not None:
            finish = now + request.measured_e2e_s
            first = now + (request.measured_ttft_s if request.measured_ttft_s is not None else request.measured_e2e_s)
        self._running[replica].append((first, finish))
        if routed_tokens > 0:
            heapq.heappush(self._prefilling[replica], (first, routed_tokens))
        return start - now, finish


@dataclass
class ReplicaStats:
    requests: int = 0
    prefill_tokens: int = 0  #: tokens computed (prompt tokens the cache did not provide)
    saved_tokens: int = 0
    wait_s: list[float] = field(default_factory=list)


@dataclass
class SimResult:
    """What one replay measured. Ratios are properties so the JSON and the table agree."""

    label: str
    requests: int = 0
    chunks: int = 0
    hit_chunks: int = 0
    hit_chunks_by_tier: dict[str, int] = field(default_factory=dict)
    #: chunks written into each tier (stores, promotions, demotions), all replicas together
    written_chunks_by_tier: dict[str, int] = field(default_factory=dict)
    #: writes each tier's admission policy refused, all replicas together
    refused_chunks_by_tier: dict[str, int] = field(default_factory=dict)
    input_tokens: int = 0
    saved_tokens: int = 0
    replicas: list[ReplicaStats] = field(default_factory=list)
    #: sticky routing: requests whose session's replica was above the load bound (StickySessions.breaks)
    sticky_breaks: int = 0
    #: requests whose recorded run named the replica that served them (and the fleet names its replicas), and
    #: of those, the ones this replay placed on the same replica
    placements_compared: int = 0
    placements_matched: int = 0
    wall_s: float = 0.0

    @property
    def chunk_hit_ratio(self) -> float:
        return self.hit_chunks / self.chunks if self.chunks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.saved_tokens / self.input_tokens if self.input_tokens else 0.0

    def to_json(self) -> dict:
        waits = sorted(w for r in self.replicas for w in r.wait_s)
        return {
            "label": self.label, "requests": self.requests, "chunks": self.chunks, "hit_chunks": self.hit_chunks,
            "chunk_hit_ratio": self.chunk_hit_ratio, "token_hit_ratio": self.token_hit_ratio,
            "hit_ratio_by_tier": {t: n / self.chunks if self.chunks else 0.0
                                  for t, n in self.hit_chunks_by_tier.items()},
            "written_chunks_by_tier": self.written_chunks_by_tier,
            "refused_chunks_by_tier": self.refused_chunks_by_tier,
            "input_tokens": self.input_tokens, "saved_tokens": self.saved_tokens,
            "prefill_tokens": self.input_tokens - self.saved_tokens,
            "queue_wait_mean_s": sum(waits) / len(waits) if waits else 0.0,
            "queue_wait_p99_s": waits[int(0.99 * (len(waits) - 1))] if waits else 0.0,
            "sticky_breaks": self.sticky_breaks,
            "placements_compared": self.placements_compared, "placements_matched": self.placements_matched,
            "replicas": [{"requests": r.requests, "prefill_tokens": r.prefill_tokens, "saved_tokens": r.saved_tokens}
                         for r in self.replicas],
            "wall_s": self.wall_s,
        }


def chunk_tokens_of(requests: Sequence[TraceRequest], default: int) -> int:
    """The simulator's chunk size for a workload: one trace block, or ``default`` tokens."""
    blocks = getattr(requests[0].prompt, "block_tokens", None) if requests else None
    return blocks or default


def first_key(tokens, keys: Sequence[bytes], vllm_blocks: Namespace | None) -> bytes:
    """The router's tie-break key for a prompt: for vLLM replicas (``vllm_blocks``, the router's key space for
    their blocks: kvtier.fleet.vllm_index.vllm_namespace) the key of their first block, else the first chunk's;
    b"" for a prompt shorter than either."""
    if vllm_blocks is None:
        return keys[0] if keys else b""
    blocks = vllm_blocks.chunk_hashes(tokens[:vllm_blocks.chunk_size])
    return bytes(blocks[0]) if blocks else b""


def replay(requests: Sequence[TraceRequest], fleet: FleetConfig, chunk_tokens: int, *, label: str = "",
           model: str = SIM_MODEL, progress: Callable[[int], None] | None = None,
           background: Sequence[TraceRequest] = ()) -> SimResult:
    """Replay ``requests`` in order through a fresh fleet built from ``fleet``.

    ``model`` names the cached model: it changes every chunk key (not the sharing between them), so the
    router's tie-breaks fall differently; replays under several names show how much a result owes to them.

    ``background``: requests of other runs that went through the same replicas at the same time (each naming
    the replica that served it, ``measured_replica``, with its measured end). They are not routed nor counted:
    each is placed where it ran, from its arrival to its end, and takes room in that replica's device cache and
    tiers as it did. Those naming no replica of the fleet ran elsewhere and are left out.
    """
    t0 = time.perf_counter()
    chunk_kv_bytes = fleet.kv_bytes_per_token * (requests[0].tokens_per_chunk if requests else chunk_tokens)
    shared_metrics = Metrics()
    shared = build_shared(fleet, chunk_tokens, chunk_kv_bytes, shared_metrics)
    now = [0.0]  # the trace's time: the clock of the tiers' admission rate caps
    replicas = [Replica(fleet, chunk_tokens, chunk_kv_bytes, shared, model, clock=lambda: now[0])
                for _ in range(fleet.replicas)]
    devices = (FleetDevices(fleet.replicas, fleet.vllm_device_blocks, fleet.vllm_block_size)
               if fleet.vllm_device_blocks is not None and fleet.vllm_block_size is not None else None)
    labels = replicas[0].labels
    router = fleet.routing.build()
    unseen = frozenset(tier for tier, weight in fleet.routing.tier_weights if weight == 0)
    load = LoadModel(fleet.replicas, fleet.prefill_tokens_per_s, fleet.decode_tokens_per_s)
    namespace = Namespace(model, SIM_SPEC, chunk_tokens)
    vllm_blocks = vllm_namespace(fleet.vllm_block_size) if fleet.vllm_block_size is not None else None
    result = SimResult(label, hit_chunks_by_tier=dict.fromkeys(([DEVICE] if devices else []) + labels, 0),
                       replicas=[ReplicaStats() for _ in replicas])
    try:
        n = 0
        for request, placed in _side_by_side(requests, background, fleet):
            now[0] = request.arrival_s
            tokens = request.prompt.tokens()
            keys = namespace.chunk_hashes(tokens)
            blocks = devices.keys(tokens) if devices is not None else []
            if devices is not None:
                devices.settle(request.arrival_s)
            if placed is not None:  # another run's request, where it ran
                replicas[placed].serve(tokens)
                if devices is not None:
                    _, running = devices.start(placed, blocks, len(tokens), request.output_tokens)
                    devices.end_at(running, request.arrival_s + (request.measured_e2e_s or 0.0))
                continue
            index, routed = 0, 0
            if len(replicas) > 1:
                now_s = request.arrival_s
                in_flight, prefilling = load.in_flight(now_s), load.prefill_tokens(now_s)
                decoding = load.decode_streams(now_s)
                on_device = devices.cached_tokens(blocks, len(tokens)) if devices is not None else [0] * len(replicas)
                views = [ReplicaView(_cached_view(r.located(keys), on_device[i], chunk_tokens, unseen), in_flight[i],
                                     prefilling[i], decoding[i], name=fleet.replica_name(i))
                         for i, r in enumerate(replicas)]
                route = RouteRequest(len(tokens), first_key(tokens, keys, vllm_blocks), request.session,
                                     request.draw_key)
                index = router.choose(route, views)
                routed = max(len(tokens) - sum(views[index].cached.values()), 0)
            if fleet.replica_names and request.measured_replica is not None:
                result.placements_compared += 1
                result.placements_matched += fleet.replica_name(index) == request.measured_replica
            device_tokens, running = (devices.start(index, blocks, len(tokens), request.output_tokens)
                                     if devices is not None else (0, None))
            hits = replicas[index].serve(tokens)
            computed = _count(result, request, index, len(keys), hits, labels, device_tokens, chunk_tokens)
            wait_s, end_s = load.admit(index, request, computed, routed)
            result.replicas[index].wait_s.append(wait_s)
            if running is not None:
                devices.end_at(running, end_s)
            n += 1
            if progress is not None and (n % 64 == 0 or n == len(requests)):
                progress(n)
        _count_writes(result, replicas, shared_metrics, chunk_tokens, labels)
        result.sticky_breaks = getattr(router, "breaks", 0)
    finally:
        for replica in replicas:
            replica.close()
    result.wall_s = time.perf_counter() - t0
    return result


def _side_by_side(requests: Sequence[TraceRequest], background: Sequence[TraceRequest],
                  fleet: FleetConfig) -> Iterator[tuple[TraceRequest, int | None]]:
    """The replayed requests in their order (placed None: to route) merged by arrival with the background's,
    each with the index of the replica it ran on (left out where the fleet names no such replica)."""
    if background and not fleet.replica_names:
        raise ConfigError("background requests are placed by the replica names they recorded: the fleet "
                          "needs replica_names")
    placed = [(r, fleet.replica_index(r.measured_replica)) for r in sorted(background, key=lambda r: r.arrival_s)]
    own: Iterator[tuple[TraceRequest, int | None]] = ((r, None) for r in requests)
    others = ((r, index) for r, index in placed if index is not None)
    return heapq.merge(own, others, key=lambda pair: pair[0].arrival_s)


def _cached_view(located: Sequence[str], device_tokens: int, chunk_tokens: int,
                 unseen: frozenset[str]) -> dict[str, int]:
    """What the router sees of a prompt on one replica: ``device_tokens`` on its device cache, then the
    tokens beyond them in each kvtier tier (``located``: the tier holding each chunk of the held prefix); tiers
    in ``unseen`` (weighted 0: a router that does not index them, as llm-d's device-only scorer) left out, so
    they count neither in its choice nor in the prompt tokens it expects a replica to compute."""
    cached = {DEVICE: device_tokens} if device_tokens and DEVICE not in unseen else {}
    for i, label in enumerate(located):
        beyond = (i + 1) * chunk_tokens - max(i * chunk_tokens, device_tokens)
        if beyond > 0 and label not in unseen:
            cached[label] = cached.get(label, 0) + beyond
    return cached


def _count_writes(result: SimResult, replicas: Sequence[Replica], shared_metrics: Metrics, chunk_tokens: int,
                  labels: list[str]) -> None:
    written = dict.fromkeys(labels, 0)
    refused = dict.fromkeys(labels, 0)
    for replica in replicas:
        for name, n in replica.written_chunks().items():
            written[name] += n
        for name, n in replica.refused_chunks().items():
            refused[name] += n
    if "shared" in written:
        written["shared"] = written_chunks(shared_metrics, "shared", chunk_tokens)
    result.written_chunks_by_tier, result.refused_chunks_by_tier = written, refused


def _count(result: SimResult, request: TraceRequest, index: int, chunks: int, hits: list[int],
           labels: list[str], device_tokens: int = 0, chunk_tokens: int = 1) -> int:
    """Add one served request to the result; returns the prompt tokens it had to compute. ``device_tokens`` (in
    the simulator's tokens, chunks of ``chunk_tokens``) the replica's device cache held: kvtier's tiers serve the
    chunks beyond them, so the device's whole chunks are taken off the fastest tiers' hits first."""
    device_chunks = device_tokens // chunk_tokens
    hit = max(sum(hits), device_chunks)
    saved = min(max(sum(hits) * request.tokens_per_chunk, device_tokens * request.tokens_per_chunk // chunk_tokens),
                request.input_tokens)
    result.requests += 1
    result.chunks += chunks
    result.hit_chunks += hit
    if device_chunks:
        result.hit_chunks_by_tier[DEVICE] += device_chunks
    taken = device_chunks
    for label, n in zip(labels, hits):
        result.hit_chunks_by_tier[label] += n - min(n, taken)
        taken -= min(n, taken)
    result.input_tokens += request.input_tokens
    result.saved_tokens += saved
    stats = result.replicas[index]
    stats.requests += 1
    stats.saved_tokens += saved
    stats.prefill_tokens += request.input_tokens - saved
    return request.input_tokens - saved
