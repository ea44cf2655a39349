"""Issue 29's attacks replayed against a real fleet: do the router, the replicas and the event channel hold?

Starts a real ``kvtier route`` process in front of two real ``kvtier serve`` replicas (a tiny Llama built from a
config, as the router's tests build it, with its context raised to 16k so the blending prompt fits; both with
``--blend --blend-separator '\\n\\n'``) and a compromised third replica (benchmarks/_hostile_replica.py: real
HTTP and a real CURVE event stream, hostile content). Every attacker is a real process or socket speaking the
real wire format over loopback (what each sends: benchmarks/_hostile_attacks.py and _hostile_channel.py).

Measured for each attack, against the issue's targets:

* answers: every request gets a clear 4xx (503/408/431 for the HTTP limits; 200 where the input is valid) or a
  bounded miss (event-channel attacks), never a 5xx, a reset without an answer, nor no answer;
* ``/health`` latency on the router and both replicas, probed every 50 ms by threads of this process throughout
  (max and p99, and the max as a multiple of the idle median); the target is under 100 ms. A replica the attack
  stops or kills on purpose is not probed meanwhile. Attackers that burn CPU of their own (R-4's connection
  opener, the event-channel peers) are processes apart, at ``nice`` +10 (``_hostile_attacks.ATTACKER_NICE``),
  and R-4 has a control row, the same attacker against a listener that does nothing (``(control)``: reported,
  not a target): the attacker's own CPU is not a server's doing;
* for the worst probe of each process, what its main thread (the event loop) did meanwhile, from
  ``/proc/PID/schedstat`` sampled every 0.1 s: the CPU it ran and the time it waited for a CPU, over the samples
  around the probe. A probe that took 300 ms while the loop ran 20 ms and waited 250 ms for a CPU is the busy
  machine's doing (other jobs on its 2 cores), not work the attack made the server do;
* RSS (VmRSS) of the router and the replicas before, at peak and 2 s after the attack; the target is ending
  within 200 MB of the level before;
* the attack's own target where it has one (R-4: no connection left unanswered; R-6: the whole answer passed
  on; R-7: answered elsewhere within 5 s of the ejection; E-3: every event of 100,000-event batches applied, and
  the index within its cap, freed on ejection; E-4: no fake key adopted and the replica followed again on its new
  ports; B-1: at most 2x a plain prefill).

Issue 48's rows (benchmarks/_hostile_round3.py) add three servers probed and sampled like the others
(benchmarks/_hostile_servers.py: ``t1``, a ``kvtier serve`` with a Redis tier; ``o1``, one with a disk tier;
``rank``, the vLLM connector's rank server, probed on ``/metrics``) and their own targets: T-1 a 400, the next
request served and /health ok; O-1 a tenant's clear after a SIGKILL and restart leaves none of its entries; S-1
tenant b's pages survive tenant a's clear; A-1 400s; A-2 no credential echoed; A-3 each fan-out answered within
its deadline; A-4 ``kvtier cache`` exits non-zero with one line in bounded time and memory; P-1 the rank server's
threads bounded and every idle connection closed by it.

    PYTHONPATH=. python benchmarks/hostile_fleet.py [--quick] [--load 4]

``--quick`` runs every attack small (a smoke run). Last line: RESULT {json}; every probe plotted in --out/health.png.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _hostile_attacks as attacks  # noqa: E402
import _hostile_channel as channel  # noqa: E402
import _hostile_round3 as round3  # noqa: E402
import _hostile_servers as servers  # noqa: E402
from _hostile_procs import await_load, background_load, lowest_nice, rss_mb, schedstat_ms, stop_load, unniced
from _util import result, stop_children_on_signal  # noqa: E402

from kvtier.net.ports import free_port  # noqa: E402
from harness.fleet import ROOT, ReplicaProcess  # noqa: E402
from harness.serve import build_tiny_model  # noqa: E402

ATTACKS = [("R-1 malformed", attacks.r1_malformed), ("R-2 huge prompts", attacks.r2_huge_prompts),
           ("R-3 header->router", attacks.r3_header("router", 128 << 20)),
           ("R-3 header->replica", attacks.r3_header("replica", 128 << 20)),
           ("R-4 heads->sink (control)", attacks.r4_half_heads("sink")),
           ("R-4 heads->router", attacks.r4_half_heads("router")),
           ("R-4 heads->replica", attacks.r4_half_heads("replica")),
           ("R-5 1MB user", attacks.r5_sessions), ("R-6 1GiB answer", attacks.r6_huge_answer),
           ("R-7 SIGSTOP", attacks.r7_stopped_replica), ("E-1 subscriptions", channel.e1_subscriptions),
           ("E-2 snapshots", channel.e2_snapshots), ("B-1 blend", channel.b1_blend),
           ("E-3 big batches", channel.e3_big_batches), ("E-3 index flood", channel.e3_flood),
           ("E-4 impostor", channel.e4_impostor)]
CLEAR = {"200", "408", "431", "503", "miss"}  #: besides any 4xx
PROBE_S, HEALTH_MS, RSS_MB = 0.05, 100.0, 200.0
CONTROL = "(control)"  #: rows that measure the attacker's own cost, not kvtier: reported, not a target
E3 = next(i for i, (name, _) in enumerate(ATTACKS) if name.startswith("E-3"))
ATTACKS = ATTACKS[:E3] + round3.BEFORE_E3 + ATTACKS[E3:] + round3.ATTACKS
CLEAR |= round3.WORDS


class Replica(ReplicaProcess):
    """A replica with fixed event ports (so an impostor can take them) that reads its own /kvtier/info."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.events_port, self.control_port = free_port(), free_port()
        super().__init__(model, log_dir, "--blend", "--blend-separator", "\n\n", "--events-port",
                         str(self.events_port), "--events-control-port", str(self.control_port),
                         "--admin-key-file", str(servers.admin_key_file(log_dir)))

    def info(self) -> dict:
        return httpx.get(self.url + "/kvtier/info", timeout=10).json()


class Fleet:
    """The router process, two replicas and the compromised one; ``paused`` names processes not to probe."""

    def __init__(self, work: Path, big: bool) -> None:
        model = build_tiny_model(work / "model")
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
        self.replicas = [Replica(model, work).start(), Replica(model, work).start()]
        self.huge_bytes = (1 << 30) if big else (64 << 20)
        self.paused: set[str] = set()
        self.servers: set[int] = set()  #: pids of other processes that stand in for servers (not niced)
        self.starting = threading.Lock()  #: held while such a process is started and added to ``servers``
        self.procs: list[subprocess.Popen] = []
        self.extras = servers.Extras(work, model)
        self.servers |= self.extras.server_pids()
        for r in self.replicas:
            r.wait_healthy()
        (work / "info.json").write_text(json.dumps(self.replicas[0].info()))
        port = free_port()
        self.hostile_url, self.hostile_name = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"
        self.hostile = self._spawn([str(ROOT / "benchmarks/_hostile_replica.py"), str(port), str(work / "info.json"),
                                    str(self.huge_bytes)], work / "hostile.log", attacker=True)
        router_port = free_port()
        self.url, self.name = f"http://127.0.0.1:{router_port}", "router"
        urls = [r.url for r in self.replicas] + [self.hostile_url]
        self.router = self._spawn(["-m", "kvtier", "route", *[a for u in urls for a in ("--replica", u)], "--port",
                                   str(router_port), "--model", str(model), "--health-interval", "0.5",
                                   "--log-level", "warning"], work / "router.log")
        self.replica_key_cap = min(2_000_000, 8_000_000 // len(urls))  # kvtier.fleet.index.FleetIndex's defaults
        self.wait_all_up(following=True)

    def _spawn(self, args: list[str], log: Path, attacker: bool = False) -> subprocess.Popen:
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=attacks.ENV, preexec_fn=attacks.attacker_priority if attacker else None)
        self.procs.append(proc)
        return proc

    def target_url(self, target: str) -> str:
        return self.url if target == "router" else self.replicas[0].url

    def states(self) -> dict[str, dict]:
        try:
            return {r["name"]: r for r in httpx.get(self.url + "/health", timeout=5).json()["replicas"]}
        except (httpx.HTTPError, ValueError):
            return {}

    def replica_state(self, name: str) -> str | None:
        return self.states().get(name, {}).get("state")

    def wait_all_up(self, following: bool = False, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            live = [r for r in self.states().values() if r["name"] not in self.paused or r["state"] == "up"]
            if len(live) >= 2 and all(r["state"] == "up" and (r["events"] or not following) for r in live):
                return
            assert time.monotonic() < deadline, f"the fleet did not come up: {self.states()}"
            time.sleep(0.2)

    def watched(self) -> dict[str, callable]:
        """Process name -> its current pid (a replica restarted keeps its name)."""
        return {"router": lambda: self.router.pid,
                **{r.name: (lambda r=r: r.proc.pid) for r in self.replicas}, **self.extras.watched()}

    def server_pids(self) -> set[int]:
        return {get() for get in self.watched().values()} | self.servers

    def urls(self) -> dict[str, str]:
        """Process name -> the URL its liveness is probed on."""
        return {"router": self.url + "/health", **{r.name: r.url + "/health" for r in self.replicas},
                **self.extras.probe_urls()}

    def close(self) -> None:
        self.extras.close()
        for r in self.replicas:
            if r.proc is not None:
                r.proc.send_signal(signal.SIGCONT)
            r.stop(signal.SIGKILL)
        for proc in self.procs:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=10)


class Monitor:
    """Probes every /health and samples every RSS in threads of their own until ``stop()``."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.stopped, self.t0 = fleet, threading.Event(), time.perf_counter()
        self.probes: dict[str, list[tuple[float, float, bool]]] = {n: [] for n in fleet.urls()}
        self.rss: dict[str, list[tuple[float, float]]] = {n: [] for n in fleet.watched()}
        self.sched: dict[str, list[tuple[float, float, float]]] = {n: [] for n in fleet.watched()}
        self.unniced: list[tuple[float, str]] = []  #: (when, process) of attacker-side processes seen not niced
        self.load: list[tuple[float, float]] = []  #: (when, 1-minute load average): the issue asks for >= 4
        self.threads = [threading.Thread(target=self._probe, args=(n, u), daemon=True) for n, u in fleet.urls().items()]
        self.threads.append(threading.Thread(target=self._sample, daemon=True))
        for t in self.threads:
            t.start()

    def _probe(self, name: str, url: str) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stopped.is_set():
                if name in self.fleet.paused:
                    time.sleep(PROBE_S)
                    continue
                sent = time.perf_counter()
                try:
                    ok = client.get(url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if name not in self.fleet.paused:
                    self.probes[name].append((sent - self.t0, time.perf_counter() - sent, ok))
                time.sleep(PROBE_S)

    def _sample(self) -> None:
        turn = 0
        while not self.stopped.is_set():
            for name, pid in self.fleet.watched().items():
                self.rss[name].append((time.perf_counter() - self.t0, rss_mb(pid())))
                self.sched[name].append((time.perf_counter() - self.t0, *schedstat_ms(pid())))
            self.load.append((self.now(), os.getloadavg()[0]))
            if turn % 5 == 0:  # every 0.5 s: every process this one started that is not a server is niced
                with self.fleet.starting:
                    bad = unniced(os.getpid(), self.fleet.server_pids(), attacks.ATTACKER_NICE)
                self.unniced.extend((self.now(), proc) for proc in bad)
            turn += 1
            time.sleep(0.1)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def health(self, name: str, start: float, end: float) -> tuple[float, float, int]:
        """Max and p99 latency (ms) of the probes sent in [start, end], and how many failed."""
        got = [(lat, ok) for t, lat, ok in self.probes[name] if start <= t <= end]
        lats = sorted(lat * 1000 for lat, _ in got) or [float("nan")]
        return lats[-1], lats[min(len(lats) - 1, int(0.99 * len(lats)))], sum(not ok for _, ok in got)

    def worst_probe_sched(self, name: str, start: float, end: float) -> tuple[float, float, float]:
        """Around the slowest probe sent in [start, end]: (window ms, ms the main thread ran, ms it waited for
        a CPU), between the schedstat samples just before and just after it."""
        got = [(t, lat) for t, lat, _ in self.probes[name] if start <= t <= end]
        samples = self.sched[name]
        if not got or len(samples) < 2:
            return float("nan"), float("nan"), float("nan")
        t, lat = max(got, key=lambda p: p[1])
        before = max((s for s in samples if s[0] <= t), default=samples[0], key=lambda s: s[0])
        after = min((s for s in samples if s[0] >= t + lat), default=samples[-1], key=lambda s: s[0])
        return (after[0] - before[0]) * 1000, after[1] - before[1], after[2] - before[2]

    def rss_now(self, name: str) -> float:
        return rss_mb(self.fleet.watched()[name]())

    def rss_peak(self, name: str, start: float, end: float) -> float:
        return max((mb for t, mb in self.rss[name] if start <= t <= end), default=float("nan"))

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=10)


def replay(fleet: Fleet, monitor: Monitor, name: str, attack, big: bool, idle: dict[str, float]) -> dict:
    before = {n: monitor.rss_now(n) for n in monitor.rss}
    start = monitor.now()
    try:
        out = attack(fleet, big)
    except Exception as exc:  # a broken attack is a failed row, not a lost run
        out = {"codes": {"error": 1}, "size": "-", "ok": False, "note": f"attack failed: {exc!r}"[:200]}
    time.sleep(2.0)
    end = monitor.now()
    procs = {}
    for n in monitor.rss:
        hmax, hp99, failed = monitor.health(n, start, end)
        window, ran, waited = monitor.worst_probe_sched(n, start, end)
        procs[n] = {"health_max_ms": hmax, "health_p99_ms": hp99, "health_failed": failed,
                    "worst_window_ms": window, "worst_ran_ms": ran, "worst_waited_ms": waited,
                    "health_max_x_idle": hmax / idle[n], "rss_before_mb": before[n],
                    "rss_peak_mb": monitor.rss_peak(n, start, end), "rss_after_mb": monitor.rss_now(n)}
    codes = {str(k): v for k, v in dict(out["codes"]).items() if v}
    answered = all(c in CLEAR or c.startswith("4") for c in codes)
    health = all(not p["health_max_ms"] >= HEALTH_MS and p["health_failed"] == 0 for p in procs.values())
    rss = all(p["rss_after_mb"] - p["rss_before_mb"] <= RSS_MB for p in procs.values())
    own = out["ok"] is not False
    bad = sorted({proc for t, proc in monitor.unniced if start <= t <= end})
    return {"name": name, "size": out["size"], "note": out["note"], "codes": codes, "procs": procs,
            "answered": answered, "health": health, "rss": rss, "own": own, "pass": answered and health and rss and own,
            "unniced": bad, "load_max": max((v for t, v in monitor.load if start <= t <= end), default=float("nan"))}


def idle_health(fleet: Fleet, n: int = 40) -> dict[str, float]:
    out = {}
    for name, url in fleet.urls().items():
        with httpx.Client(timeout=5) as c:
            lats = []
            for _ in range(n):
                sent = time.perf_counter()
                c.get(url)
                lats.append(time.perf_counter() - sent)
        out[name] = statistics.median(lats) * 1000
    return out


def table(rows: list[dict], names: dict[str, str]) -> None:
    print(f"\n{'attack':20} {'answers':28} {'proc':7} {'health max/p99 ms':>18} {'x idle':>7} "
          f"{'RSS before/peak/after MB':>25} {'worst: ran/waited/window ms':>27}  answer health rss own")
    for row in rows:
        codes = " ".join(f"{k}x{v}" for k, v in sorted(row["codes"].items()))
        for i, (n, p) in enumerate(row["procs"].items()):
            flags = "  ".join("ok  " if row[k] else "FAIL" for k in ("answered", "health", "rss", "own"))
            print(f"{row['name'] if i == 0 else '':20} {codes if i == 0 else '':28} {names[n]:7} "
                  f"{p['health_max_ms']:>9.1f}/{p['health_p99_ms']:<8.1f} {p['health_max_x_idle']:>7.1f} "
                  f"{p['rss_before_mb']:>8.0f}/{p['rss_peak_mb']:>7.0f}/{p['rss_after_mb']:<8.0f} "
                  f"{p['worst_ran_ms']:>11.0f}/{p['worst_waited_ms']:<6.0f}/{p['worst_window_ms']:<8.0f}  "
                  f"{flags if i == 0 else ''}")
        print(f"{'':20} size: {row['size']}; {row['note']}")
        if row["unniced"]:
            print(f"{'':20} NOT NICED (the row does not count): {', '.join(row['unniced'])}")


def plot(monitor: Monitor, rows: list[dict], names: dict[str, str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 4))
    for n, probes in monitor.probes.items():
        if probes:
            ax.plot([t for t, _, _ in probes], [lat * 1000 for _, lat, _ in probes], ".", ms=2, label=names[n])
    ax.axhline(HEALTH_MS, color="red", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("/health latency (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "health.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="every attack small: a smoke run")
    p.add_argument("--only", help="comma-separated attack name prefixes (e.g. R-1,E-3)")
    p.add_argument("--out", default="results/hostile_fleet")
    p.add_argument("--load", type=int, default=0, help="busy processes at nice 19 beside the run (load average)")
    args = p.parse_args()
    stop_children_on_signal()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    socket.setdefaulttimeout(60)
    chosen = [(n, a) for n, a in ATTACKS if not args.only or any(n.startswith(o) for o in args.only.split(","))]
    burners = background_load(args.load)
    with tempfile.TemporaryDirectory(prefix="hostile-fleet-") as tmp:
        fleet = Fleet(Path(tmp), big=not args.quick)
        names = {"router": "router", **{r.name: f"rep{i + 1}" for i, r in enumerate(fleet.replicas)},
                 **{n: n for n in fleet.extras.watched()}}
        try:
            for i in range(6):  # some cached chunks on each replica: something for the index and snapshots
                body = {"prompt": attacks.sized_text(600 + i), "max_tokens": 1}
                attacks.post(fleet.url, "/v1/completions", json=body, headers={"x-session-id": f"warm{i}"})
            idle = idle_health(fleet)
            servers_nice = {names[n]: lowest_nice(get()) for n, get in fleet.watched().items()}
            print(f"load average {await_load(args.load):.1f} (--load {args.load})", flush=True)
            monitor, rows = Monitor(fleet), []
            for name, attack in chosen:
                print(f"-- {name} ...", flush=True)
                rows.append(replay(fleet, monitor, name, attack, not args.quick, idle))
                print(f"   {rows[-1]['codes']} {rows[-1]['note']}", flush=True)
            monitor.stop()
        finally:
            fleet.close()
            stop_load(burners)
    print(f"nice: servers {servers_nice}, attackers {attacks.ATTACKER_NICE}")
    print("idle /health median ms: " + ", ".join(f"{names[n]} {v:.1f}" for n, v in idle.items()))
    table(rows, names)
    plot(monitor, rows, names, out)
    figures: dict = {"quick": args.quick}
    for row in rows:
        key = row["name"].split()[0].replace("-", "") + "_" + "_".join(row["name"].split()[1:]).replace(">", "")
        worst = max(row["procs"].values(), key=lambda p: p["health_max_ms"])
        figures[key] = {"pass": row["pass"], "load_max": round(row["load_max"], 1), "answered": row["answered"],
                        "health": row["health"], "rss": row["rss"],
                        "own": row["own"], "codes": row["codes"], "health_max_ms": round(worst["health_max_ms"], 1),
                        "worst_probe_ran_waited_window_ms": [round(worst[k]) if worst[k] == worst[k] else None for k in
                                                             ("worst_ran_ms", "worst_waited_ms", "worst_window_ms")],
                        "rss_after_minus_before_mb": round(max(p["rss_after_mb"] - p["rss_before_mb"]
                                                               for p in row["procs"].values()), 1)}
    figures["attackers_niced"] = not any(row["unniced"] for row in rows)
    figures["servers_nice"] = servers_nice
    figures["all_targets_met"] = figures["attackers_niced"] and \
        all(row["pass"] for row in rows if not row["name"].endswith(CONTROL))
    result(figures)


if __name__ == "__main__":
    main()
