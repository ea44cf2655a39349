#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run, on a machine with PyTorch (CUDA) and nothing to install from.
#   bash scripts/gpu-checks.sh prepare   here (with network): wheels kvtier needs beyond such an image (.whl/),
#                                        a trimmed Mooncake CUDA build (.gpu/) and Debian's libibverbs1 (.deb/)
#   bash scripts/gpu-checks.sh run       there: the CUDA tests, benchmarks/cuda_transfer.py, then the suite's
#                                        service-free part (SUITE_PATHS: which of it); logs, JUnit XML and
#                                        the plot go to $OUT (results/gpu by default); BENCH=0 skips
#                                        the benchmark
# Ends with the exit status of the CUDA tests.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-run}

if [ "$what" = prepare ]; then
  set -e
  repo=$PWD
  mkdir -p .whl .deb .gpu
  pip_get() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$@"
  }
  pip_get .whl zstandard lz4 blosc2 ndindex numexpr platformdirs
  # Mooncake's CUDA build without what the store does not load (its process-group and expert-parallel
  # libraries, the benchmark and client binaries): 98 MB as a wheel, 31 MB trimmed
  tmp=$(mktemp -d)
  pip_get "$tmp" mooncake-transfer-engine==0.3.13.post1 "nvidia-cuda-runtime-cu12==12.8.*"
  (cd "$tmp" && mkdir mc && cd mc && unzip -q ../mooncake_transfer_engine-*.whl \
    && rm -f mooncake/libmooncake_pg*.so mooncake/transfer_engine_bench mooncake/libmooncake_ep_device.so \
       mooncake/_ep*.so mooncake/mooncake_client mooncake/pg_*.so mooncake/nvlink_allocator.so \
    && tar czf "$repo/.gpu/mooncake-cuda.tgz" .)
  cp "$tmp"/nvidia_cuda_runtime_cu12-*.whl .gpu/
  rm -rf "$tmp"
  (cd .deb && apt-get download libibverbs1)
  exit 0
fi

OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# a .pth file rather than PYTHONPATH alone: tests that start Python processes set PYTHONPATH themselves
echo /tmp/site > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvtier-gpu-checks.pth"
export PYTHONPATH=/tmp/site:$PWD
if [ -f .gpu/mooncake-cuda.tgz ]; then
  mkdir -p /tmp/mc /tmp/cu12 /tmp/ib
  tar xzf .gpu/mooncake-cuda.tgz -C /tmp/mc
  python3 -m zipfile -e .gpu/nvidia_cuda_runtime_cu12-*.whl /tmp/cu12
  for deb in .deb/*.deb; do dpkg -x "$deb" /tmp/ib; done
  echo /tmp/mc >> "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvtier-gpu-checks.pth"
  export PYTHONPATH=$PYTHONPATH:/tmp/mc MOONCAKE_MASTER=/tmp/mc/mooncake/mooncake_master
  export LD_LIBRARY_PATH=/tmp/ib/usr/lib/x86_64-linux-gnu:/tmp/cu12/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
before = dict(torch.cuda.host_memory_stats())
t = torch.empty((48 << 20) + (6 << 20), dtype=torch.uint8, pin_memory=True)
after = torch.cuda.host_memory_stats()
print("torch pinned allocation of 54 MiB:", {k: after[k] - before.get(k, 0) for k in after
                                               if "bytes" in k and after[k] != before.get(k, 0)})
try:
    import mooncake.store  # noqa: F401
    print("mooncake.store imports")
except Exception as exc:
    print("mooncake.store does not import:", exc)
EOF
} 2>&1 | tee "$OUT/machine.txt"

echo "== CUDA tests"
python3 -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/cuda-tests.xml" \
  tests/native/test_gpu.py tests/integrations/test_paged_layouts.py tests/tiers/test_memory_gpu.py \
  tests/tiers/mooncake/test_gpu.py tests/integrations/test_transformers.py tests/tiers/test_memory.py \
  tests/core/test_cache.py tests/core/test_pipeline.py 2>&1 | tee "$OUT/cuda-tests.log" | tail -40
status=${PIPESTATUS[0]}

if [ "${BENCH:-1}" = 1 ]; then
  echo "== benchmarks/cuda_transfer.py"
  timeout 300 python3 benchmarks/cuda_transfer.py --plot "$OUT/cuda_transfer.png" 2>&1 | tee "$OUT/bench.log" \
    | grep -v "it/s\]" | tail -40
fi

echo "== the suite's service-free part"
timeout "${SUITE_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$OUT/suite.xml" --tb=short ${SUITE_PATHS:-tests} \
  --ignore=tests/apps \
  --ignore=tests/integrations/test_vllm.py --ignore=tests/integrations/test_vllm_events.py \
  --ignore=tests/integrations/test_vllm_hybrid.py --ignore=tests/integrations/test_vllm_mooncake.py \
  -k "not redis and not valkey" > "$OUT/suite.log" 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR|E  )" "$OUT/suite.log" | head -60; tail -3 "$OUT/suite.log"
exit "$status"
