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
# Not --quiet: it drops the warnings before strict mode counts them, so a broken link would pass.
site_dir="$(mktemp -d)"
if ! NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --site-dir "$site_dir" >"$site_dir.log" 2>&1; then
    grep -E "WARNING|ERROR|Aborted" "$site_dir.log" >&2; rm -rf "$site_dir" "$site_dir.log"; exit 1
fi
rm -rf "$site_dir" "$site_dir.log"
exec "$PY" -m pytest -q "$@"
