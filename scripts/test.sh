#!/usr/bin/env bash
# Set up everything the tests need, then run the whole suite. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
source scripts/python-env.sh
# The layers hold (pyproject.toml [tool.importlinter]): a new import across them fails here, before the tests.
"$(dirname "$PY")/lint-imports" --no-cache
exec "$PY" -m pytest -q "$@"
