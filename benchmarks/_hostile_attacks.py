"""The attacks benchmarks/hostile_fleet.py replays (issue 29), each over real loopback sockets against real processes.

Each ``attack(fleet, big)`` returns ``{"codes": Counter of answers, "size": what was sent, "ok": the attack's own
target (None: only the fleet-wide ones), "note": figures}``. An answer is an HTTP status, or a word for what is
not one: ``reset`` (closed without an answer), ``none`` (no answer within the bound), ``error``.

Whatever an attacker sends runs in a process of its own at ``ATTACKER_NICE`` (``in_attacker``: building a 31 MB
body or reading a 1 GiB answer in the benchmark's process would hold the GIL its /health probes need, and its CPU
would compete at the servers' priority). The benchmark's own process only probes, orchestrates, and plays the
bystanders and victims (R-7's client, B-1's other client), at the servers' priority.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from harness.fleet import ROOT, scrape
from harness.malformed import MALFORMED_JSON

#: Attacker processes run this much nicer than the servers, standing in for clients on other hosts: on 2 cores the
#: CPU an attacker burns on its own side (opening 19,488 connections costs it ~9x what refusing them costs the
#: router) would otherwise decide every process's latency, which no server setting can bound (a cgroup can). The
#: servers' own work is not deprioritized. hostile_fleet checks every process it did not start as a server.
ATTACKER_NICE = 10
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def attacker_priority() -> None:
    """This process at ``ATTACKER_NICE`` (absolute: calling it twice is harmless). On Linux a thread's nice is its
    own: call it before any thread starts (``preexec_fn``, or first thing in a forked child), and every thread
    started afterwards inherits it."""
    os.setpriority(os.PRIO_PROCESS, 0, ATTACKER_NICE)


def in_attacker(name: str, *args, timeout_s: float = 900) -> dict:
    """``name(*args)`` (a function of this module, or ``module.function`` of another in benchmarks/; JSON arguments
    and result) run in an attacker process of its own at ``ATTACKER_NICE``; its result."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/_hostile_attacks.py"), "call", name,
                           json.dumps(args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=ENV,
                          preexec_fn=attacker_priority)
    if proc.returncode:
        raise RuntimeError(f"attacker {name} exited {proc.returncode}: {proc.stderr[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: kvtier\r\nContent-Type: application/json\r\n"
MB = 1_000_000
TEXT = "The cache keeps a prefix of every prompt so the server answers faster when users come back. "


def sized_text(size: int) -> str:
    return (TEXT * (size // len(TEXT) + 1))[:size]


def post(url: str, path: str, timeout: float = 120, **kwargs) -> httpx.Response | str:
    try:
        return httpx.post(url + path, timeout=timeout, **kwargs)
    except httpx.TimeoutException:
        return "none"
    except httpx.HTTPError:
        return "error"


def code(response: httpx.Response | str) -> str:
    return str(response.status_code) if isinstance(response, httpx.Response) else response


def series(url: str, prefix: str, **labels: str) -> float:
    """Sum of the /metrics series starting with ``prefix`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in scrape(url).items() if k.startswith(prefix) and all(w in k for w in want))


# -- R-1 ----------------------------------------------------------------------------------------------------
def r1_client(url: str) -> dict:
    """The R-1 requests (run by ``in_attacker``): their answers, and the non-ASCII header's."""
    codes = Counter()
    for p in MALFORMED_JSON:
        path, body = p.values
        codes[code(post(url, path, content=body, headers={"content-type": "application/json"}))] += 1
    for ids in ([1 << 64], [1 << 32], [-1]):
        codes[code(post(url, "/v1/completions", json={"prompt": ids}))] += 1
    header = code(post(url, "/v1/completions", json={"prompt": "the cache"}, headers={"x-echo": b"caf\xe9 \xff"}))
    codes[header] += 1
    return {"codes": codes, "header": header}


def r1_malformed(fleet, big: bool) -> dict:
    """kvtier serve's own malformed bodies, token ids out of range, non-ASCII header bytes: 400s, never a 500."""
    out = in_attacker("r1_client", fleet.url)
    return {"codes": Counter(out["codes"]), "size": f"{len(MALFORMED_JSON)} bodies, 3 token ids, 1 header",
            "ok": None, "note": f"non-ASCII header answered {out['header']}"}


# -- R-2 ----------------------------------------------------------------------------------------------------
def r2_client(url: str, session: str, sizes: list[int]) -> dict:
    """The R-2 bodies (run by ``in_attacker``): built and sent here, where their CPU is the attacker's."""
    codes, times = Counter(), []
    for body, path in (({"prompt": sized_text(sizes[0])}, "/v1/completions"),
                       ({"prompt": sized_text(sizes[1])}, "/v1/completions"),
                       ({"messages": [{"role": "user", "content": "hi"}] * sizes[2]}, "/v1/chat/completions"),
                       ({"messages": [{"role": "user", "content": "hi"}] * sizes[3]}, "/v1/chat/completions")):
        sent = time.perf_counter()
        codes[code(post(url, path, json=body, headers={"x-session-id": session}))] += 1
        times.append(time.perf_counter() - sent)
    return {"codes": codes, "times": times}


def r2_huge_prompts(fleet, big: bool) -> dict:
    """A 31 MB text prompt (over the router's 8 MiB cap), a 7 MB one (under it: a bounded prefix tokenized, the
    replica judges the context), a chat of 840k messages (over the cap), and one of 240k messages (7.9 MB, just
    under it: the most checking, rendering and tokenizing one body can ask of the router)."""
    sizes = (31 * MB, 7 * MB, 840_000, 240_000) if big else (9 * MB, 3 * MB, 100_000, 100_000)
    session = home_on(fleet, fleet.replicas[0].name)  # a real replica's, not the compromised one's stub answers
    out = in_attacker("r2_client", fleet.url, session or "r2", sizes)
    return {"codes": Counter(out["codes"]), "size": f"text {sizes[0] / MB:.0f} MB, text {sizes[1] / MB:.0f} MB, "
            f"chats of {sizes[2]:,} and {sizes[3]:,} messages", "ok": None,
            "note": "answered in " + ", ".join(f"{t:.1f}s" for t in out["times"])}


# -- R-3 ----------------------------------------------------------------------------------------------------
def _answer(sock: socket.socket, timeout: float) -> str:
    """The status of the answer on ``sock`` (``reset``/``none`` if there is none)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while not data.endswith(b"\r\n\r\n") and b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                break
            data += more
    except TimeoutError:
        return "none"
    except OSError:
        return "reset"
    return data.split()[1].decode() if data.startswith(b"HTTP/1.1 ") else "reset"


def huge_header(url: str, size: int) -> tuple[str, int]:
    """Send a head whose one header value is ``size`` bytes, in 1 MiB pieces (run by ``in_attacker``); the answer
    and bytes sent."""
    host, port = url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            s.sendall(HEAD + b"X-Big: ")
            piece = b"b" * (1 << 20)
            while sent < size:
                s.sendall(piece)
                sent += len(piece)
            s.sendall(b"\r\nContent-Length: 2\r\n\r\n{}")
        except OSError:
            pass  # refused mid-head: read the answer it left
        return _answer(s, 30), sent


def r3_header(target: str, size_big: int):
    def attack(fleet, big: bool) -> dict:
        size = size_big if big else 16 << 20
        status, sent = in_attacker("huge_header", fleet.target_url(target), size)
        refused = series(fleet.url, "kvtier_router_requests_total", endpoint="http", status="431") \
            if target == "router" else None
        return {"codes": Counter([status]), "size": f"one {size >> 20} MiB header value to the {target}",
                "ok": None, "note": f"{sent >> 20} MiB sent before the answer" +
                (f"; router counts {refused:.0f} 431s" if refused is not None else "")}
    attack.__doc__ = f"One huge header value sent to the {target} (R-3)."
    return attack


# -- R-4 ----------------------------------------------------------------------------------------------------
def half_heads(url: str, n: int, hold_s: float) -> tuple[Counter, int, float]:
    """Open ``n`` connections each sending half a head; collect their answers for ``hold_s`` seconds (run by
    ``in_attacker``). The answers, connections opened, and the CPU seconds this process used."""
    host, port = url.removeprefix("http://").split(":")
    sel, socks, codes, opened = selectors.DefaultSelector(), [], Counter(), 0
    try:
        for _ in range(n):
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(HEAD[:30])
            except OSError:
                codes["refused"] += 1
                continue
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, [b""])
            socks.append(s)
            opened += 1
        deadline = time.monotonic() + hold_s
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.2):
                try:
                    more = key.fileobj.recv(4096)
                except OSError:
                    more = b""
                if more:
                    key.data[0] += more
                    continue
                data = key.data[0]
                codes[data.split()[1].decode() if data.startswith(b"HTTP/1.1 ") else "reset"] += 1
                sel.unregister(key.fileobj)
        if sel.get_map():
            codes["none"] += len(sel.get_map())
    finally:
        for s in socks:
            s.close()
        sel.close()
    return codes, opened, cpu_s(os.getpid())


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process used so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def r4_half_heads(target: str):
    def attack(fleet, big: bool) -> dict:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        want = 2_000 if target == "replica" else 20_000
        n = min(want if big else 1_000, soft - 512)
        if target == "sink":  # the control: the same attacker against a listener that does nothing
            with fleet.starting:  # named a server (not niced) before the niceness check can see it
                sink = subprocess.Popen([sys.executable, __file__, "sink", str(n)], stdout=subprocess.PIPE, text=True)
                fleet.servers.add(sink.pid)
            url, pid = sink.stdout.readline().strip(), sink.pid
        else:
            url, pid = fleet.target_url(target), fleet.router.pid if target == "router" else fleet.replicas[0].proc.pid
        used = cpu_s(pid)
        try:
            got, opened, attacker_s = in_attacker("half_heads", url, n, 14.0)
            codes = Counter(got)
            used = cpu_s(pid) - used
        finally:
            if target == "sink":
                sink.kill()
                sink.wait(timeout=10)
                fleet.servers.discard(pid)
        return {"codes": codes, "size": f"{n:,} half-sent heads to the {target} (fd limit {soft:,}), held 14 s",
                "ok": codes["none"] == 0 if target != "sink" else None,
                "note": f"{opened:,} connected; CPU s: attacker {attacker_s:.1f}, {target} {used:.1f}"}
    attack.__doc__ = f"Half-sent request heads held open against the {target} (R-4), from a process of its own; " \
                     "against ``sink`` (a do-nothing listener, the control) what the attacker's work costs the rest."
    return attack


def sink(n: int) -> None:
    """A listener that accepts connections and holds them without reading (R-4's control); prints its URL."""
    import asyncio

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0, backlog=2048)
        print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())


# -- R-5 ----------------------------------------------------------------------------------------------------
def r5_client(url: str, n: int) -> dict:
    """``n`` requests whose ``user`` is 1 MB, 4 at a time (run by ``in_attacker``)."""
    body = {"prompt": "the cache", "user": "u" * MB}
    with ThreadPoolExecutor(4) as pool:
        return {"codes": Counter(pool.map(lambda _: code(post(url, "/v1/completions", json=body)), range(n)))}


def r5_sessions(fleet, big: bool) -> dict:
    """400 requests whose ``user`` is 1 MB: each a 400, none kept in the sticky table."""
    n = 400 if big else 40
    return {"codes": Counter(in_attacker("r5_client", fleet.url, n)["codes"]), "size": f"{n} requests, user of 1 MB",
            "ok": None, "note": ""}


# -- R-6 ----------------------------------------------------------------------------------------------------
def home_on(fleet, name: str, tries: int = 40) -> str | None:
    """A session id the router sends to replica ``name`` (found by trying a bounded number of them)."""
    for i in range(tries):
        r = post(fleet.url, "/v1/completions", json={"prompt": "the cache"}, headers={"x-session-id": f"s{i}"})
        if isinstance(r, httpx.Response) and r.headers.get("x-kvtier-replica") == name:
            return f"s{i}"
    return None


def r6_client(url: str) -> tuple[int, str, str | None]:
    """Ask for the huge answer and read it all (run by ``in_attacker``): bytes read, status, replica."""
    got = 0
    try:
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "HUGE"}, timeout=httpx.Timeout(60)) as r:
            status, by = str(r.status_code), r.headers.get("x-kvtier-replica")
            for piece in r.iter_raw():
                got += len(piece)
    except httpx.HTTPError as exc:
        status, by = type(exc).__name__, None
    return got, status, by


def r6_huge_answer(fleet, big: bool) -> dict:
    """The compromised replica answers a non-streamed 1 GiB body: the router passes it on as it arrives. (The
    router never picks it for new sessions while the real replicas are idle, so they are SIGSTOPped until ejected.)"""
    real = fleet.replicas
    fleet.paused.update(r.name for r in real)
    for r in real:
        r.proc.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while any(fleet.replica_state(r.name) == "up" for r in real) and time.monotonic() < deadline:
            time.sleep(0.1)
        got, status, by = in_attacker("r6_client", fleet.url)
    finally:
        for r in real:
            r.proc.send_signal(signal.SIGCONT)
        fleet.paused.difference_update(r.name for r in real)
    fleet.wait_all_up()
    return {"codes": Counter([status]), "size": f"{fleet.huge_bytes >> 20} MiB answer", "ok": got > fleet.huge_bytes,
            "note": f"{got >> 20} MiB received through the router from {by}"}


# -- R-7 ----------------------------------------------------------------------------------------------------
def routed_by_prefix(fleet, replica, tries: int = 20) -> dict | None:
    """A request body the router sends to ``replica`` because that replica alone holds its prefix (it is sent
    to the replica directly first, which publishes the chunks it stored): deterministic where homing a fresh
    session id depends on every earlier attack's sessions and the load at that moment."""
    for i in range(tries):  # a new prompt each try: one routed elsewhere is cached there too
        body = {"prompt": f"r7 {i} {time.time_ns()} " + sized_text(900), "max_tokens": 1}
        post(replica.url, "/v1/completions", json={**body, "prompt": body["prompt"][:880]})
        r = post(fleet.url, "/v1/completions", json=body)
        if isinstance(r, httpx.Response) and r.headers.get("x-kvtier-replica") == replica.name:
            return body
        time.sleep(0.5)  # the replica's events not in the router's index yet
    return None


def r7_stopped_replica(fleet, big: bool) -> dict:
    """A request sent to a replica that is SIGSTOPped: answered by another once the stopped one is ejected."""
    replica = fleet.replicas[0]
    body = routed_by_prefix(fleet, replica)
    if body is None:
        return {"codes": Counter(["unrouted"]), "size": "-", "ok": False, "note": "no request routed to it"}
    ejected_at = []

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ejected_at:
            try:
                states = {r["name"]: r["state"] for r in httpx.get(fleet.url + "/health", timeout=2).json()["replicas"]}
                if states.get(replica.name) != "up":
                    ejected_at.append(time.perf_counter())
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)

    fleet.paused.add(replica.name)
    replica.proc.send_signal(signal.SIGSTOP)
    stopped = time.perf_counter()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = post(fleet.url, "/v1/completions", json=body)
        answered = time.perf_counter()
    finally:
        replica.proc.send_signal(signal.SIGCONT)
        watcher.join()
        fleet.paused.discard(replica.name)
    by = r.headers.get("x-kvtier-replica") if isinstance(r, httpx.Response) else None
    eject_s = ejected_at[0] - stopped if ejected_at else float("nan")
    wait_s = answered - stopped
    fleet.wait_all_up()
    return {"codes": Counter([code(r)]), "size": "1 request queued on a SIGSTOPped replica",
            "ok": code(r) == "200" and by != replica.name and wait_s <= eject_s + 5.0,
            "note": f"ejected after {eject_s:.1f}s, answered after {wait_s:.1f}s by {by}"}


if __name__ == "__main__":
    if sys.argv[1] == "call":  # call [MODULE.]NAME JSON_ARGS: an attacker's part, a process of its own (in_attacker)
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
        module, _, name = sys.argv[2].rpartition(".")
        where = vars(importlib.import_module(module)) if module else globals()
        print(json.dumps(where[name](*json.loads(sys.argv[3]))))
    elif sys.argv[1] == "sink":
        sink(int(sys.argv[2]))
