#!/usr/bin/env bash
# Set up kvtier with the demo extras, then run the main job on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec "${PYTHON:-python3}" -m kvtier demo "$@"
