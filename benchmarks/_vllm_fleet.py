"""benchmarks/vllm_fleet.py's parts: the replicas, one router per arm, the arms run side by side, a replica
killed under load, and `kvtier sim`'s prediction of each arm."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from _util import routed_per_replica, router_process

from kvtier.apps.bench.client import Target
from kvtier.apps.bench.progress import BenchProgress
from kvtier.apps.bench.runner import run_workload
from kvtier.fleet import workloads as wl
from kvtier.fleet.workloads import MultiRoundSpec, TraceSpec
from kvtier.net.ports import free_port
from harness.fleet import scrape
from harness.vllm_router import VllmRouter
from harness.vllm_server import VllmServer

NAME, BLOCK, CHUNK = "smollm2", 32, 128
MAX_MODEL_LEN = 3072


@dataclass(frozen=True)
class Arm:
    """One router in front of the replicas: its flags, the media it indexes from the replicas' events (None: it
    reads no events), which replicas it sees (None: all), and how ``kvtier sim`` models it."""

    label: str
    flags: tuple[str, ...]
    media: str | None = None
    replicas: tuple[int, ...] | None = None
    sim_routing: str = "round-robin"
    sim_sticky: bool = False
    sim_weights: tuple[tuple[str, float], ...] = ()
    sim_tie_break: str = "home"
    #: vllm-router --policy kv_aware in front (``flags`` are its own), not kvtier route
    peer: bool = False


ROUND_ROBIN = ("--policy", "round-robin", "--no-sticky")
STICKY = ("--policy", "round-robin", "--sticky")
#: llm-d's precise prefix scorer stands behind this arm: device prefix + load, no session affinity, and equal
#: candidates picked at random (its max-score picker shuffles them): with kvtier route's stable rendezvous home,
#: conversations that share only a system prompt all met on one replica (12 / 4 / 4 in one run). It knows only
#: what vLLM's events say: kvtier route's own record of what it sent where ("recent", trusted 60 s for replicas
#: that publish events) is worth nothing to it. With that record, on the trace, whose turns come back within a
#: minute, the arm followed conversations by the router's memory, not vLLM's (0.681 cached against tier-aware's
#: 0.687, where kvtier sim, which has no such record, predicted 0.575)
DEVICE_ONLY = ("--policy", "load-bounded", "--no-sticky", "--tie-break", "random", "--tier-weight", "recent=0")
#: kvtier route's default: load-bounded prefix affinity with sticky sessions (under the session bound)
TIER_AWARE = ("--policy", "load-bounded", "--sticky")
#: in the simulator a router that knows only vLLM's device cache (the tier ``device``) does not see kvtier's
#: tiers at all: they weigh nothing
DEVICE_WEIGHTS = (("memory", 0.0), ("disk", 0.0), ("shared", 0.0))

PRIVATE_ARMS = (
    Arm("round-robin", ROUND_ROBIN),
    Arm("sticky", STICKY, sim_sticky=True),
    Arm("device-only", DEVICE_ONLY, "GPU", sim_routing="load-bounded", sim_weights=DEVICE_WEIGHTS,
        sim_tie_break="random"),
    Arm("tier-aware", TIER_AWARE, "GPU:CPU:DISK", sim_routing="load-bounded", sim_sticky=True),
    Arm("single", ROUND_ROBIN, replicas=(0,)),
    #: the vLLM project's router over the same events: vLLM's own blocks credited 1.0, kvtier's memory tier 0.8
    #: (host) and disk tier 0.3 (disk), its defaults for the media the connector publishes without an ownership
    Arm("vllm-router", (), peer=True, sim_routing="load-bounded", sim_weights=(("memory", 0.8), ("disk", 0.3)),
        sim_tie_break="random"),
    #: the same with its session affinity on: a conversation (its X-Session-ID) stays where it started
    Arm("vllm-router+sessions", ("--kv-aware-session-affinity-ttl-secs", "3600"), peer=True, sim_routing="load-bounded",
        sim_sticky=True, sim_weights=(("memory", 0.8), ("disk", 0.3)), sim_tie_break="random"),
)
#: the same arms driven by conversations of the Mooncake trace
TRACE_ARMS = tuple(dataclasses.replace(arm, label=f"trace-{arm.label}") for arm in PRIVATE_ARMS)
#: the same arms, less the single replica, in front of replicas sharing one store (the tier-aware arm knows it
#: as the ``SHARED`` medium where the private arms have kvtier's disk)
SHARED_ARMS = tuple(dataclasses.replace(arm, label=f"{arm.label}+shared",
                                        media=arm.media and arm.media.replace("DISK", "SHARED"))
                    for arm in PRIVATE_ARMS if arm.replicas is None and not arm.peer)


@dataclass(frozen=True)
class Tiers:
    """Each replica's kvtier tiers: a memory tier, optionally a private disk tier and the fleet's shared store
    (Redis at ``redis_url``, or a Mooncake pool: ``mooncake``, the tier's config)."""

    memory: str
    disk: str | None = None
    redis_url: str | None = None
    mooncake: dict | None = None

    def config(self, folder: Path) -> dict:
        tiers: list[dict] = [{"kind": "memory", "capacity_bytes": self.memory}]
        if self.disk is not None:  # what the memory tier evicts, every chunk of it (not only chunks hit twice)
            tiers.append({"kind": "disk", "path": str(folder), "capacity_bytes": self.disk, "fsync": False,
                          "write": "back", "admission": "always"})
        if self.redis_url is not None:  # one store for the fleet: its medium is SHARED (the connector's default)
            tiers.append({"kind": "redis", "url": self.redis_url, "timeout_s": 30.0})
        if self.mooncake is not None:  # a shared store too: SHARED
            tiers.append(dict(self.mooncake))
        # kvtier's chunks published as vLLM-sized blocks: vllm-router indexes no other size (kvtier route any)
        return {"chunk_size": CHUNK, "event_block_size": BLOCK, "tiers": tiers}


class Replica:
    """One ``kvtier vllm serve`` with the connector and vLLM's KV events (PUB + replay); one OpenMP thread. Its log
    is ``LABEL-PHASE.log`` (each phase starts the replicas again). The events' topic is vLLM's default, empty:
    vllm-router 0.1.17 reads a ``--kv-event-source`` under the empty topic only (it has no flag for another) and
    drops every batch that carries one; ``--enable-scale-out`` serves the render endpoints it tokenizes with."""

    def __init__(self, model: str, out: Path, label: str, device_blocks: int, tiers: Tiers, phase: str) -> None:
        self.label = label
        self.events, self.replay = free_port(), free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "topic": ""}
        args = ("--served-model-name", NAME, "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN),
                "--dtype", "float32", "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details",
                "--max-num-seqs", "4", "--num-gpu-blocks-override", str(device_blocks), "--enable-scale-out",
                "--kv-events-config", json.dumps(events))
        env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.metrics_port = free_port()  # the worker's own metrics (histograms too; vLLM's /metrics has none)
        kvtier = {**tiers.config(out / f"{label}-disk"), "metrics_port": self.metrics_port}
        self.server = VllmServer(model, free_port(), out / f"{label}-{phase}.log", kvtier=kvtier, args=args, env=env)

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def entry(self, media: str | None) -> str:
        if media is None:
            return self.server.url
        shared = ",shared=fleet-redis" if "SHARED" in media else ""
        return (f"{self.server.url},events=tcp://127.0.0.1:{self.events},replay=tcp://127.0.0.1:{self.replay},"
                f"block-size={BLOCK},media={media}{shared}")

    def kill(self) -> None:
        """SIGKILL to the whole process group (API server, engine core): a crash, no shutdown."""
        assert self.server.proc is not None
        os.killpg(self.server.proc.pid, signal.SIGKILL)
        self.server.proc.wait(timeout=60)
        self.server.proc = None

    def hit_tokens(self) -> dict[str, float]:
        """kvtier's hit tokens by tier (its loads into vLLM) so far."""
        return {k.partition("{")[2].rstrip("}"): v for k, v in self.server.metrics().items()
                if k.startswith("kvtier_hit_tokens_total{")}


def mooncake_stages(replicas: list[Replica]) -> dict[str, dict[str, float]]:
    """Where the replicas' Mooncake calls spent their time so far (kvtier_mooncake_stage_seconds, from each
    worker's own metrics), per ``op/stage``: seconds in all, calls, and calls over 10 s."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for replica in replicas:
        text = httpx.get(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name != "kvtier_mooncake_stage_seconds":
                continue
            for sample in family.samples:
                labels = sample.labels
                key = f"{labels['op']}/{labels['stage']}"
                row = out.setdefault(key, {"seconds": 0.0, "calls": 0.0, "over_10s": 0.0})
                if sample.name.endswith("_sum"):
                    row["seconds"] += sample.value
                elif sample.name.endswith("_count"):
                    row["calls"] += sample.value
                    row["over_10s"] += sample.value
                elif sample.name.endswith("_bucket") and float(labels["le"]) == 10.0:
                    row["over_10s"] -= sample.value
    return {k: {f: round(v, 2) for f, v in row.items()} for k, row in sorted(out.items())}


def start_replicas(replicas: list[Replica]) -> None:
    for replica in replicas:
        replica.server.launch()
    for replica in replicas:
        replica.server.wait_ready()


@dataclass(frozen=True)
class Routed:
    """A running router: its URL, and ``served()``: the requests each replica (host:port) got from it so far and
    its sticky breaks. kvtier route reports both at its /metrics; vllm-router counts no sticky breaks and exports
    no per-worker count, so its own selection log is read."""

    url: str
    served: Callable[[], tuple[dict[str, int], float]]


@contextmanager
def router(replicas: list[Replica], arm: Arm, model: str, out: Path):
    """The arm's router in front of ``replicas``: ``kvtier route``, or ``vllm-router`` kv_aware for a peer arm;
    yields a ``Routed``."""
    port = free_port()
    if arm.peer:
        workers = [(r.server.url, f"tcp://127.0.0.1:{r.events}", f"tcp://127.0.0.1:{r.replay}") for r in replicas]
        with VllmRouter(workers, NAME, BLOCK, port, free_port(), out / f"route-{arm.label}.log",
                        extra=arm.flags) as peer:
            yield Routed(peer.url, lambda: ({k.removeprefix("http://"): v for k, v in peer.routed().items()}, 0.0))
        return
    cmd = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--log-level", "warning", "--model", model,
           *arm.flags]
    for i in arm.replicas if arm.replicas is not None else range(len(replicas)):
        cmd += ["--replica", replicas[i].entry(arm.media)]
    with router_process(cmd, f"http://127.0.0.1:{port}", out / f"route-{arm.label}.log") as url:
        yield Routed(url, lambda: (routed_per_replica(url),
                                   scrape(url).get("kvtier_router_sticky_breaks_total", 0.0)))


def workload_of(spec: MultiRoundSpec | TraceSpec) -> str:
    return "trace" if isinstance(spec, TraceSpec) else "multiround"


def run_arms(targets: list[Target], specs: list[MultiRoundSpec | TraceSpec], concurrency: int, on_done=None):
    """The arms side by side behind one bound of ``concurrency`` requests, each with its own workload (multi-round
    chat or trace conversations, by its spec); ``on_done()`` is called after each request (in the event loop's
    thread)."""
    with BenchProgress() as progress:
        rows = [progress.row(f"{workload_of(s)} @ {t.label}", wl.count(workload_of(s), s))
                for t, s in zip(targets, specs)]
        if on_done is not None:
            for row in rows:
                advance = row.advance

                def counted(*a, _advance=advance, **k):
                    _advance(*a, **k)
                    on_done()
                row.advance = counted

        async def together():
            limit = asyncio.Semaphore(max(1, concurrency))
            return await asyncio.gather(*(
                run_workload(t, workload_of(s), partial(wl.WORKLOADS[workload_of(s)], spec=s), row, limit=limit)
                for t, s, row in zip(targets, specs, rows)))

        return asyncio.run(together())


def router_series(url: str, prefix: str, replica: str) -> dict[str, float]:
    """The router's ``prefix`` samples for one replica, keyed by their ``what``/``reason``/``tier`` label."""
    out: dict[str, float] = {}
    for series, value in scrape(url).items():
        if series.startswith(prefix) and f'replica="{replica}"' in series:
            label = next((series.partition(f'{k}="')[2].partition('"')[0] for k in ("what", "reason", "tier", "cause")
                          if f'{k}="' in series), "")
            out[label] = out.get(label, 0.0) + value
    return out


class Killer:
    """Kills ``replica`` (SIGKILL) once ``after`` requests have finished, then starts it again in a thread;
    records what the router saw of it at the kill."""

    def __init__(self, replica: Replica, router_url: str, after: int) -> None:
        self.replica, self.url, self.after = replica, router_url, after
        self.done = 0
        self.record: dict = {}
        self.restarted = threading.Event()
        self.thread: threading.Thread | None = None

    def __call__(self) -> None:
        self.done += 1
        if self.done == self.after and self.thread is None:
            self.thread = threading.Thread(target=self._kill_and_restart, daemon=True)
            self.thread.start()

    def _kill_and_restart(self) -> None:
        name = self.replica.name
        self.record["in_flight_at_kill"] = scrape(self.url).get(f'kvtier_router_in_flight{{replica="{name}"}}', 0.0)
        self.record["events_before"] = router_series(self.url, "kvtier_router_events_total", name)
        self.record["requests_done_at_kill"] = self.done
        killed = time.monotonic()
        self.replica.kill()
        self.replica.server.launch()
        self.replica.server.wait_ready()
        self.record["restart_s"] = round(time.monotonic() - killed, 1)
        self.restarted.set()


def kill_phase(replicas: list[Replica], arm: Arm, spec: MultiRoundSpec, follow: MultiRoundSpec, model: str,
               out: Path, concurrency: int, victim: int = 1) -> dict:
    """``arm``'s workload with ``replicas[victim]`` SIGKILLed a third of the way in and started again; then,
    once the router has it back in rotation, ``follow`` (new sessions) through the same router. Returns the
    failures, what was in flight on the victim, and the router's event counters for it before and after."""
    with router(replicas, arm, model, out) as routed:
        url = routed.url
        killer = Killer(replicas[victim], url, after=max(1, wl.count("multiround", spec) // 3))
        [run] = run_arms([Target(arm.label, url)], [spec], concurrency, on_done=killer)
        if not killer.restarted.wait(timeout=900):
            raise RuntimeError("the killed replica did not come back")
        name = replicas[victim].name
        deadline = time.monotonic() + 120
        while scrape(url).get(f'kvtier_router_replica_up{{replica="{name}"}}', 0.0) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not take the restarted replica back")
            time.sleep(1)
        routed_before = sum(router_series(url, "kvtier_router_routed_total", name).values())
        [after] = run_arms([Target(arm.label + " after", url)], [follow], concurrency)
        time.sleep(2)  # the last batches of events
        record = dict(killer.record)
        record["events_after"] = router_series(url, "kvtier_router_events_total", name)
        record["index_chunks_after"] = router_series(url, "kvtier_router_index_chunks", name)
        record["routed_after_restart"] = sum(router_series(url, "kvtier_router_routed_total", name).values()) - \
            routed_before
        record["retries"] = router_series(url, "kvtier_router_retries_total", name)
        record["ejections"] = router_series(url, "kvtier_router_ejections_total", name)
        record["readmissions"] = sum(router_series(url, "kvtier_router_readmissions_total", name).values())
    failed = [r for r in run.results if not (r.status == 200 and r.ttft_s is not None)]
    record.update(requests=len(run.results), failed=len(failed), follow_requests=len(after.results),
                  follow_failed=sum(1 for r in after.results if not (r.status == 200 and r.ttft_s is not None)))
    return record


def sim_fleet(arm: Arm, names: list[str], device_blocks: int, tiers: list[dict], shared_chunks: int | None,
              prefill_tokens_per_s: float) -> dict:
    """The fleet file ``kvtier sim`` replays ``arm``'s requests through: vLLM's device cache of ``device_blocks``
    per replica, kvtier's own ``tiers`` per replica (the fleet file's tier list, as the replicas run them) and a
    shared store of ``shared_chunks``, each whole: the other arms' requests go through them beside this one's
    (:func:`sim_predict`). The replicas carry the names the arm's router knows them by (``names``: every
    replica's, host:port), so the replay's rendezvous homes and random draws are the router's, and a decode
    stream costs what it costs kvtier route by default."""
    from kvtier.apps.route.config import DEFAULT_DECODE_STREAM_TOKENS

    mine = [names[i] for i in arm.replicas] if arm.replicas is not None else list(names)
    n = len(mine)
    fleet = {"replicas": n, "replica_names": mine, "decode_stream_tokens": DEFAULT_DECODE_STREAM_TOKENS,
             "routing": arm.sim_routing if n > 1 else "round-robin", "sticky": arm.sim_sticky,
             "tie_break": arm.sim_tie_break,
             "prefill_tokens_per_s": prefill_tokens_per_s, "decode_tokens_per_s": 30, "vllm_block_size": BLOCK,
             "vllm_device_blocks": device_blocks, "tiers": tiers}
    if arm.sim_weights:
        fleet["tier_weights"] = dict(arm.sim_weights)
    if shared_chunks is not None:
        fleet["shared"] = {"chunks": shared_chunks, "policy": "lru", "admission": "always"}
    return fleet


def recorded_arms(files: dict[str, Path], model: str) -> dict[str, list]:
    """Each arm's recorded requests (``files``: label -> its bench JSON), read once for all the arms' replays:
    chunks of 128 tokens, as kvtier stores them, chat prompts as ``model``'s token ids."""
    from kvtier.apps.sim.bench_replay import read_bench_json
    from kvtier.integrations.prompts import PromptTokenizer

    tokenizer = PromptTokenizer(model).chat
    return {label: read_bench_json(path, chunk_tokens=CHUNK, target=label, tokenizer=tokenizer)
            for label, path in files.items()}


def sim_predict(label: str, fleet: dict, recorded: dict[str, list], out: Path) -> dict:
    """``kvtier sim``'s token hit ratio, requests per replica and sticky breaks for arm ``label``'s recorded
    requests (``recorded``: every arm's, from :func:`recorded_arms`; each held in flight as long as it was
    measured, and new conversations keyed by their first vLLM block, as the router sees them), with the other
    arms' requests placed where they ran, in the replicas' device caches and tiers."""
    from kvtier.apps.sim.fleet import FleetConfig
    from kvtier.apps.sim.replay import replay

    # the fleet file beside the arm's requests (JSON is YAML):
    # `kvtier sim arm-L.json --fleet fleet-L.yaml --tokenizer MODEL --background <the other arm-*.json>`
    (out / f"fleet-{label}.yaml").write_text(json.dumps(fleet, indent=1))
    background = [r for other, requests in recorded.items() if other != label for r in requests]
    result = replay(recorded[label], FleetConfig.from_dict(fleet), CHUNK, label=label, background=background)
    return {"token_hit_ratio": result.token_hit_ratio, "requests": [r.requests for r in result.replicas],
            "sticky_breaks": result.sticky_breaks, "placed_as_run": result.placements_matched,
            "placements_compared": result.placements_compared}


def mooncake_tier(master) -> dict:
    """A replica's tier in the pool of ``master`` (harness.mooncake_master): it mounts no segment of its own, the
    pool's memory is one segment host's, as the tests run it. Its transfer buffer is the tier's default, 256
    MiB, room for every window a load reads at once (windows of two chunks of this model, five at once); with 32
    MiB the windows read ahead waited for room (docs/operations/one-or-many.md, the pool under load)."""
    return {"kind": "mooncake", "master_address": master.master_address, "metadata_server": master.metadata_url,
            "metrics_url": master.metrics_url, "segment_bytes": 0, "buffer_bytes": "256MiB", "timeout_s": 30.0}


def with_seed(spec: MultiRoundSpec, seed: int) -> MultiRoundSpec:
    return dataclasses.replace(spec, seed=seed)
