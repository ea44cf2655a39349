#!/usr/bin/env bash
# A virtual environment of its own for the Rust routers benchmarks/router_scale.py measures kvtier route against:
# vllm-router (the vLLM project's) and sglang-router (SGLang's), both PyPI wheels with a compiled binary.
#   bash scripts/router-peers-venv.sh [DIR]     (default DIR: /work/venvs/routers, else .venv-routers)
# then: python benchmarks/router_scale.py --peers DIR
#
# Why not kvtier's own environment: the routers' wheels bring their own pins (pydantic, fastapi, sglang's
# protobuf/grpc) that must not move kvtier's. The binaries are what the benchmark runs (DIR/bin/vllm-router,
# and sglang-router's `python -m sglang_router.launch_router`). A few hundred MB, a minute or two.
set -euo pipefail
cd "$(dirname "$0")/.."
default=.venv-routers
[ -d /work/venvs ] && default=/work/venvs/routers
dir=${1:-$default}
if [ ! -x "$dir/bin/python" ]; then
  python3 -m venv "$dir"
fi
"$dir/bin/python" -m pip install -q vllm-router==0.1.17 sglang-router==0.3.2
"$dir/bin/python" -m pip show vllm-router sglang-router | grep -E '^(Name|Version)'
