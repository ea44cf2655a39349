"""A real ``mooncake_master`` (Mooncake Store's metadata and placement service) for tests and benchmarks.

It runs on loopback with free ports: the master RPC port, its embedded HTTP metadata server (the transfer
engine's metadata, instead of etcd; in 0.3.13 it listens on every interface whatever its host flag says) and
its admin/metrics port (``/health``, Prometheus ``/metrics``). Ready means ``/health`` says ``service_ready``
and the metadata server answers. A port taken between choosing it and binding it (other jobs on the machine
start servers too) makes the master exit: it is started again on fresh ports. ``kill`` / ``restart`` keep the
ports, so clients configured with them reconnect by themselves.

``scripts/setup.sh test`` installs the engine (``mooncake-transfer-engine-non-cuda``, which puts
``mooncake_master`` beside the Python executable) and Debian's ``libibverbs1``; ``MOONCAKE_MASTER`` points
elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvtier.net.ports import free_port
from harness.process import ServerProcess


def master_binary() -> str:
    found = os.environ.get("MOONCAKE_MASTER") or shutil.which("mooncake_master")
    return found or str(Path(sys.executable).with_name("mooncake_master"))


def missing_mooncake() -> list[str]:
    """What this machine lacks to run Mooncake Store (empty when everything is there)."""
    missing = []
    if not os.access(master_binary(), os.X_OK):
        missing.append("mooncake_master (pip install 'kvtier[mooncake]', or scripts/setup.sh test)")
    if importlib.util.find_spec("mooncake") is None:
        missing.append("the mooncake package (pip install 'kvtier[mooncake]')")
        return missing
    # mooncake.store links libibverbs even for TCP; import it apart, so a failure cannot take pytest down
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        missing.append(f"an importable mooncake.store (libibverbs1?): {probe.stderr.decode()[-300:]}")
    return missing


def _get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


class MooncakeMaster(ServerProcess):
    """One ``mooncake_master`` with its HTTP metadata server. ``args`` are extra master flags, e.g.
    ``("--client_ttl=2",)``: seconds after a client's last heartbeat before its segment leaves the pool.
    ``kill`` crashes it: every value's metadata goes with it."""

    def __init__(self, *, args: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvmc"))
        self.args = args
        self.rpc_port = self.http_port = self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 60.0, attempts: int = 4) -> MooncakeMaster:
        for attempt in range(attempts):
            self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
            if len({self.rpc_port, self.http_port, self.metrics_port}) < 3:
                continue
            try:
                return self._launch(timeout)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        raise RuntimeError("no free ports for mooncake_master")

    def restart(self, timeout: float = 60.0) -> MooncakeMaster:
        """Start again on the same ports (after ``kill``): the metadata of the old master is gone."""
        self.kill()
        end = time.monotonic() + timeout
        while True:  # the old listening sockets may take a moment to be released
            try:
                return self._launch(max(1.0, end - time.monotonic()))
            except RuntimeError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)

    def _launch(self, timeout: float) -> MooncakeMaster:
        self.starts += 1
        log = open(self.dir / f"master-{self.starts}.log", "wb")  # noqa: SIM115 (owned by the process)
        cmd = [
            master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}", f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1", "--logtostderr", *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.dir)
        log.close()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"mooncake_master exited: {self.log_tail()}")
            if self._ready():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mooncake_master did not come up in {timeout:.0f}s: {self.log_tail()}")

    def _ready(self) -> bool:
        try:
            status, body = _get(f"http://127.0.0.1:{self.metrics_port}/health")
            if status != 200 or not json.loads(body).get("service_ready"):
                return False
            status, _ = _get(f"{self.metadata_url}?key=kvtier-probe")
            return status in (200, 404)  # 404: up, and nothing stored under the probe key
        except (OSError, ValueError):
            return False

    def metrics(self) -> dict[str, float]:
        """The master's unlabelled Prometheus gauges and counters (``master_key_count``, ...)."""
        _, body = _get(self.metrics_url, timeout=5.0)
        out = {}
        for line in body.decode().splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                out[name] = float(value)
        return out

    def keys(self) -> list[str]:
        """Every key the master holds (its admin endpoint), sorted."""
        _, body = _get(self.metrics_url.rsplit("/", 1)[0] + "/get_all_keys", timeout=5.0)
        return sorted(body.decode().split())

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self) -> str:
        try:
            return (self.dir / f"master-{self.starts}.log").read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"


_SEGMENT_HOST = """
import sys
from mooncake.store import MooncakeDistributedStore
metadata, master, segment = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", master)
print(f"ready {store.get_hostname()}" if rc == 0 else f"setup failed: {rc}", flush=True)
sys.stdin.read()  # until the parent closes our stdin
store.close()
"""


class SegmentHost:
    """A process that only contributes ``segment_bytes`` of its RAM to the pool (a Mooncake client that never
    puts or gets): the remote memory benchmarks and tests move values to and from. ``segment``: its segment's
    name in the pool (what a put's ``ReplicateConfig.preferred_segment`` names, and replica descriptors'
    ``transport_endpoint``)."""

    def __init__(self, master: MooncakeMaster, segment_bytes: int) -> None:
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SEGMENT_HOST, master.metadata_url, master.master_address, str(segment_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        assert self.proc.stdout is not None
        word, _, self.segment = self.proc.stdout.readline().strip().partition(" ")
        if word != "ready":
            self.stop()
            raise RuntimeError(f"segment host did not join the pool: {word} {self.segment}".strip() or "exited")

    def pause(self) -> None:
        """Freeze it (SIGSTOP): the master still lists its values, and a transfer from it never completes."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Leave the pool cleanly (its segment, and what it holds, are unmounted at once)."""
        if self.proc.poll() is None:
            self.resume()  # a frozen host cannot read the closed stdin that tells it to leave
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> SegmentHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
