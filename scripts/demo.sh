#!/usr/bin/env bash
# Set up kvtier with the demo extras, then run the main job on embedded defaults: start `kvtier serve`
# (SmolLM2-135M-Instruct) with kvtier and without it, drive a short multi-round chat through both with
# `kvtier bench`, print the TTFT table, stop the servers. Results land in results/serve-bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
source scripts/python-env.sh
exec "$PY" -m kvtier bench multiround --serve --interleave --users 2 --rounds 3 \
  --system-words 1500 --turn-words 60 --max-tokens 12 --serve-args "--chunk-size 64" --out results/serve-bench "$@"
