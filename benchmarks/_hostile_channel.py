"""The event-channel and blending attacks benchmarks/hostile_fleet.py replays (issue 29: E-1 to E-4, B-1).

The same contract as ``_hostile_attacks`` (the HTTP ones): ``attack(fleet, big)`` returns ``{"codes": Counter of
answers, "size": what was sent, "ok": the attack's own target (None: only the fleet-wide ones), "note":
figures}``. The hostile peers are real processes speaking the real wire format (``tests/events/hostile.py``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
from _hostile_attacks import ENV, attacker_priority, code, in_attacker, post, series, sized_text

from tests.apps.route.fleet import ROOT, scrape


def hostile_peer(*args: str, wait_s: float) -> str:
    """Run tests.events.hostile with ``args`` (an attacker process, niced) for ``wait_s`` seconds after it is ready;
    its first line."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.events.hostile", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env=ENV, preexec_fn=attacker_priority)
    try:
        ready = proc.stdout.readline().strip()
        time.sleep(wait_s)
        return ready
    finally:
        proc.kill()
        proc.wait(timeout=10)


def e1_subscriptions(fleet, big: bool) -> dict:
    """A local process (a key pair of its own, not the router's) opens millions of subscriptions on a replica's
    event PUB socket: refused at the handshake, the replica holds none of them."""
    n = 3_000_000 if big else 100_000
    replica = fleet.replicas[0]
    events = replica.info()["events"]
    sent = time.perf_counter()
    ready = hostile_peer("subscribe", events["endpoint"], events["key"], str(n), wait_s=5.0)
    refused = "refused a client" in replica.log.read_text()
    return {"codes": Counter(["miss" if ready == "READY" else "error"]), "size": f"{n:,} subscriptions",
            "ok": refused, "note": f"peer held them {time.perf_counter() - sent:.0f}s; refused at the handshake "
                                   f"(logged): {refused}"}


def e2_snapshots(fleet, big: bool) -> dict:
    """A peer the replica lets in (it has the router's key: a compromised router) asks a replica's control socket
    for snapshots and never reads a reply."""
    from kvtier.events.keys import default_key_file

    n = 20_000 if big else 500
    events = fleet.replicas[0].info()["events"]
    ready = hostile_peer("snapshots", events["control"], events["key"], str(n), str(default_key_file()), wait_s=5.0)
    held = fleet.replicas[0].info()["tiers"]
    return {"codes": Counter(["miss" if ready == "READY" else "error"]), "size": f"{n:,} unread snapshot requests",
            "ok": None, "note": f"replica tiers: {json.dumps(held)[:80]}"}


# -- E-3 ----------------------------------------------------------------------------------------------------
def index_chunks(url: str, replica: str) -> float:
    """Keys the router's index holds for ``replica`` from its events (not the router's own ``recent`` record of
    requests it sent there, which is capped apart)."""
    return series(url, "kvtier_router_index_chunks", replica=replica) - \
        series(url, "kvtier_router_index_chunks", replica=replica, tier="recent")


def e3_flood(fleet, big: bool) -> dict:
    """The compromised replica floods stored-chunk events (and a tier name per event, and a big snapshot); then
    it dies and is ejected: the router's index holds at most its cap and frees it all."""
    keys, tiers, snap = (4_000_000, 2_000, 2_500_000) if big else (100_000, 200, 50_000)
    name = fleet.hostile_name
    def taken(what: str) -> float:
        return series(fleet.url, "kvtier_router_events_total", replica=name, what=what)

    snapshots, failed = taken("snapshot"), taken("snapshot_failed")
    httpx.post(fleet.hostile_url + "/hostile/flood", json={"keys": keys, "tiers": tiers, "snapshot": snap})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # until every event went out and the router took (or gave up) the snapshot
        sent = httpx.get(fleet.hostile_url + "/hostile/flood", timeout=10).json()["sent"]
        if sent >= keys + tiers and (taken("snapshot") > snapshots or taken("snapshot_failed") > failed):
            break
        time.sleep(0.5)
    applied = taken("batch")
    time.sleep(2.0)
    held = index_chunks(fleet.url, name)
    dropped = series(fleet.url, "kvtier_router_index_dropped_events", replica=name)
    labels = sum(1 for k in scrape(fleet.url) if k.startswith("kvtier_router_index_chunks") and name in k)
    start = time.perf_counter()
    fleet.hostile.kill()
    fleet.hostile.wait(timeout=10)
    fleet.paused.add(name)
    while fleet.replica_state(name) == "up" and time.perf_counter() - start < 30:
        time.sleep(0.05)
    time.sleep(1.0)
    after = index_chunks(fleet.url, name)
    return {"codes": Counter(["miss"]), "size": f"{keys:,} stores, {tiers:,} tier names, {snap:,}-key snapshot",
            "ok": 0 < held <= fleet.replica_key_cap and labels <= 16 and after == 0,
            "note": f"index held {held:,.0f} keys ({dropped:,.0f} dropped, {labels} tier labels; {applied:,.0f} "
                    f"batches applied, snapshots {taken('snapshot') - snapshots:.0f} taken, "
                    f"{taken('snapshot_failed') - failed:.0f} failed), {after:,.0f} after ejection"}


def e3_big_batches(fleet, big: bool) -> dict:
    """The compromised replica floods stored-chunk events in batches of 100,000 (a batch applied in one loop
    turn held the router's loop for seconds on a loaded machine): every event is applied, and /health is probed
    throughout as for every row. Runs before ``e3_flood``, whose keys it shares, while the index has room."""
    keys, batch = (1_000_000, 100_000) if big else (200_000, 100_000)
    name = fleet.hostile_name
    before = index_chunks(fleet.url, name)
    httpx.post(fleet.hostile_url + "/hostile/flood", json={"keys": keys, "tiers": 0, "snapshot": 0, "batch": batch})
    deadline, held = time.monotonic() + 240, before
    while time.monotonic() < deadline and held < before + keys:
        time.sleep(0.5)
        held = index_chunks(fleet.url, name)
    return {"codes": Counter(["miss"]), "size": f"{keys:,} stores in batches of {batch:,}",
            "ok": held >= min(before + keys, fleet.replica_key_cap),
            "note": f"index held {held:,.0f} keys after the flood ({before:,.0f} before)"}


# -- E-4 ----------------------------------------------------------------------------------------------------
def e4_impostor(fleet, big: bool) -> dict:
    """A replica is killed and a process binds its (fixed) event ports at once, serving fake keys with a key pair
    of its own: the router adopts none; the replica restarts on other ports and is followed again."""
    n = 1_000_000 if big else 100_000
    replica = fleet.replicas[1]
    snapshots = series(fleet.url, "kvtier_router_events_total", replica=replica.name, what="snapshot")
    fleet.paused.add(replica.name)
    replica.stop(signal.SIGKILL)
    impostor = subprocess.Popen([sys.executable, "-m", "tests.events.hostile", "impostor", str(replica.events_port),
                                 str(replica.control_port), str(n)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                env=ENV, preexec_fn=attacker_priority)
    try:
        ready = impostor.stdout.readline().strip()
        peak, deadline = 0.0, time.monotonic() + 6
        while time.monotonic() < deadline:
            peak = max(peak, index_chunks(fleet.url, replica.name))
            time.sleep(0.1)
        adopted = series(fleet.url, "kvtier_router_events_total", replica=replica.name, what="snapshot") - snapshots
        replica.start()
        replica.wait_healthy(120)
        fleet.wait_all_up()
        moved = replica.info()["events"]["endpoint"] != f"tcp://127.0.0.1:{replica.events_port}"
        said = "is taken" in replica.log.read_text()
        followed = False
        for _ in range(100):
            post(replica.url, "/v1/completions", json={"prompt": sized_text(400), "max_tokens": 1})
            if index_chunks(fleet.url, replica.name) > 0:
                followed = True
                break
            time.sleep(0.2)
        impostor_alive = impostor.poll() is None
    finally:
        impostor.kill()
        impostor.wait(timeout=10)
        fleet.paused.discard(replica.name)
    return {"codes": Counter(["miss" if ready == "READY" else "error"]), "size": f"impostor serving {n:,} fake keys",
            "ok": peak == 0 and adopted == 0 and followed,
            "note": f"fake keys adopted {peak:.0f}, impostor snapshots taken {adopted:.0f}, restarted on other "
                    f"ports {moved} (logged {said}; impostor still bound: {impostor_alive}), followed again {followed}"}


# -- B-1 ----------------------------------------------------------------------------------------------------
def blend_work(url: str) -> dict[str, float]:
    """A replica's counters of the blending work it did (kvtier.integrations.blend.lm)."""
    return {"passes": series(url, "kvtier_blend_segment_passes_total"),
            "pass_tokens": series(url, "kvtier_blend_segment_pass_tokens_total"),
            "skipped": series(url, "kvtier_blend_skipped_segment_tokens_total")}


def b1_client(url: str, prompts: list[str]) -> list[dict]:
    """Each prompt in turn (run by ``in_attacker``): its answer, seconds, prompt tokens, and the blending work the
    replica counted for it (``blend_work``'s counters, differences)."""
    out = []
    for prompt in prompts:
        before, sent = blend_work(url), time.perf_counter()
        r = post(url, "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        seconds, after = time.perf_counter() - sent, blend_work(url)
        tokens = r.json()["usage"]["prompt_tokens"] if code(r) == "200" else 0
        out.append({"code": code(r), "s": seconds, "tokens": tokens, **{k: after[k] - before[k] for k in after}})
    return out


def b1_blend(fleet, big: bool) -> dict:
    """``"a\\n\\n" * 2000 + "Question: what?"`` to a --blend-separator replica (more than MAX_SEGMENTS pieces: no
    segments, a plain prefill), and the most blending one prompt can ask for: 64 distinct pieces of 1-2 tokens,
    each a segment computed alone after the first token unless the work bound stops it. Each against a plain twin
    of as many tokens (tabs for the separator); another client's small requests meanwhile. The target is the work
    counted (a pass as ``pass_tokens`` plus its tokens: lm.py's bound), at most ``WORK_BOUND`` x the twin's; times
    are reported (on this tiny model a pass costs ~90 tokens' time, more than ``pass_tokens`` says)."""
    from kvtier.integrations.blend.config import BlendConfig
    from kvtier.integrations.blend.lm import WORK_BOUND

    copies, p = (2000 if big else 500), BlendConfig().pass_tokens
    pieces = [f"{i}" for i in range(64)]  # MAX_SEGMENTS
    prompts = ["a\t\t" * copies + "Question: what?", "a\n\n" * copies + "Question: what?",
               "\t\t".join(pieces) + "\t\tQuestion: what?", "\n\n".join(pieces) + "\n\nQuestion: what?"]
    url, stop, waits = fleet.replicas[0].url, threading.Event(), []

    def bystander() -> None:
        while not stop.is_set():
            sent = time.perf_counter()
            post(url, "/v1/completions", json={"prompt": "the cache", "max_tokens": 1})
            waits.append(time.perf_counter() - sent)
            time.sleep(0.05)

    thread = threading.Thread(target=bystander)
    thread.start()
    try:
        got = in_attacker("_hostile_channel.b1_client", url, prompts)
    finally:
        stop.set()
        thread.join()
    work = [p * (1 + g["passes"]) + g["tokens"] + g["pass_tokens"] for g in got]
    ratios = [work[1] / work[0], work[3] / work[2]]
    same = got[0]["tokens"] == got[1]["tokens"] and got[2]["tokens"] == got[3]["tokens"]
    return {"codes": Counter(g["code"] for g in got), "size": f'"a\\n\\n" * {copies:,} + question; 64 short '
            "pieces + question (each with a plain twin)",
            "ok": same and got[1]["passes"] == 0 and max(ratios) <= WORK_BOUND,
            "note": f"work x{ratios[0]:.2f} and x{ratios[1]:.2f} a plain prefill (bound {WORK_BOUND}; tokens "
                    f"{got[1]['tokens']:,}, {got[3]['tokens']}; segment passes {got[3]['passes']:.0f}, skipped "
                    f"{got[3]['skipped']:.0f} tokens); time x{got[1]['s'] / got[0]['s']:.2f} and "
                    f"x{got[3]['s'] / got[2]['s']:.2f}; bystander's worst wait {max(waits, default=0):.2f}s"}
