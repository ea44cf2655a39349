"""The connector's threads: named in the OS, and kept off the cores of vLLM's forward pass on its CPU build.

* Names: ``top -H``, ``ps -L`` and ``/proc/PID/task/TID/comm`` tell kvtier's CPU time from vLLM's
  (benchmarks/vllm_serve.py reads them). On Linux a thread starts with the name of the thread that created it,
  so the retrieve pipeline's workers and the tiers' readers and writers that a kvtier thread starts carry its
  name too.
* Cores: vLLM's CPU build binds each worker's OpenMP threads, its main thread included, to the cores it gives
  the forward pass, and keeps other cores free for its scheduler and for a KV connector (its own NIXL
  connector moves its transfers there). A thread inherits the binding of the thread that starts it, so
  kvtier's loads, saves and lookups ran on the forward pass's cores while the kept core idled; a niced load
  there waited for each forward step to end. kvtier's threads now move to the other cores, as NIXL's do.
  Only with one worker on the host: with several (tensor parallelism on a CPU host), "the other cores" would be
  another rank's forward pass, which a worker cannot see, so kvtier's threads stay where vLLM put them
  (:func:`set_workers_on_host`).
"""

from __future__ import annotations

import os
import re
import threading

_workers_on_host = 1


def set_workers_on_host(count: int) -> None:
    """Tell this process how many of vLLM's workers share its host (the connector's worker side does, at start):
    above one, :func:`leave_forward_pass_cores` moves no thread."""
    global _workers_on_host
    _workers_on_host = count


def name_os_thread(name: str) -> None:
    """Name the calling thread ``name`` (cut to the OS's 15 bytes) where the OS keeps thread names (Linux), and
    move it off the forward pass's cores (:func:`leave_forward_pass_cores`); elsewhere, or if the OS refuses,
    nothing happens."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass
    leave_forward_pass_cores()


def forward_pass_cpus(env: dict[str, str] | None = None) -> set[int]:
    """The CPUs vLLM's CPU build gave this worker's OpenMP threads, as it writes them in the environment
    (``env``, else the process's): ``OMP_PLACES={0,1,2}`` or ``GOMP_CPU_AFFINITY=0 1 2``; empty for other forms
    or none (GPU builds)."""
    env = os.environ if env is None else env
    places = re.fullmatch(r"\{(\d+(?:,\d+)*)\}", env.get("OMP_PLACES", ""))
    if places:
        return {int(cpu) for cpu in places.group(1).split(",")}
    gomp = env.get("GOMP_CPU_AFFINITY", "")
    return {int(cpu) for cpu in gomp.split()} if re.fullmatch(r"\d+( \d+)*", gomp) else set()


def leave_forward_pass_cores(env: dict[str, str] | None = None) -> set[int] | None:
    """If vLLM bound the calling thread (it inherited a binding to fewer CPUs than the machine has), let it run
    on every CPU but those and the forward pass's (:func:`forward_pass_cpus`), within what the process may use
    (the kernel drops CPUs outside its cpuset); threads it starts inherit that. Returns the CPUs asked for, or
    None where nothing changed: the thread is not bound, no other CPU is left, the OS cannot bind threads, or
    other workers share the host (:func:`set_workers_on_host`)."""
    if not hasattr(os, "sched_setaffinity") or _workers_on_host > 1:
        return None
    everything = set(range(os.cpu_count() or 1))
    bound = os.sched_getaffinity(0)
    if bound >= everything:
        return None
    others = everything - bound - forward_pass_cpus(env)
    if not others:
        return None
    try:
        os.sched_setaffinity(0, others)
    except OSError:  # none of ``others`` in this process's cpuset: stay where vLLM put the thread
        return None
    return others
