"""Does a refused oversized prompt stall everyone else? /health latency while `kvtier serve` refuses one.

Starts a real `kvtier serve` (SmolLM2-135M-Instruct) and, while one client posts a prompt far beyond the
model's context, probes /health every 20 ms from another. The limit is the same server's /health latency
when idle, measured in the same run; the figure is the slowest probe during each attack as a ratio to it.
With ``--reference SRC`` a second server runs another checkout's code (e.g. ``/work/main``, before the
fix) through the same attacks, as the peer.

Attacks: a 10 MB text prompt (over the default 8 MiB body limit: refused unread), a 6 MB one (under the
limit: refused after tokenizing about a context's worth) and a 6 MB chat message. Prompts are LooGLE
documents repeated to size when the workloads are present, else one sentence repeated.

    PYTHONPATH=. python benchmarks/server_hostile.py [--reference /work/main] [--model DIR]

Last line: RESULT {json}; a plot of every probe goes to results/server_hostile/health.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx
from _util import result
from tqdm import tqdm

from kvtier.apps.bench.launch import ServeProcess

ATTACKS = (("text 10 MB", "/v1/completions", 10_000_000), ("text 6 MB", "/v1/completions", 6_000_000),
           ("chat 6 MB", "/v1/chat/completions", 6_000_000))
PROBE_EVERY_S = 0.02


def filler_text() -> str:
    """Real prose to repeat: the LooGLE documents if the workloads are here, else one sentence."""
    root = Path(os.environ.get("KVTIER_WORKLOADS", Path(__file__).resolve().parents[1] / "../shared/workloads"))
    path = root / "loogle_longdep_qa.jsonl"
    if path.exists():
        with open(path) as fh:
            return "\n\n".join(json.loads(line)["input"] for line in fh)
    return "The cache keeps a prefix of every prompt so the server answers faster when users come back. "


def body(path: str, size: int, text: str) -> dict:
    prompt = (text * (size // len(text) + 1))[:size]
    if path.endswith("chat/completions"):
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    return {"prompt": prompt, "max_tokens": 4}


def probe(url: str, stop: threading.Event, out: list[tuple[float, float]], start: float) -> None:
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            sent = time.perf_counter()
            c.get(url + "/health").raise_for_status()
            out.append((sent - start, time.perf_counter() - sent))
            time.sleep(PROBE_EVERY_S)


def attack(url: str, path: str, payload: dict) -> dict:
    """Post ``payload`` while probing /health; the probes' latencies and the attack's status and time."""
    stop, probes, start = threading.Event(), [], time.perf_counter()
    poller = threading.Thread(target=probe, args=(url, stop, probes, start))
    poller.start()
    time.sleep(0.2)  # a few probes before the attack starts
    with httpx.Client(timeout=300) as c:
        sent = time.perf_counter()
        response = c.post(url + path, json=payload)
        answered = time.perf_counter() - sent
    time.sleep(0.2)
    stop.set()
    poller.join()
    return {"status": response.status_code, "answer_s": answered, "probes": probes,
            "health_max_s": max(lat for _, lat in probes)}


def idle_latency(url: str, n: int = 50) -> float:
    with httpx.Client(timeout=30) as c:
        lats = []
        for _ in range(n):
            sent = time.perf_counter()
            c.get(url + "/health").raise_for_status()
            lats.append(time.perf_counter() - sent)
            time.sleep(PROBE_EVERY_S)
    return statistics.median(lats)


def run_server(label: str, src: Path, args: argparse.Namespace, text: str, bar: tqdm) -> dict:
    serve_args = ["--threads", "1"] + (["--model", args.model] if args.model else [])
    proc = ServeProcess(label, serve_args, Path(args.out).resolve(), src=src)
    try:
        url = proc.wait_healthy(300).url
        runs = {"idle_s": idle_latency(url)}
        for name, path, size in ATTACKS:
            runs[name] = attack(url, path, body(path, size, text))
            bar.update()
    finally:
        proc.stop()
    return runs


def plot(runs: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ATTACKS), figsize=(5 * len(ATTACKS), 3.5), sharey=True)
    for ax, (name, _, _) in zip(axes, ATTACKS):
        for label, run in runs.items():
            t, lat = zip(*run[name]["probes"])
            ax.plot(t, [x * 1000 for x in lat], marker=".", label=f"{label} ({run[name]['status']})")
        ax.set_title(name)
        ax.set_xlabel("seconds since probing began")
        ax.set_yscale("log")
        ax.legend()
    axes[0].set_ylabel("/health latency (ms)")
    fig.tight_layout()
    fig.savefig(out / "health.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", help="another checkout to run as the peer (e.g. /work/main)")
    p.add_argument("--model", help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="results/server_hostile")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    text = filler_text()
    servers = {"kvtier": Path(__file__).resolve().parents[1]}
    if args.reference:
        servers["reference"] = Path(args.reference).resolve()
    runs = {}
    with tqdm(total=len(servers) * len(ATTACKS), desc="attacks") as bar:
        for label, src in servers.items():
            runs[label] = run_server(label, src, args, text, bar)
    figures: dict[str, float | int] = {}
    print(f"{'server':10} {'attack':12} {'status':>6} {'answer s':>9} {'health max ms':>14} {'x idle':>8}")
    for label, run in runs.items():
        idle = run["idle_s"]
        figures[f"{label}_idle_health_ms"] = idle * 1000
        for name, _, _ in ATTACKS:
            a = run[name]
            ratio = a["health_max_s"] / idle
            print(f"{label:10} {name:12} {a['status']:>6} {a['answer_s']:>9.2f} {a['health_max_s'] * 1000:>14.1f} "
                  f"{ratio:>8.1f}")
            key = f"{label}_{name.replace(' ', '_')}"
            figures.update({f"{key}_status": a["status"], f"{key}_answer_s": a["answer_s"],
                            f"{key}_health_max_ms": a["health_max_s"] * 1000, f"{key}_health_max_x_idle": ratio})
    plot(runs, Path(args.out))
    result(figures)


if __name__ == "__main__":
    main()
