"""The servers benchmarks/hostile_fleet.py starts beside its fleet for issue 48's rows, and a hostile one.

``Extras`` starts, at the servers' priority, for the whole run (probed and sampled like the fleet's processes):

* ``t1``: ``kvtier serve`` with a Redis tier only (a real redis-server from harness/redis_server.py): T-1's target;
* ``o1``: ``kvtier serve`` with a disk tier only, SIGKILLed and restarted by O-1;
* ``rank``: the vLLM connector's per-rank metrics/admin server (kvtier.integrations.vllm.admin.AdminServer) over
  a real KVCache, in a process of its own, as a vLLM worker runs it (no engine needed to serve it): A-1, A-2
  and P-1's target. It has no ``/health``: its probe is ``GET /metrics``.

Every kvtier server of the run (the fleet's replicas too) takes ``ADMIN`` as its admin key (A-2 looks for it in
every answer), and ``ALICE`` is a tenant's key.

Run as a script it is one of two processes:

    python benchmarks/_hostile_servers.py rank ADMIN_KEY      # the rank server; prints its port
    python benchmarks/_hostile_servers.py cli-hostile HUGE    # A-4's hostile servers; prints {mode: port}

``cli-hostile`` is a raw asyncio HTTP server per mode, answering any request (A-4's ``kvtier cache``):
``ok`` a well-formed stats answer (the control), ``huge`` a 200 JSON-looking body of HUGE bytes without a
length, ``endless`` a 200 body that never ends, ``drip`` one byte every 0.5 s for ever, ``error`` a 502 with
``{"error": "..."}`` (a string, not kvtier's error object), ``deep`` a 200 array nested 100,000 deep, ``html`` a
200 ``text/html`` page.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ADMIN = "fleet-admin-key-3c9e51"  #: the admin key of every kvtier server in the run
ALICE = "alice-tenant-key"  #: a tenant's API key
CHUNK = 16  #: tokens per chunk on t1 and o1 (as the fleet's replicas)


def admin_key_file(work: Path) -> Path:
    path = work / "admin.key"
    path.write_text(ADMIN + "\n")
    path.chmod(0o600)
    return path


class Extras:
    """t1, o1 and rank (module docstring), started and waited for; ``close()`` ends them and the redis-server."""

    def __init__(self, work: Path, model: Path) -> None:
        from harness.fleet import ReplicaProcess
        from harness.redis_server import RedisServer

        key = admin_key_file(work)
        self.redis = RedisServer().start()
        self.disk = work / "o1-disk"
        self.t1 = ReplicaProcess(model, work, "--config", self._config(work, "t1", f"{{kind: redis, url: "
                                 f"'{self.redis.url}'}}"), "--admin-key-file", str(key), "--no-events").start()
        self.o1 = ReplicaProcess(model, work, "--config", self._config(work, "o1", f"{{kind: disk, path: "
                                 f"'{self.disk}', capacity_bytes: 256MiB}}"), "--admin-key-file", str(key),
                                 "--no-events").start()
        with open(work / "rank.log", "ab") as log:
            self.rank = subprocess.Popen([sys.executable, __file__, "rank", ADMIN], stdout=subprocess.PIPE,
                                         stderr=log, cwd=ROOT, text=True)
        self.rank_url = f"http://127.0.0.1:{self.rank.stdout.readline().strip()}"
        self.t1.wait_healthy()
        self.o1.wait_healthy()

    @staticmethod
    def _config(work: Path, name: str, tier: str) -> str:
        path = work / f"{name}.yaml"
        path.write_text(f"chunk_size: {CHUNK}\ntiers:\n  - {tier}\n")
        return str(path)

    def server_pids(self) -> set[int]:
        """Processes standing in for servers that are not probed (not niced either)."""
        return {self.redis.proc.pid} if self.redis.proc is not None else set()

    def watched(self) -> dict[str, callable]:
        return {"t1": lambda: self.t1.proc.pid, "o1": lambda: self.o1.proc.pid, "rank": lambda: self.rank.pid}

    def probe_urls(self) -> dict[str, str]:
        return {"t1": self.t1.url + "/health", "o1": self.o1.url + "/health", "rank": self.rank_url + "/metrics"}

    def close(self) -> None:
        import signal

        for replica in (self.t1, self.o1):
            replica.stop(signal.SIGKILL)  # T-1's server, broken, does not end on SIGTERM
        self.rank.kill()
        self.rank.wait(timeout=10)
        self.redis.stop()


def serve_rank(admin_key: str) -> None:
    """The connector's rank server over a real KVCache (no engine), until killed; prints its port first."""
    import torch

    from kvtier import CacheConfig, KVCache, KVSpec
    from kvtier.integrations.vllm.admin import AdminServer, token_prompt

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    config = CacheConfig.from_dict({"chunk_size": CHUNK, "tiers": [
        {"kind": "memory", "capacity_bytes": "4MiB", "prefault": False}]})
    with KVCache(spec, model="tiny@main", config=config) as cache:
        server = AdminServer(cache, 0, "127.0.0.1", name="tiny@main", prompt=token_prompt(1000, 512),
                             admin_key=admin_key)
        print(server.port, flush=True)
        threading.Event().wait()


# -- A-4's hostile servers -----------------------------------------------------------------------------------
MODES = ("ok", "huge", "endless", "drip", "error", "deep", "html")
OK_ANSWER = json.dumps({"model": "tiny@main", "tiers": [], "tenants": {}}).encode()


def _head(status: str, content_type: str, length: int | None = None) -> bytes:
    sized = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{sized}Connection: close\r\n\r\n".encode()


async def _answer(mode: str, huge: int, writer: asyncio.StreamWriter) -> None:
    piece = b"x" * (1 << 20)
    if mode in ("ok", "error", "deep", "html"):
        status, kind, body = {
            "ok": ("200 OK", "application/json", OK_ANSWER),
            "error": ("502 Bad Gateway", "application/json", b'{"error": "upstream exploded"}'),
            "deep": ("200 OK", "application/json", b"[" * 100_000 + b"]" * 100_000),
            "html": ("200 OK", "text/html", b"<html><body><h1>Welcome to nginx!</h1></body></html>")}[mode]
        writer.write(_head(status, kind, len(body)) + body)
        return
    writer.write(_head("200 OK", "application/json") + b'{"tiers": "')
    sent = 0
    while mode == "endless" or (mode == "huge" and sent < huge) or mode == "drip":
        writer.write(piece if mode != "drip" else b"x")
        sent += len(piece)
        await (writer.drain() if mode != "drip" else asyncio.sleep(0.5))
        if mode == "drip":
            await writer.drain()


def serve_cli_hostile(huge: int) -> None:
    """One listener per mode (module docstring); prints ``{mode: port}``, serves until killed."""

    async def main() -> None:
        ports = {}
        for mode in MODES:
            async def handle(reader, writer, mode=mode):
                try:
                    await reader.readuntil(b"\r\n\r\n")
                    await _answer(mode, huge, writer)
                    await writer.drain()
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    pass
                finally:
                    writer.close()

            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            ports[mode] = server.sockets[0].getsockname()[1]
        print(json.dumps(ports), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def get(url: str, timeout: float = 10, **kwargs) -> httpx.Response | str:
    try:
        return httpx.get(url, timeout=timeout, **kwargs)
    except httpx.TimeoutException:
        return "none"
    except httpx.HTTPError:
        return "error"


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        serve_rank(sys.argv[2])
    elif sys.argv[1] == "cli-hostile":
        serve_cli_hostile(int(sys.argv[2]))
