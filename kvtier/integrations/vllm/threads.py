"""The connector's threads under their own names in the OS, so that ``top -H``, ``ps -L`` and
``/proc/PID/task/TID/comm`` tell kvtier's CPU time from vLLM's (benchmarks/vllm_serve.py reads them).

On Linux a thread starts with the name of the thread that created it: the retrieve pipeline's workers and the
tiers' readers and writers that the loading or saving thread starts carry its name too.
"""

from __future__ import annotations

import threading


def name_os_thread(name: str) -> None:
    """Name the calling thread ``name`` (cut to the OS's 15 bytes) where the OS keeps thread names (Linux);
    elsewhere, or if the OS refuses, nothing happens."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass
