#!/usr/bin/env bash
# Set up everything the tests need, then run the whole suite. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
source scripts/python-env.sh
# The layers hold (pyproject.toml [tool.importlinter]): a new import across them fails here, before the tests.
"$(dirname "$PY")/lint-imports" --no-cache
# The docs site builds in strict mode: a broken link, a missing page or a config class the reference generator
# cannot find fails here (mkdocs.yml; docs/hooks/reference.py).
site_dir="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet --site-dir "$site_dir" || { rm -rf "$site_dir"; exit 1; }
rm -rf "$site_dir"
exec "$PY" -m pytest -q "$@"
