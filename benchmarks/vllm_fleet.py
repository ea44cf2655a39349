"""A fleet of vLLM replicas behind `kvtier route` (issue 28): round-robin, sticky sessions, routing from vLLM's
device cache only, and tier-aware routing, against one replica that sees every request; then a shared Redis
tier; a replica killed mid-run; and `kvtier sim`'s prediction of every arm next to the measurement.

Three `kvtier vllm serve` replicas of SmolLM2-135M-Instruct (float32, blocks of 32 tokens, one OpenMP thread
each: three replicas share this machine's two cores), each with the kvtier connector over private tiers (memory,
then a disk taking every chunk the memory tier evicts; chunks of 128 tokens) and vLLM's KV events on (ZMQ PUB +
replay socket). In front of the same three replicas, one `kvtier route` process per arm, each with its own
conversations (another seed per arm), run interleaved behind one bound of ``--concurrency`` requests in flight,
so load from elsewhere on this shared machine falls on every arm alike:

* **round-robin**: ``--policy round-robin --no-sticky``, no events;
* **sticky**: a session's later requests back to its first replica (round-robin for first requests), no events;
* **device-only**: load-bounded prefix affinity from the events, vLLM's ``GPU`` medium only (not the router's own
  record of what it sent where), *no* session stickiness, ties at random: what llm-d's precise prefix scorer
  does today (device prefix + load; it has no session affinity);
* **tier-aware**: kvtier route's default (load-bounded prefix affinity, sticky sessions under the session bound)
  with kvtier's ``CPU`` and ``DISK`` media too;
* **single**: one replica (the first) that sees every request of its arm: the reference for cached share;
* **vllm-router**: the vLLM project's Rust router, ``vllm-router --policy kv_aware`` (harness.vllm_router), fed by
  the same events: vLLM's own blocks and kvtier's (published in 32-token blocks, ``event_block_size``; its memory
  tier credited as host memory, 0.8, its disk tier as disk, 0.3), the prompt's tokens from the replicas' render
  endpoints; its target is a cached share of at least 0.9x tier-aware's
  (``vllm_router_cached_share_over_tier_aware``); **vllm-router+sessions**: the same with its session affinity on
  (``--kv-aware-session-affinity-ttl-secs``; the conversation in an ``X-Session-ID`` header, which it reads);

The workload is shaped so that TTFT measures what the targets are about (docs/benchmarks/fleet.md says why):
each conversation carries its own long context (``context_words``, about 2k tokens) and a short shared system
prompt, then short turns and 4-token answers, so prefill dominates TTFT; 4 rounds, so round-robin (which with 3
replicas and private tiers misses on a session's first visit to each replica) hits in one round of four and its
median request is a miss; vLLM's device cache is held to ``--device-blocks`` (about two requests' worth), and
the 5 arms' 25 conversations pass through it between a conversation's rounds, so by its next round a session's
blocks have left the device and sit only in kvtier's tiers of the replica that served it.

``--phases``: ``private`` (the arms above), ``trace`` (the same five arms driven by six conversations of the Mooncake
trace in ../shared/workloads, the rows that share a first block, each cut to its first four turns as the chat has four
rounds, each conversation's turns in order and the conversations side by side; a 512-token trace block becomes 48
tokens and prompts are capped at 2,900, and each arm gets the same rows with its own token ids), ``kill`` (the
tier-aware arm again, one replica SIGKILLed a third of the way in and started again, then new conversations once the
router has it back), ``shared`` (once per store of ``--shared-store``: the replicas restarted with a small memory tier
and the store behind it, one redis-server, or a Mooncake pool of a ``mooncake_master`` and one segment host of
``--redis-bytes`` whose arms are labelled ``+mooncake``; round-robin, sticky, device-only and tier-aware, the last
knowing the ``SHARED`` medium as one store of the fleet). Writes JSON under --out (``arm-LABEL.json``: each arm's run
as `kvtier bench` writes it, which ``kvtier sim`` replays), a PNG (``--png``); last line ``RESULT {json}``.

    PYTHONPATH=. python benchmarks/vllm_fleet.py [--quick] [--phases private,trace,kill,shared] [--arms A,B]
        [--shared-store redis,mooncake] [--out results/vllm_fleet]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from _util import stop_children_on_signal  # noqa: E402
from _vllm_fleet import (  # noqa: E402
    CHUNK,
    PRIVATE_ARMS,
    SHARED_ARMS,
    TRACE_ARMS,
    Replica,
    Tiers,
    kill_phase,
    mooncake_stages,
    mooncake_tier,
    recorded_arms,
    router,
    run_arms,
    sim_fleet,
    sim_predict,
    start_replicas,
    with_seed,
    workload_of,
)

from kvtier.apps.bench import report  # noqa: E402
from kvtier.apps.bench.client import Target  # noqa: E402
from kvtier.core.config import parse_size  # noqa: E402
from kvtier.fleet.workloads import MultiRoundSpec, TraceSpec  # noqa: E402

FULL = dict(users=5, rounds=4, system_words=60, context_words=1800, turn_words=20, max_tokens=4)
QUICK = dict(users=4, rounds=4, system_words=60, context_words=1800, turn_words=20, max_tokens=4)
#: the trace phase: conversations of the Mooncake trace (rows sharing their first block), a 512-token block as 48
#: tokens, so that its prompts are as long as the chat's (841 to 2,900 tokens, capped to fit the model's context)
#: and a miss costs what a miss costs there; each arm the same rows with other token ids; each conversation its
#: first four turns, as the chat has four rounds, so that round-robin's median request is a miss (why, with the
#: runs that showed it: docs/operations/one-or-many.md, what changed since the 21:43 run)
FULL_TRACE = dict(conversations=6, requests=24, min_turns=4, max_turns=4, block_tokens=48, max_prompt_tokens=2900,
                  max_tokens=4, seed=0, sessions=True)
QUICK_TRACE = {**FULL_TRACE, "conversations": 4, "requests": 16}
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64, float32
#: the Mooncake pool's master: seconds without a heartbeat before a client's segment leaves the pool, and the
#: lease that keeps a value being read from eviction (both 10 s by default)
MOONCAKE_CLIENT_TTL_S, MOONCAKE_LEASE_TTL_S = 120, 60
#: the simulator's prefill rate for its in-flight counts (one OpenMP thread, two shared cores, measured roughly)
PREFILL_TOKENS_PER_S = 250.0


def run_phase(arms, replicas, specs, model, out, concurrency):
    """The arms side by side; per arm its RunResult, requests per replica, and kvtier's hits by tier (all arms)."""
    before = [r.hit_tokens() for r in replicas]
    with ExitStack() as stack:
        routers = {arm.label: stack.enter_context(router(replicas, arm, model, out)) for arm in arms}
        runs = run_arms([Target(label, r.url) for label, r in routers.items()], specs, concurrency)
        counts = {label: r.served() for label, r in routers.items()}
    served_by, breaks = {k: v[0] for k, v in counts.items()}, {k: v[1] for k, v in counts.items()}
    hits: dict[str, float] = {}
    for replica, was in zip(replicas, before):
        for tier, value in replica.hit_tokens().items():
            hits[tier] = hits.get(tier, 0.0) + value - was.get(tier, 0.0)
    for run, spec in zip(runs, specs):  # one bench JSON per arm, which `kvtier sim` replays
        report.write_json([run], out / f"arm-{run.target}.json", {"workload": workload_of(spec), "spec": spec.__dict__})
    return runs, served_by, hits, breaks


def measure(arms, specs, replicas, args, model, out, rows: dict, sim_tiers: list[dict],
            shared_chunks: int | None = None) -> dict:
    """``arms`` side by side, each predicted by ``kvtier sim`` (kvtier's tiers ``sim_tiers`` per replica, a shared
    store of ``shared_chunks``, vLLM's device cache of ``--device-blocks`` per replica, the other arms' requests
    beside it where they ran): their rows are added to ``rows``; returns where the cached prompt tokens came
    from."""
    runs, served, hits, breaks = run_phase(arms, replicas, specs, model, out, args.concurrency)
    recorded = recorded_arms({arm.label: out / f"arm-{arm.label}.json" for arm in arms}, model)
    sims = {arm.label: sim_predict(arm.label, sim_fleet(arm, [r.name for r in replicas], args.device_blocks,
                                                        sim_tiers, shared_chunks, PREFILL_TOKENS_PER_S),
                                   recorded, out)
            for arm in arms}
    rows.update(summarize(arms, runs, served, breaks, args.replicas, sims))
    return place_shares(runs, hits)


def fleet_up(stack: ExitStack, model: str, out: Path, n: int, device_blocks: int, tiers: Tiers,
             phase: str) -> list[Replica]:
    replicas = [Replica(model, out, f"r{i}", device_blocks, tiers, phase) for i in range(n)]
    for replica in replicas:
        shutil.rmtree(out / f"{replica.label}-disk", ignore_errors=True)
        stack.callback(replica.server.stop)
    start_replicas(replicas)
    return replicas


def summarize(arms, runs, served, breaks, n_replicas, sims) -> dict:
    rows = {}
    for arm, run in zip(arms, runs):
        s = report.summarize(run)
        counts = served[arm.label]
        n = len(arm.replicas) if arm.replicas is not None else n_replicas
        busiest = max(counts.values()) / (sum(counts.values()) / n) if counts else None
        sim = sims.get(arm.label, {})
        rows[arm.label] = {"ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
                           "requests_per_s": s["requests_per_s"], "cached_share": s["cached_share"],
                           "failed": s["failed"] + s["rejected_429"], "busiest_over_mean": busiest,
                           "per_replica": sorted(counts.values(), reverse=True), "sticky_breaks": breaks[arm.label],
                           "sim_cached_share": sim.get("token_hit_ratio"), "sim_per_replica": sim.get("requests"),
                           "sim_sticky_breaks": sim.get("sticky_breaks"), "sim_placed_as_run": sim.get("placed_as_run"),
                           "sim_placements_compared": sim.get("placements_compared")}
    return rows


def plot(rows: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(12.0, 0.9 * len(labels)), 4.8))
    ax1.bar(labels, [rows[k]["ttft_p50_s"] for k in labels], color="tab:blue", label="p50")
    ax1.scatter(labels, [rows[k]["ttft_p99_s"] for k in labels], color="tab:red", marker="_", s=300, label="p99")
    ax1.set_ylabel("TTFT, client-measured (s)")
    ax1.legend()
    x = range(len(labels))
    ax2.bar([i - 0.2 for i in x], [rows[k]["cached_share"] for k in labels], width=0.4, label="measured (vLLM)")
    ax2.bar([i + 0.2 for i in x], [rows[k]["sim_cached_share"] or 0 for k in labels], width=0.4,
            label="kvtier sim", color="tab:gray")
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("share of prompt tokens cached")
    ax2.set_ylim(0, 1)
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def shared_store(stack: ExitStack, args: argparse.Namespace, store: str) -> tuple[Tiers, tuple]:
    """A shared phase's store, started (and stopped by ``stack``): the replicas' tiers and the arms to run."""
    size = parse_size(args.redis_bytes)
    if store == "redis":
        from harness.redis_server import RedisServer

        redis = RedisServer(maxmemory=str(size)).start()
        stack.callback(redis.stop)
        return Tiers(args.shared_memory, redis_url=redis.url), SHARED_ARMS
    from harness.mooncake_master import MooncakeMaster, SegmentHost, missing_mooncake

    if missing := missing_mooncake():
        raise SystemExit(f"vllm_fleet: no Mooncake pool here: {'; '.join(missing)}")
    # Three replicas and the pool's host share two cores here, at load averages of 20-40: with the master's
    # defaults the host's heartbeats lapsed past --client_ttl (10 s) and the master unmounted the whole pool, and
    # transfers outlasted the 10 s lease on the values they read. A loaded fleet needs longer ones.
    master = stack.enter_context(MooncakeMaster(args=(f"--client_ttl={MOONCAKE_CLIENT_TTL_S}",
                                                      f"--default_kv_lease_ttl={MOONCAKE_LEASE_TTL_S}s")))
    stack.enter_context(SegmentHost(master, size))
    arms = tuple(dataclasses.replace(a, label=a.label.replace("+shared", "+mooncake")) for a in SHARED_ARMS)
    return Tiers(args.shared_memory, mooncake=mooncake_tier(master)), arms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 conversations per arm instead of 5")
    p.add_argument("--phases", default="private,trace,kill,shared")
    p.add_argument("--concurrency", type=int, default=3, help="requests in flight, all arms together")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--device-blocks", type=int, default=160,
                   help="vLLM's own cache per replica, in blocks of 32 tokens (at least max-model-len's 96)")
    p.add_argument("--memory", default="2GiB",
                   help="kvtier's memory tier per replica (private phase); the disk tier below takes every chunk it "
                        "evicts")
    p.add_argument("--disk", default="4GiB", help="kvtier's disk tier per replica (private phase)")
    p.add_argument("--shared-memory", default="128MiB", help="kvtier's memory tier per replica (shared phase)")
    p.add_argument("--redis-bytes", default="3GiB", help="the shared store's size: redis-server's maxmemory, or the "
                   "Mooncake pool's one segment")
    p.add_argument("--shared-store", default="redis,mooncake",
                   help="the shared phase's stores, one after the other: redis (one redis-server) and mooncake (a "
                        "Mooncake pool: mooncake_master and one segment host; its arms are labelled +mooncake)")
    p.add_argument("--arms", default="", help="the private and trace phases' arms to run, by label without the "
                   "trace- prefix, comma-separated (default: all; each keeps its own workload seed)")
    p.add_argument("--model", help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="results/vllm_fleet")
    p.add_argument("--png", default="docs/vllm_fleet.png")
    args = p.parse_args()
    stop_children_on_signal()
    from kvtier.integrations.models import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = [x for x in args.phases.split(",") if x]
    base = MultiRoundSpec(sessions=True, **(QUICK if args.quick else FULL))
    chunk_bytes = KV_BYTES_PER_TOKEN * CHUNK
    rows: dict = {}
    places: dict = {}
    killed: dict = {}
    load = {"before": os.getloadavg()[0]}
    started = time.monotonic()
    if {"private", "trace", "kill"} & set(phases):
        with ExitStack() as stack:
            tiers = Tiers(args.memory, args.disk)
            replicas = fleet_up(stack, model, out, args.replicas, args.device_blocks, tiers, "private")
            # kvtier's tiers as the simulator runs them: the memory tier, then the disk taking what it evicts
            sim_tiers = [{"kind": "memory", "chunks": parse_size(args.memory) // chunk_bytes},
                         {"kind": "disk", "chunks": parse_size(args.disk) // chunk_bytes, "write": "back",
                          "admission": "always"}]
            if "private" in phases:
                arms = chosen(PRIVATE_ARMS, args.arms)
                specs = [with_seed(base, 100 + PRIVATE_ARMS.index(arm)) for arm in arms]
                places["private"] = measure(arms, specs, replicas, args, model, out, rows, sim_tiers)
                save(out, rows, places, killed)
                load["after_private"] = os.getloadavg()[0]
            if "trace" in phases:
                trace = TraceSpec(**(QUICK_TRACE if args.quick else FULL_TRACE))
                arms = chosen(TRACE_ARMS, args.arms)
                specs = [dataclasses.replace(trace, salt=1 + TRACE_ARMS.index(arm)) for arm in arms]
                places["trace"] = measure(arms, specs, replicas, args, model, out, rows, sim_tiers)
                save(out, rows, places, killed)
                load["after_trace"] = os.getloadavg()[0]
            if "kill" in phases:
                arm = next(a for a in PRIVATE_ARMS if a.label == "tier-aware")
                spec = dataclasses.replace(base, seed=200, rounds=base.rounds + 2)
                # the conversations after the restart are new sessions (the router still knows the others' homes)
                follow = dataclasses.replace(base, seed=201, rounds=1, session_prefix="after-restart")
                killed = kill_phase(replicas, arm, spec, follow, model, out,
                                    min(args.concurrency, 2))
                load["after_kill"] = os.getloadavg()[0]
                save(out, rows, places, killed)
    stores = [x for x in args.shared_store.split(",") if x] if "shared" in phases else []
    if unknown := set(stores) - {"redis", "mooncake"}:
        raise SystemExit(f"vllm_fleet: unknown --shared-store {sorted(unknown)}")
    stages: dict = {}
    for store in stores:
        with ExitStack() as stack:
            tiers, arms = shared_store(stack, args, store)
            replicas = fleet_up(stack, model, out, args.replicas, args.device_blocks, tiers, store)
            specs = [with_seed(base, 300 + i) for i in range(len(arms))]
            places["shared" if store == "redis" else "mooncake"] = measure(
                arms, specs, replicas, args, model, out, rows,
                [{"kind": "memory", "chunks": parse_size(args.shared_memory) // chunk_bytes}],
                parse_size(args.redis_bytes) // chunk_bytes)
            if store == "mooncake":
                stages = mooncake_stages(replicas)
            save(out, rows, places, killed)
            load[f"after_{store}"] = os.getloadavg()[0]
    wall = time.monotonic() - started
    for label, r in rows.items():
        sim = "-" if r["sim_cached_share"] is None else f"{r['sim_cached_share']:.3f}"
        busiest = "-" if r["busiest_over_mean"] is None else f"{r['busiest_over_mean']:.2f}"
        print(f"{label:>20}: TTFT p50 {r['ttft_p50_s']:.3f} s, p99 {r['ttft_p99_s']:.3f} s, "
              f"{r['requests_per_s']:.3f} req/s, cached share {r['cached_share']:.3f} (sim {sim}), busiest/mean "
              f"{busiest}, requests per replica {r['per_replica']} (sim {r['sim_per_replica']}), "
              f"sticky breaks {r['sticky_breaks']:.0f}, sim placed {r['sim_placed_as_run']} of "
              f"{r['sim_placements_compared']} where the router did")
    print("places:", json.dumps(places))
    if killed:
        print("kill:", json.dumps(killed))
    if stages:
        print("mooncake stages:", json.dumps(stages))
    result = result_line(rows, places, killed, load, wall, args)
    if stages:
        result["mooncake_stages"] = stages
    save(out, rows, places, killed, result)
    if rows:
        plot(rows, Path(args.png), f"3 vLLM CPU replicas behind kvtier route, {base.users} x {base.rounds} per arm "
                                   f"(load average {load['before']:.1f}-{max(load.values()):.1f})")
    print("RESULT " + json.dumps(result))


def chosen(arms: tuple, labels: str) -> tuple:
    wanted = {x for x in labels.split(",") if x}
    return tuple(a for a in arms if not wanted or a.label.removeprefix("trace-") in wanted)


def save(out: Path, rows: dict, places: dict, killed: dict, result: dict | None = None) -> None:
    """What the run has measured so far (a later phase that fails leaves the earlier ones on disk)."""
    doc = {"rows": rows, "places": places, "kill": killed, "result": result}
    (out / "vllm_fleet.json").write_text(json.dumps(doc, indent=1, default=str))


def place_shares(runs, hits: dict[str, float]) -> dict:
    """Where the phase's cached prompt tokens came from, as shares of all its prompt tokens: kvtier's tiers
    (its loads, by tier) and vLLM's device cache (the rest of what vLLM reported cached)."""
    prompt = sum(report.summarize(r)["prompt_tokens"] for r in runs)
    cached = sum(report.summarize(r)["cached_tokens"] for r in runs)
    out = {f"kvtier_{tier}": round(v / prompt, 3) for tier, v in hits.items() if prompt}
    out["device"] = round((cached - sum(hits.values())) / prompt, 3) if prompt else 0.0
    return out


def result_line(rows, places, killed, load, wall, args) -> dict:
    out: dict = {"benchmark": "vllm_fleet", "quick": args.quick, "phases": args.phases, "replicas": args.replicas,
                 "concurrency": args.concurrency}
    for label, r in rows.items():
        for key in ("ttft_p50_s", "ttft_p99_s", "requests_per_s", "cached_share", "busiest_over_mean",
                    "sim_cached_share"):
            if r[key] is not None:
                out[f"{key}_{label}"] = round(r[key], 3)
        if r["sim_cached_share"] is not None and r["cached_share"]:
            out[f"sim_error_{label}"] = round(r["sim_cached_share"] / r["cached_share"] - 1, 3)
    for pre in ("", "trace-"):
        if {f"{pre}round-robin", f"{pre}device-only", f"{pre}tier-aware"} <= set(rows):
            tier = rows[f"{pre}tier-aware"]["ttft_p50_s"]
            out[f"{pre}ttft_p50_speedup_vs_round_robin"] = round(rows[f"{pre}round-robin"]["ttft_p50_s"] / tier, 2)
            out[f"{pre}ttft_p50_speedup_vs_device_only"] = round(rows[f"{pre}device-only"]["ttft_p50_s"] / tier, 2)
    for pre, peer in itertools.product(("", "trace-"), ("vllm-router", "vllm-router+sessions")):
        # vllm-router kv_aware over kvtier's events against kvtier route (target 0.9x)
        if {f"{pre}{peer}", f"{pre}tier-aware"} <= set(rows) and rows[f"{pre}tier-aware"]["cached_share"]:
            key = f"{pre}{peer.replace('-', '_').replace('+', '_')}_cached_share_over_tier_aware"
            out[key] = round(rows[f"{pre}{peer}"]["cached_share"] / rows[f"{pre}tier-aware"]["cached_share"], 3)
    for store in ("shared", "mooncake"):
        if {f"sticky+{store}", "single"} <= set(rows):
            out[f"sticky_{store}_over_single"] = round(
                rows[f"sticky+{store}"]["cached_share"] / rows["single"]["cached_share"], 3)
    if killed:
        out.update({f"kill_{k}": v for k, v in killed.items() if isinstance(v, (int, float))})
        # the router stops a replica's subscriber when it ejects it and starts a fresh one on readmission: the
        # resync shows as batches of the new process applied after the restart
        out["kill_batches_after_restart"] = killed.get("events_after", {}).get("batch", 0) - \
            killed.get("events_before", {}).get("batch", 0)
    out["failed_requests"] = sum(r["failed"] for r in rows.values())
    out["places"] = places
    out.update({f"load_average_{k}": round(v, 2) for k, v in load.items()})
    out["wall_s"] = round(wall, 1)
    return out


if __name__ == "__main__":
    main()
