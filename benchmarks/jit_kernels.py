"""Native kernels: the numba kernels against the LLVM IR kernels they replaced, in one run; first-call compile times.

The IR kernels are loaded from git (``--baseline``, default the commit before the rewrite): their modules
``kvtier/native/kernels.py``, ``kvtier/codecs/_planes.py`` and ``kvtier/codecs/_dequant.py`` as they were there,
beside today's. Each case runs both on the same data, interleaved, ``--reps`` times; the ratio is the IR's
best (and median) time over numba's (above 1: numba faster). Cases, on KV shaped like SmolLM2-135M's (30 layers, 3 KV
heads of 64) decoded into a 256-token range of a 300-token tensor (strided runs, as a load writes them):
byte-plane join and split (bf16, fp32), int8 dequantisation (bf16, fp16, fp32). The streaming copy stays IR;
it is compared with the plain numba copy loop that would replace it (LLVM turns it into memcpy) on 256 MiB in
512 KiB runs, one thread. Compile times: a fresh process with an empty ``NUMBA_CACHE_DIR`` times the import
of numba with the build of the IR kernels, then each numba kernel's first call (cold: compiled); a second
process with that directory does the same (warm: loaded from the cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import result  # noqa: E402

from kvtier.codecs import _dequant, _planes  # noqa: E402
from kvtier.native import bulkcopy, kernels  # noqa: E402
from kvtier.native.jit import kernel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BITS = {2: torch.int16, 4: torch.int32}


def _baseline(rev: str) -> dict[str, types.ModuleType]:
    """The IR modules as they were at ``rev``, loaded beside today's (their ``kernels`` is rev's too)."""
    def load(path: str, name: str, **inject) -> types.ModuleType:
        source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                                text=True).stdout
        module = types.ModuleType(name)
        module.__dict__.update(inject)
        exec(compile(source.replace("from kvtier.native import kernels\n", ""), f"{rev}:{path}", "exec"),
             module.__dict__)
        return module
    old_kernels = load("kvtier/native/kernels.py", "ir_kernels")
    return {"planes": load("kvtier/codecs/_planes.py", "ir_planes", kernels=old_kernels),
            "dequant": load("kvtier/codecs/_dequant.py", "ir_dequant", kernels=old_kernels)}


def _compare(cases: dict, reps: int) -> dict[str, tuple[float, float]]:
    """``{case: (IR best / numba best, IR median / numba median)}`` over ``reps`` interleaved runs of each
    case's ``(ir, numba, bytes)``. On a shared machine interference only adds time, so the best is the steadier
    figure; the medians say whether the best was luck."""
    ratios = {}
    for name, (ir, jitted, nbytes) in cases.items():
        ir(), jitted()  # compiled, pages touched
        t_ir, t_nb = [], []
        for rep in range(reps):
            pairs = ((ir, t_ir), (jitted, t_nb))
            for fn, times in pairs if rep % 2 else pairs[::-1]:  # each goes first half the time
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        ratios[name] = (min(t_ir) / min(t_nb), statistics.median(t_ir) / statistics.median(t_nb))
        print(f"{name:18s} best: IR {nbytes / min(t_ir) / 1e9:6.2f} GB/s, numba {nbytes / min(t_nb) / 1e9:6.2f} GB/s,"
              f" ratio {ratios[name][0]:.2f}; median ratio {ratios[name][1]:.2f}", flush=True)
    return ratios


def _codec_cases(ir: dict[str, types.ModuleType]) -> dict:
    cases = {}
    for dtype in (torch.bfloat16, torch.float32):
        big = torch.randint(-(2**15), 2**15, (30, 2, 300, 3, 64)).to(BITS[dtype.itemsize]).view(dtype)
        view, k = big[:, :, 20:276], dtype.itemsize
        planes = np.empty((k, view.numel()), np.uint8)
        _planes.split(view, planes)
        dests = [torch.zeros_like(big), torch.zeros_like(big)]
        ir["planes"].join(dests[0][:, :, 20:276], list(planes))
        _planes.join(dests[1][:, :, 20:276], list(planes))
        assert torch.equal(dests[0].view(BITS[k]), dests[1].view(BITS[k]))
        assert torch.equal(dests[1][:, :, 20:276].view(BITS[k]), view.view(BITS[k]))
        out = np.empty_like(planes)
        ir["planes"].split(view, out)
        assert (out == planes).all()
        name, nbytes = str(dtype).removeprefix("torch."), view.numel() * k
        cases[f"join {name}"] = (lambda d=dests[0], p=planes: ir["planes"].join(d[:, :, 20:276], list(p)),
                                 lambda d=dests[1], p=planes: _planes.join(d[:, :, 20:276], list(p)), nbytes)
        cases[f"split {name}"] = (lambda v=view, p=planes: ir["planes"].split(v, p),
                                  lambda v=view, p=planes: _planes.split(v, p), nbytes)
    g = 64
    n = 30 * 2 * 256 * 3 * 64
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8)
    scale, zero = torch.rand(n // g) * 0.01, torch.rand(n // g) * 255
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        outs = [torch.zeros(30, 2, 300, 3, 64, dtype=dtype) for _ in range(2)]
        assert ir["dequant"].dequantise_int8(outs[0][:, :, 20:276], codes, scale, zero, g)
        assert _dequant.dequantise_int8(outs[1][:, :, 20:276], codes, scale, zero, g)
        assert torch.equal(outs[0].view(BITS[dtype.itemsize]), outs[1].view(BITS[dtype.itemsize]))
        cases[f"int8 -> {str(dtype).removeprefix('torch.')}"] = (
            lambda o=outs[0]: ir["dequant"].dequantise_int8(o[:, :, 20:276], codes, scale, zero, g),
            lambda o=outs[1]: _dequant.dequantise_int8(o[:, :, 20:276], codes, scale, zero, g), n * dtype.itemsize)
    return cases


@kernel
def _copy_runs(dst, src, dst_starts, src_starts, run):
    """The numba copy the streaming kernel is measured against: each run a plain loop (LLVM: memcpy)."""
    for r in range(dst_starts.size):
        d, s = dst[dst_starts[r] : dst_starts[r] + run], src[src_starts[r] : src_starts[r] + run]
        for i in range(run):
            d[i] = s[i]


def _copy_case() -> dict:
    runs, run = 512, 512 << 10
    src = torch.randint(0, 256, (runs, run + 64), dtype=torch.uint8)[:, :run]  # 256 MiB in 512 KiB runs
    dest = torch.zeros(runs, run + 64, dtype=torch.uint8)[:, 7 : 7 + run]
    src_mem, src_at, _ = kernels.span(src, np.uint8)
    dst_mem, dst_at, _ = kernels.span(dest, np.uint8)

    def numba_copy() -> None:
        _copy_runs(dst_mem, src_mem, dst_at, src_at, run)
    numba_copy()
    assert torch.equal(dest, src)
    return {"copy (1 thread)": (lambda: bulkcopy.copy_pairs([(dest, src)], threads=1), numba_copy, runs * run)}


_COMPILE = """
import json, time, numpy as np, torch
from kvtier.codecs import _dequant, _planes
times = {}
start = time.perf_counter(); _dequant._kernels(); times["build IR, import numba"] = time.perf_counter() - start
for dtype in (torch.bfloat16, torch.float32):
    t = torch.zeros(2, 2, 40, 3, 64, dtype=dtype)[:, :, 3:37]
    planes = np.zeros((dtype.itemsize, t.numel()), np.uint8)
    start = time.perf_counter(); _planes.split(t, planes); times[f"split {dtype}"] = time.perf_counter() - start
    start = time.perf_counter(); _planes.join(t, list(planes)); times[f"join {dtype}"] = time.perf_counter() - start
codes = torch.zeros(2 * 2 * 34 * 3 * 64, dtype=torch.uint8); scale = torch.ones(codes.numel() // 64)
for dtype in (torch.bfloat16, torch.float32):
    t = torch.zeros(2, 2, 40, 3, 64, dtype=dtype)[:, :, 3:37]
    start = time.perf_counter(); _dequant.dequantise_int8(t, codes, scale, scale, 64)
    times[f"int8 -> {dtype}"] = time.perf_counter() - start
print(json.dumps(times))
"""


def _compile_times() -> dict[str, dict[str, float]]:
    """First-call seconds per numba kernel in a fresh process: cold (empty cache), then warm (cache loaded)."""
    found = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        for state in ("cold", "warm"):
            done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True,
                                  check=True, cwd=ROOT)
            found[state] = json.loads(done.stdout.strip().splitlines()[-1])
            print(state, {k: round(v, 2) for k, v in found[state].items()}, flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="a06dfbe", help="git revision whose IR kernels are compared")
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--quick", action="store_true", help="5 repetitions, no copy case, no compile times")
    args = parser.parse_args()
    reps = 5 if args.quick else args.reps
    torch.manual_seed(0)
    cases = _codec_cases(_baseline(args.baseline))
    if not args.quick:
        cases |= _copy_case()
    figures = {}
    for name, (best, median) in _compare(cases, reps).items():
        figures[f"{name} ratio"], figures[f"{name} median ratio"] = best, median
    if not args.quick:
        for state, times in _compile_times().items():
            figures[f"{state} compile s"] = sum(v for k, v in times.items() if not k.startswith("build"))
    figures["load average"] = os.getloadavg()[0]
    result(figures)


if __name__ == "__main__":
    main()
