"""Issue 48's attacks for benchmarks/hostile_fleet.py: T-1, O-1, S-1, A-1 to A-4 and P-1, real processes over
real sockets (the servers they aim at: benchmarks/_hostile_servers.py). Same contract as _hostile_attacks: each
``attack(fleet, big)`` returns ``{"codes", "size", "ok", "note"}``; what an attacker sends runs niced in a process
of its own (``in_attacker``); the benchmark's process only orchestrates (O-1's kill and restart, P-1's counting).

Answers that are not HTTP statuses (``WORDS``, clear answers besides any 4xx): ``done`` (S-1, O-1: the library
or admin work ran to its end), ``refused`` (A-4: ``kvtier cache`` exited non-zero with one line, within its
bound). Not clear: ``exit0`` (success claimed for a hostile answer), ``lines`` (non-zero, but a traceback or
more than one line), ``none`` (no answer, or no exit, within the bound).
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from _hostile_attacks import ENV, code, in_attacker, post, sized_text
from _hostile_procs import rss_mb
from _hostile_servers import ADMIN, ALICE, MODES, ROOT

WORDS = {"done", "refused"}
ADMIN_DEADLINE_S = 60.0  #: kvtier route's default --admin-timeout
AUTH = {"Authorization": f"Bearer {ADMIN}"}
DEEP = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DIGITS = b'{"tokens": [' + b"9" * 5000 + b"]}"
CLI_RSS_KILL_MB = 3000  #: A-4: a ``kvtier cache`` run past this is killed (one once took 16 GB in 36 s)


# -- T-1 ----------------------------------------------------------------------------------------------------
def t1_client(url: str) -> dict:
    """A one-chunk-plus prompt with ``cache_ttl_s`` 1e308 to a serve with a Redis tier, then a plain request, then
    /health (run by ``in_attacker``)."""
    prompt = sized_text(300)  # several 16-token chunks
    bad = post(url, "/v1/completions", timeout=30, json={"prompt": prompt, "max_tokens": 2, "cache_ttl_s": 1e308})
    good = post(url, "/v1/completions", timeout=30, json={"prompt": prompt, "max_tokens": 2, "cache_ttl_s": 3600})
    try:
        health = httpx.get(url + "/health", timeout=10)
        body = health.json()
    except (httpx.HTTPError, ValueError):
        health, body = "none", {}
    return {"bad": code(bad), "good": code(good), "health": code(health), "status": body.get("status"),
            "in_flight": body.get("in_flight"), "dead": body.get("dead_threads")}


def t1_ttl(fleet, big: bool) -> dict:
    """T-1: ``cache_ttl_s: 1e308`` on a ``kvtier serve`` with a Redis tier: a 400, the next request served,
    /health ok with nothing in flight (no thread died)."""
    out = in_attacker("_hostile_round3.t1_client", fleet.extras.t1.url)
    ok = out["bad"].startswith("4") and out["good"] == "200" and out["health"] == "200" \
        and out["status"] == "ok" and out["in_flight"] == 0
    return {"codes": Counter([out["bad"], out["good"]]), "size": "1 request with cache_ttl_s 1e308, then 1 plain",
            "ok": ok, "note": f"1e308 answered {out['bad']}, next {out['good']}; /health {out['health']} "
            f"{out['status']}, in_flight {out['in_flight']}, dead threads {out['dead'] or []}"}


# -- O-1 ----------------------------------------------------------------------------------------------------
def _cached(url: str, prompt: str, key: str) -> int:
    r = httpx.post(url + "/admin/v1/lookup", json={"text": prompt}, headers={"Authorization": f"Bearer {key}"},
                   timeout=60)
    return r.json()["cached_tokens"] if r.status_code == 200 else -1


def _files_settled(disk: Path, timeout_s: float = 60) -> int:
    """Until the disk tier's files stop changing for 1.5 s (its writes run in the background); how many."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = sum(1 for p in disk.rglob("*") if p.is_file())
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > 1.5:
            break
        time.sleep(0.3)
    return last


def o1_crash(fleet, big: bool) -> dict:
    """O-1: tenant alice stores prompts (with a TTL) on a ``kvtier serve`` with a disk tier, which is SIGKILLed and
    restarted; alice's clear must then remove every one of her entries (the default tenant's stay)."""
    o1, n = fleet.extras.o1, (12 if big else 3)
    prompts = [f"o1 alice {i}: " + sized_text(300) for i in range(n)]
    other = "o1 default tenant: " + sized_text(300)
    codes = Counter()
    for p in prompts:
        codes[code(post(o1.url, "/v1/completions", json={"prompt": p, "max_tokens": 1, "cache_ttl_s": 3600},
                        headers={"Authorization": f"Bearer {ALICE}"}))] += 1
    codes[code(post(o1.url, "/v1/completions", json={"prompt": other, "max_tokens": 1}))] += 1
    files = _files_settled(fleet.extras.disk)
    fleet.paused.add("o1")
    try:
        o1.stop(signal.SIGKILL)  # no clean close
        o1.start()
        o1.wait_healthy()
    finally:
        fleet.paused.discard("o1")
    before = sum(_cached(o1.url, p, ALICE) for p in prompts)
    cleared = httpx.post(o1.url + "/admin/v1/clear", json={}, headers={"Authorization": f"Bearer {ALICE}"},
                         timeout=60)
    codes[str(cleared.status_code)] += 1
    after = sum(_cached(o1.url, p, ALICE) for p in prompts)
    kept = _cached(o1.url, other, ADMIN)
    return {"codes": codes, "size": f"{n} prompts of alice's, 1 of the default tenant's, {files} files; SIGKILL",
            "ok": before > 0 and after == 0 and cleared.status_code == 200,
            "note": f"alice's cached tokens after the restart {before}, after her clear {after}; "
                    f"the default tenant's prompt {kept}"}


# -- S-1 ----------------------------------------------------------------------------------------------------
def s1_client(path: str) -> dict:
    """Server b (a process of its own, ended) leaves pages in a disk path; server a (tenant a, this process)
    stores the same pages there and clears; b's must still load (run by ``in_attacker``)."""
    from harness.sglang_pool import HostPool, backend
    from harness.sglang_keys import WRITER, disk, flush, keys_of, radix_key, text

    subprocess.run([sys.executable, "-c", WRITER, path], check=True, env={**os.environ, **ENV}, timeout=600,
                   capture_output=True)
    keys = keys_of(radix_key(text(3)))
    a = backend(HostPool("layer_first"), disk(path, tenant="a"))
    a.mem_pool_host.fill(6)
    stored = sum(a.batch_set_v1(keys, a.mem_pool_host.host_indices(0, 3)))
    flush(a)
    cleared = a.clear()
    a_left = a.batch_exists(keys)
    a.close()
    b = backend(HostPool("layer_first"), disk(path, tenant="b"))
    b_loaded = sum(b.batch_get_v1(keys, b.mem_pool_host.host_indices(0, 3)))
    b.close()
    return {"pages": len(keys), "a_stored": stored, "cleared": cleared, "a_left": a_left, "b_loaded": b_loaded}


def s1_sglang(fleet, big: bool) -> dict:
    """S-1: the SGLang HiCache backend, tenants a and b on one disk path: a's ``clear()`` leaves b's pages."""
    with tempfile.TemporaryDirectory(prefix="hostile-s1-") as path:
        out = in_attacker("_hostile_round3.s1_client", path)
    n = out["pages"]
    return {"codes": Counter(["done"]), "size": f"{n} pages each of tenants a and b, one disk path", "ok":
            out["a_stored"] == n and out["cleared"] is True and out["a_left"] == 0 and out["b_loaded"] == n,
            "note": f"a's clear: a's pages left {out['a_left']}/{n}, b's still loading {out['b_loaded']}/{n}"}


# -- A-1, A-2 -----------------------------------------------------------------------------------------------
def raw_post(url: str, path: str, body: bytes, authorization: bytes) -> tuple[str, bytes]:
    """POST with header bytes httpx refuses to send (http.client sends any but CR/LF): status and body."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.putrequest("POST", path)
        for name, value in ((b"authorization", authorization), (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())):
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return str(response.status), response.read()
    except TimeoutError:
        return "none", b""
    except OSError:
        return "reset", b""
    finally:
        conn.close()


def a1_client(urls: dict[str, str]) -> dict:
    """A 100,000-deep body and a 5,000-digit token to each server's /admin/v1/lookup (run by ``in_attacker``)."""
    got = {}
    for name, url in urls.items():
        got[name] = [raw_post(url, "/admin/v1/lookup", body, f"Bearer {ADMIN}".encode())[0] for body in (DEEP, DIGITS)]
    return got


def a1_nested(fleet, big: bool) -> dict:
    """A-1: deeply nested and 5,000-digit admin bodies to kvtier route, kvtier serve and the vLLM rank server."""
    urls = {"router": fleet.url, "serve": fleet.replicas[0].url, "rank": fleet.extras.rank_url}
    got = in_attacker("_hostile_round3.a1_client", urls)
    return {"codes": Counter(c for pair in got.values() for c in pair), "size": "100,000-deep and 5,000-digit "
            "lookup bodies to 3 servers", "ok": None, "note": "; ".join(f"{n} {'/'.join(c)}" for n, c in got.items())}


def a2_client(router: str, servers: dict[str, str]) -> dict:
    """Non-ASCII Authorization bytes and the admin key with trailing spaces through the router's fan-out, and a
    guessed key to every server: answers, and how many echoed a key (run by ``in_attacker``)."""
    codes, echoed, guess = Counter(), [], b"Bearer guessed-s3cret-9k"
    for auth in (b"Bearer k\xe9y-\xff", f"Bearer {ADMIN}   ".encode()):
        status, body = raw_post(router, "/admin/v1/lookup", b'{"text": "hello"}', auth)
        codes[status] += 1
        if ADMIN.encode() in body or b"k\xe9y" in body or "k\\u00e9y".encode() in body:
            echoed.append(f"router:{status}")
    for name, url in servers.items():
        status, body = raw_post(url, "/admin/v1/lookup", b'{"text": "hello"}', guess)
        codes[status] += 1
        if b"s3cret" in body:
            echoed.append(f"{name}:{status}")
    return {"codes": codes, "echoed": echoed}


def a2_header(fleet, big: bool) -> dict:
    """A-2: header bytes through the router's admin fan-out; no answer anywhere echoes a credential."""
    servers = {"router": fleet.url, "serve": fleet.replicas[0].url, "rank": fleet.extras.rank_url}
    out = in_attacker("_hostile_round3.a2_client", fleet.url, servers)
    return {"codes": Counter(out["codes"]), "size": "2 keys through the fan-out, a wrong key to 3 servers",
            "ok": not out["echoed"], "note": f"answers echoing a key: {len(out['echoed'])} {out['echoed']}"}


# -- A-3 ----------------------------------------------------------------------------------------------------
A3_MODES = ("huge", "drip", "hang", "deep", "digits", "mistyped")


def a3_client(router: str, wait_s: float, hostile: str) -> dict:
    """One admin lookup per hostile mode of the compromised replica ``hostile``, all at once (run by
    ``in_attacker``): each one's answer, seconds, and the error the router lists for that replica."""
    def one(mode: str) -> tuple[str, list]:
        sent = time.monotonic()
        r = post(router, "/admin/v1/lookup", timeout=wait_s, json={"text": mode}, headers=AUTH)
        try:
            error = r.json()["replicas"][hostile].get("error") if isinstance(r, httpx.Response) else None
        except (ValueError, KeyError, TypeError, AttributeError):
            error = None
        return mode, [code(r), time.monotonic() - sent, str(error)[:80] if error else None]

    with ThreadPoolExecutor(len(A3_MODES)) as pool:
        return dict(pool.map(one, A3_MODES))


def a3_fanout(fleet, big: bool) -> dict:
    """A-3: the compromised replica answers admin lookups with 1 GiB, a drip, nothing, deep nesting, 5,000 digits
    or a mistyped field; each call through the router is answered within its fan-out deadline."""
    wait_s = ADMIN_DEADLINE_S + 30
    assert fleet.replica_state(fleet.hostile_name) == "up", "A-3 needs the compromised replica (E-3 kills it)"
    got = in_attacker("_hostile_round3.a3_client", fleet.url, wait_s, fleet.hostile_name)
    # the compromised replica was asked (not skipped as ejected) and is listed as failing, within the deadline
    ok = all(s == "200" and t <= ADMIN_DEADLINE_S + 15 and e not in (None, "ejected") for s, t, e in got.values())
    return {"codes": Counter(s for s, _, _ in got.values()), "size": f"6 lookups at once ({fleet.huge_bytes >> 20} "
            f"MiB answer, drip, hang, deep, digits, mistyped)", "ok": ok,
            "note": ", ".join(f"{m} {s} in {t:.1f}s ({e})" for m, (s, t, e) in got.items())}


# -- A-4 ----------------------------------------------------------------------------------------------------
def a4_client(timeout_s: float, huge: int) -> dict:
    """``kvtier cache stats --timeout T`` against each hostile server of _hostile_servers (run by ``in_attacker``):
    per mode the exit status, output lines, seconds and peak RSS (MB)."""
    server = subprocess.Popen([sys.executable, str(ROOT / "benchmarks/_hostile_servers.py"), "cli-hostile",
                               str(huge)], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    try:
        ports = json.loads(server.stdout.readline())
        with ThreadPoolExecutor(len(MODES)) as pool:
            return dict(pool.map(lambda m: (m, _run_cli(ports[m], timeout_s)), MODES))
    finally:
        server.kill()
        server.wait(timeout=10)


def _run_cli(port: int, timeout_s: float) -> dict:
    """One ``kvtier cache stats`` run, killed past its bound; its exit status (None: killed), lines, peak RSS."""
    bound = timeout_s + 30  # the timeout, plus a loaded machine's interpreter start at nice +10
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier", "cache", "stats", "--url",
                                 f"http://127.0.0.1:{port}", "--timeout", str(timeout_s)], stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, env={**ENV, "KVTIER_ADMIN_KEY": ADMIN})
        started, killed = time.monotonic(), False
        while True:  # os.wait4, not Popen.wait: the child's own peak RSS comes with its status
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - started > bound or rss_mb(proc.pid) > CLI_RSS_KILL_MB:
                proc.kill()  # past its bound, or about to take the machine's memory (an endless answer)
                killed = True
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)
        took = time.monotonic() - started
        out.seek(0)
        text = out.read().decode(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    return {"rc": None if killed else proc.returncode, "lines": len(lines), "s": took,
            "first": lines[0][:120] if lines else "", "rss_mb": usage.ru_maxrss / 1024}


def a4_answer(mode: str, run: dict) -> str:
    if run["rc"] is None:
        return "none"
    if mode == "ok":
        return "200" if run["rc"] == 0 else "lines"
    if run["rc"] == 0:
        return "exit0"
    return "refused" if run["lines"] == 1 else "lines"


def a4_cache_cli(fleet, big: bool) -> dict:
    """A-4: ``kvtier cache`` against hostile servers: a 1 GiB answer, an endless and a dripping one, ``{"error":
    "..."}``, deep nesting, a 200 text/html page: each exits non-zero with one line, within ``--timeout`` (plus
    start-up) and 200 MB of the control run's memory."""
    timeout_s = 20.0 if big else 5.0
    runs = in_attacker("_hostile_round3.a4_client", timeout_s, fleet.huge_bytes)
    base = runs["ok"]["rss_mb"]
    codes = Counter(a4_answer(m, r) for m, r in runs.items())
    ok = all(a4_answer(m, r) in ("200", "refused") and r["rss_mb"] - base <= 200 for m, r in runs.items())
    note = "; ".join(f"{m}: exit {r['rc']}, {r['lines']} lines, {r['s']:.1f}s, {r['rss_mb']:.0f} MB"
                     for m, r in runs.items())
    firsts = {m: r["first"] for m, r in runs.items() if m != "ok"}
    return {"codes": codes, "size": f"7 servers, --timeout {timeout_s:.0f}, {fleet.huge_bytes >> 20} MiB answer",
            "ok": ok, "note": note + f"; first lines {json.dumps(firsts)[:600]}"}


# -- P-1 ----------------------------------------------------------------------------------------------------
def idle_conns(url: str, n: int, hold_s: float) -> dict:
    """Open ``n`` connections that send nothing; for ``hold_s`` seconds see which the server closes (run by
    ``in_attacker``)."""
    host, port = url.removeprefix("http://").split(":")
    sel, socks, closed, refused = selectors.DefaultSelector(), [], 0, 0
    for _ in range(n):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
        except OSError:
            refused += 1
            continue
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        socks.append(s)
    deadline = time.monotonic() + hold_s
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            try:
                more = key.fileobj.recv(65536)
            except OSError:
                more = b""
            if not more:
                closed += 1
                sel.unregister(key.fileobj)
    still = len(sel.get_map())
    for s in socks:
        s.close()
    return {"opened": len(socks), "refused": refused, "closed": closed, "open": still}


def _threads_fds(pid: int) -> tuple[int, int]:
    try:
        threads = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("Threads"))
        return threads, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return -1, -1


def p1_idle(fleet, big: bool) -> dict:
    """P-1: 1,500 idle connections to the vLLM rank's metrics/admin server, held 20 s: its threads stay bounded
    and every idle connection is closed by the server before the end; /metrics answers meanwhile."""
    n, hold = (1_500, 20.0) if big else (300, 12.0)
    n = min(n, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256)
    pid, url = fleet.extras.rank.pid, fleet.extras.rank_url
    before, peak, result = _threads_fds(pid), [0, 0], {}
    attacker = threading.Thread(target=lambda: result.update(in_attacker("_hostile_round3.idle_conns", url, n, hold)))
    attacker.start()
    metrics = Counter()
    while attacker.is_alive():
        threads, fds = _threads_fds(pid)
        peak = [max(peak[0], threads), max(peak[1], fds)]
        r = post(url, "/admin/v1/lookup", timeout=10, json={"tokens": [1] * 32}, headers=AUTH)
        metrics[code(r)] += 1
        time.sleep(0.5)
    attacker.join()
    after = _threads_fds(pid)
    ok = peak[0] - before[0] <= 64 and result.get("open", n) == 0
    return {"codes": metrics, "size": f"{result.get('opened', 0):,} idle connections held {hold:.0f} s "
            f"(+{result.get('refused', 0)} refused); answers: admin lookups meanwhile", "ok": ok,
            "note": f"threads {before[0]} -> peak {peak[0]} -> {after[0]}, descriptors {before[1]} -> peak {peak[1]} "
                    f"-> {after[1]}; closed by the server {result.get('closed')}, open at the end {result.get('open')}"}


#: A-3 needs the compromised replica, which E-3 kills: hostile_fleet runs it before the E-3 rows
BEFORE_E3 = [("A-3 admin fanout", a3_fanout)]
ATTACKS = [("S-1 sglang clear", s1_sglang), ("T-1 ttl 1e308", t1_ttl), ("O-1 crash clear", o1_crash),
           ("A-1 nested admin", a1_nested), ("A-2 admin headers", a2_header), ("A-4 cache cli", a4_cache_cli),
           ("P-1 idle conns", p1_idle)]
