"""The connector's threads: named in the OS, and kept off the cores of vLLM's forward pass on its CPU build.

* Names: ``top -H``, ``ps -L`` and ``/proc/PID/task/TID/comm`` tell kvtier's CPU time from vLLM's
  (benchmarks/vllm_serve.py reads them). On Linux a thread starts with the name of the thread that created it,
  so the retrieve pipeline's workers and the tiers' readers and writers that a kvtier thread starts carry its
  name too.
* Cores: vLLM's CPU build binds each worker process to the cores of its OpenMP threads (``OMP_PLACES``), and a
  thread inherits the binding of the thread that starts it, so kvtier's loads, saves and lookups ran on the very
  cores the forward pass computes on, while the cores vLLM keeps free for its scheduler and for a KV connector
  stayed idle. Measured on 2 cores (docs/benchmarks/vllm-serve.md), that cost about 4% of request throughput on
  prompts that never hit.
"""

from __future__ import annotations

import os
import re
import threading


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


def forward_pass_cpus(places: str | None = None) -> set[int]:
    """The CPUs vLLM's CPU build gave this worker's OpenMP threads: its ``OMP_PLACES`` (``places``, else the
    environment's), in the form vLLM writes, ``{0,1,2}``; empty for any other value or none (GPU builds)."""
    match = re.fullmatch(r"\{(\d+(?:,\d+)*)\}", (os.environ.get("OMP_PLACES", "") if places is None else places))
    return {int(cpu) for cpu in match.group(1).split(",")} if match else set()


def leave_forward_pass_cores(places: str | None = None) -> set[int] | None:
    """Let the calling thread run on every CPU but the forward pass's (:func:`forward_pass_cpus`), within what
    the process may use (the kernel drops CPUs outside its cpuset); threads it starts inherit that. Returns the
    CPUs asked for, or None where nothing changed: vLLM bound no forward pass, no other CPU exists, or the OS
    (not Linux) cannot bind threads."""
    omp = forward_pass_cpus(places)
    others = set(range(os.cpu_count() or 1)) - omp
    if not omp or not others or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        os.sched_setaffinity(0, others)
    except OSError:  # no CPU of ``others`` in this process's cpuset: stay where vLLM put the thread
        return None
    return others
