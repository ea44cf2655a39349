#!/usr/bin/env bash
# A virtual environment of its own for LMCache, the peer benchmarks/alternatives.py measures kvtier against.
#   bash scripts/lmcache-venv.sh [DIR]     (default DIR: .venv-lmcache in the repository)
# then: python benchmarks/alternatives.py --lmcache-python DIR/bin/python   (or KVTIER_LMCACHE_PYTHON=DIR/bin/python)
#
# Why not kvtier's own environment: `pip install --dry-run lmcache==0.5.6` there would change installed
# versions (numpy 2.3 -> 2.2, protobuf 7 -> 6, grpcio, prometheus_client, transformers, fastapi). Here torch is
# pinned by a constraints file to the CPU build kvtier uses (2.13.0), so LMCache's wheel runs against the same
# torch and both sides build the same KV from the same seed. LMCache's wheel also pulls CUDA Python packages
# (cupy, cuda-python); they install on a CPU machine and stay unused. About 2 GB, 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.venv-lmcache}
base=$(command -v python3)
if [ ! -x "$dir/bin/python" ]; then
  "$base" -m venv "$dir"
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" >"$constraints"
"$dir/bin/python" -m pip install -q -c "$constraints" torch==2.13.0 lmcache==0.5.6
"$dir/bin/python" -c "import lmcache.v1.cache_engine, torch; print('LMCache ready in $dir, torch', torch.__version__)"
