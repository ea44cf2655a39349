"""A fleet of vLLM replicas behind `kvtier route` (issue 28, item 3, first cut): round-robin against routing from
the replicas' KV events, with vLLM's device cache only and with kvtier's tiers too.

Three `kvtier vllm serve` replicas of SmolLM2-135M-Instruct (float32, blocks of 32 tokens, one OpenMP thread
each, unbound: the machine is shared), each with the kvtier connector over a memory tier (chunks of 128 tokens)
and vLLM's KV events on (ZMQ PUB + replay socket). vLLM's own cache is held small (``--num-gpu-blocks-override``
72: 2,304 tokens) so that kvtier's tier matters. In front of the same three replicas, one `kvtier route`
process per arm:

* **round-robin**: ``--policy round-robin --no-sticky``, no events;
* **sticky**: a session's later requests back to its first replica (round-robin for first requests), no events;
* **device-only**: the default policy (load-bounded prefix affinity, sticky sessions) from the events, vLLM's
  ``GPU`` medium only (what a router that does not know kvtier's media sees);
* **tier-aware**: the same, with kvtier's ``CPU`` medium too (and with ``--shared``, the fleet's Redis tier as
  one ``SHARED`` store: a chunk any replica stored there counts for all).

Each router gets its own multi-round chat workload (`kvtier bench`'s generator, users sharing a system prompt
and growing their histories; another seed per router, so no router profits from another's prompts), and the
arms run interleaved (``--concurrency`` requests in flight in all), so load from elsewhere on this shared
machine falls on every arm alike. Per arm: TTFT p50/p99 (client-measured), request throughput over the shared
wall time, the share of prompt tokens vLLM reported cached (its device cache and kvtier's loads together), and
the busiest replica's requests over the mean. Writes JSON under --out (``arm-LABEL.json``: each arm's run as
`kvtier bench` writes it, for ``kvtier sim``); last line ``RESULT {json}``.

    PYTHONPATH=. python benchmarks/vllm_fleet.py [--quick] [--concurrency 3] [--out results/vllm_fleet]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


from _util import routed_per_replica, router_process  # noqa: E402

from kvtier.apps.bench import report  # noqa: E402
from kvtier.apps.bench.client import Target  # noqa: E402
from kvtier.apps.bench.progress import BenchProgress  # noqa: E402
from kvtier.apps.bench.runner import run_workload  # noqa: E402
from kvtier.fleet import workloads as wl  # noqa: E402
from kvtier.fleet.workloads import MultiRoundSpec  # noqa: E402
from kvtier.net.ports import free_port  # noqa: E402
from tests.integrations.vllm_server import VllmServer  # noqa: E402

NAME, BLOCK, CHUNK = "smollm2", 32, 128
ARMS = {
    "round-robin": (["--policy", "round-robin", "--no-sticky"], None),
    "sticky": (["--policy", "round-robin", "--sticky"], None),
    "device-only": (["--policy", "load-bounded", "--sticky"], "GPU"),
    "tier-aware": (["--policy", "load-bounded", "--sticky"], "GPU:CPU"),
}
FULL = dict(users=8, rounds=5, system_words=300, turn_words=120, max_tokens=8)
QUICK = dict(users=6, rounds=3, system_words=200, turn_words=80, max_tokens=8)


class Replica:
    def __init__(self, model: str, out: Path, label: str, device_blocks: int, tier_bytes: str,
                 redis_url: str | None = None) -> None:
        self.events, self.replay = free_port(), free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "topic": f"kv@{label}@{NAME}"}
        args = ("--served-model-name", NAME, "--block-size", str(BLOCK), "--max-model-len", "2048", "--dtype",
                "float32", "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--max-num-seqs", "4",
                "--num-gpu-blocks-override", str(device_blocks), "--kv-events-config", json.dumps(events))
        tiers = [{"kind": "memory", "capacity_bytes": tier_bytes}]
        if redis_url is not None:  # one store for the fleet: its medium is SHARED (the connector's default)
            tiers.append({"kind": "redis", "url": redis_url, "timeout_s": 30.0})
        kvtier = {"chunk_size": CHUNK, "tiers": tiers}
        env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.server = VllmServer(model, free_port(), out / f"{label}.log", kvtier=kvtier, args=args, env=env)

    def entry(self, media: str | None) -> str:
        if media is None:
            return self.server.url
        shared = ",shared=fleet-redis" if "SHARED" in media else ""
        return (f"{self.server.url},events=tcp://127.0.0.1:{self.events},replay=tcp://127.0.0.1:{self.replay},"
                f"block-size={BLOCK},media={media}{shared}")


@contextmanager
def router(replicas: list[Replica], flags: list[str], media: str | None, model: str, out: Path, label: str):
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--log-level", "warning", "--model", model,
           *flags]
    for replica in replicas:
        cmd += ["--replica", replica.entry(media)]
    with router_process(cmd, f"http://127.0.0.1:{port}", out / f"route-{label}.log") as url:
        yield url


def run_arms(targets: list[Target], specs: list[MultiRoundSpec], concurrency: int):
    """The arms side by side behind one bound of ``concurrency`` requests, each with its own workload."""
    with BenchProgress() as progress:
        rows = [progress.row(f"multiround @ {t.label}", wl.count("multiround", s)) for t, s in zip(targets, specs)]

        async def together():
            limit = asyncio.Semaphore(max(1, concurrency))
            return await asyncio.gather(*(
                run_workload(t, "multiround", partial(wl.multiround, spec=s), row, limit=limit)
                for t, s, row in zip(targets, specs, rows)))

        return asyncio.run(together())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller workload (a few minutes)")
    p.add_argument("--concurrency", type=int, default=3, help="requests in flight, all arms together")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--device-blocks", type=int, default=72,
                   help="vLLM's own cache per replica, in blocks (vLLM keeps one; 2,048 tokens need 65)")
    p.add_argument("--tier-bytes", default="768MiB", help="kvtier's memory tier per replica")
    p.add_argument("--shared", action="store_true",
                   help="add one redis-server as a shared tier behind every replica's memory tier (the tier-aware "
                        "router then knows its SHARED medium as one store of the fleet)")
    p.add_argument("--model", help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="results/vllm_fleet")
    args = p.parse_args()
    from kvtier.integrations.models import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = QUICK if args.quick else FULL
    base = MultiRoundSpec(sessions=True, **size)
    specs = [dataclasses.replace(base, seed=100 + i) for i in range(len(ARMS))]
    load_before = os.getloadavg()
    arms = dict(ARMS)
    with ExitStack() as stack:
        redis_url = None
        if args.shared:
            from tests.redis_server import RedisServer

            redis = RedisServer(maxmemory="2gb").start()
            stack.callback(redis.stop)
            redis_url = redis.url
            arms["tier-aware"] = (ARMS["tier-aware"][0], "GPU:CPU:SHARED")
        replicas = [Replica(model, out, f"r{i}", args.device_blocks, args.tier_bytes, redis_url)
                    for i in range(args.replicas)]
        for replica in replicas:
            stack.callback(replica.server.stop)
            replica.server.launch()
        for replica in replicas:
            replica.server.wait_ready()
        urls = {label: stack.enter_context(router(replicas, flags, media, model, out, label))
                for label, (flags, media) in arms.items()}
        started = time.monotonic()
        runs = run_arms([Target(label, url) for label, url in urls.items()], specs, args.concurrency)
        wall = time.monotonic() - started
        served = {label: routed_per_replica(url) for label, url in urls.items()}
    load_after = os.getloadavg()
    report.print_tables(runs)
    summaries = {label: report.summarize(run) for label, run in zip(urls, runs)}
    busiest = {label: max(v.values()) / (sum(v.values()) / args.replicas) if v else None
               for label, v in served.items()}
    for label, s in summaries.items():
        print(f"{label:>12}: TTFT p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s, {s['requests_per_s']:.2f} "
              f"req/s, cached share {s['cached_share']:.3f}, busiest/mean {busiest[label]:.2f}, "
              f"requests per replica {sorted(served[label].values(), reverse=True)}")
    report.write_json(runs, out / "vllm_fleet.json", {"size": size, "served": served, "wall_s": wall,
                                                      "device_blocks": args.device_blocks,
                                                      "load_before": load_before, "load_after": load_after})
    for run, spec in zip(runs, specs):  # one bench JSON per arm, which `kvtier sim` replays
        report.write_json([run], out / f"arm-{run.target}.json", {"workload": "multiround", "spec": spec.__dict__})
    rr, dev, tier = (summaries[k] for k in ("round-robin", "device-only", "tier-aware"))
    result = {
        "benchmark": "vllm_fleet", "quick": args.quick, "shared": args.shared, "replicas": args.replicas,
        "concurrency": args.concurrency,
        **{f"ttft_p50_s_{k}": round(s["ttft_p50_s"], 3) for k, s in summaries.items()},
        **{f"ttft_p99_s_{k}": round(s["ttft_p99_s"], 3) for k, s in summaries.items()},
        **{f"requests_per_s_{k}": round(s["requests_per_s"], 3) for k, s in summaries.items()},
        **{f"cached_share_{k}": round(s["cached_share"], 3) for k, s in summaries.items()},
        **{f"busiest_over_mean_{k}": round(v, 2) for k, v in busiest.items() if v is not None},
        "ttft_p50_speedup_vs_round_robin": round(rr["ttft_p50_s"] / tier["ttft_p50_s"], 2),
        "ttft_p50_speedup_vs_device_only": round(dev["ttft_p50_s"] / tier["ttft_p50_s"], 2),
        "failed_requests": sum(s["failed"] + s["rejected_429"] for s in summaries.values()),
        "load_average_before": round(load_before[0], 2), "load_average_after": round(load_after[0], 2),
        "wall_s": round(wall, 1),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
