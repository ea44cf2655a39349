"""The connector's threads carry their names in the OS and keep off the cores vLLM's CPU build gave the forward
pass (kvtier.integrations.vllm.threads), and the threads they start inherit both."""

from __future__ import annotations

import os
import threading

import pytest

from kvtier.integrations.vllm.threads import forward_pass_cpus, name_os_thread, set_workers_on_host

linux_smp = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs Linux and at least 2 CPUs to bind threads")


def test_forward_pass_cpus_read_vllms_forms_only() -> None:
    assert forward_pass_cpus({"OMP_PLACES": "{0,1,2}"}) == {0, 1, 2}
    assert forward_pass_cpus({"GOMP_CPU_AFFINITY": "3 5"}) == {3, 5}
    assert forward_pass_cpus({}) == set()
    assert forward_pass_cpus({"OMP_PLACES": "{0:4}"}) == set()  # other OpenMP forms: nothing is assumed


def _in_thread(fn):
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(fn()))
    thread.start()
    thread.join(timeout=30)
    return out


@linux_smp
@pytest.mark.parametrize("env", [{}, {"OMP_PLACES": "{%d}"}], ids=["inherited binding", "and OMP_PLACES"])
def test_a_named_thread_leaves_the_forward_pass_core_and_its_children_follow(monkeypatch, env) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    forward = cpus[0]
    monkeypatch.delenv("OMP_PLACES", raising=False)
    monkeypatch.delenv("GOMP_CPU_AFFINITY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value % forward)

    def run() -> dict:
        os.sched_setaffinity(0, {forward})  # as vLLM binds the worker: every thread it starts inherits this
        name_os_thread("kvtier-test")
        child: dict = {}
        t = threading.Thread(target=lambda: child.update(cpus=os.sched_getaffinity(0), comm=_comm()))
        t.start()
        t.join(timeout=30)
        return {"cpus": os.sched_getaffinity(0), "comm": _comm(), "child": child}

    got = _in_thread(run)
    assert got["cpus"] == set(cpus) - {forward}
    assert got["comm"] == "kvtier-test"
    assert got["child"] == {"cpus": set(cpus) - {forward}, "comm": "kvtier-test"}


@linux_smp
def test_without_vllms_binding_a_thread_stays_where_it_was() -> None:
    before = os.sched_getaffinity(0)
    got = _in_thread(lambda: (name_os_thread("kvtier-test"), {"cpus": os.sched_getaffinity(0)})[1])
    assert got["cpus"] == before


@linux_smp
def test_with_other_workers_on_the_host_a_bound_thread_stays_where_vllm_put_it() -> None:
    forward = sorted(os.sched_getaffinity(0))[0]

    def run() -> dict:
        os.sched_setaffinity(0, {forward})
        name_os_thread("kvtier-test")
        return {"cpus": os.sched_getaffinity(0)}

    set_workers_on_host(2)  # tensor parallelism on one CPU host: the other cores may be another rank's
    try:
        assert _in_thread(run)["cpus"] == {forward}
    finally:
        set_workers_on_host(1)
    assert _in_thread(run)["cpus"] == os.sched_getaffinity(0) - {forward}


def _comm() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()
