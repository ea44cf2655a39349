# Sourced by setup.sh, test.sh and demo.sh: sets PY, the Python that kvtier is installed into and run with.
#   $PYTHON if set (an explicit choice); else the active virtual environment (VIRTUAL_ENV, or a python3 on
#   the PATH that runs inside one); else ./.venv in the repository, created on first use. So nothing is ever
#   installed into the system's Python, not even as root on a fresh machine.
# Expects to run from the repository root.

_kvtier_venv_python() {
  local base
  base=$(command -v python3 || true)
  if [ -z "$base" ]; then
    echo "kvtier: python3 (3.11 or newer) is needed" >&2
    return 1
  fi
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    echo "$VIRTUAL_ENV/bin/python"
    return
  fi
  if "$base" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    echo "$base"  # a virtual environment's python3 is first on the PATH: use that environment
    return
  fi
  if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "kvtier: Python 3.11 or newer is needed; $base is $("$base" --version 2>&1)" >&2
    return 1
  fi
  if [ ! -x .venv/bin/python ]; then
    echo "kvtier: creating the virtual environment .venv (activate it with: source .venv/bin/activate)" >&2
    if ! "$base" -m venv .venv >/dev/null 2>&1; then
      rm -rf .venv  # Debian splits venv's pip bootstrap into python3-venv
      _kvtier_apt_install python3-venv >&2 && "$base" -m venv .venv >&2 || return 1
    fi
  fi
  echo "$PWD/.venv/bin/python"
}

# apt-get install as root, else through sudo; quiet, and skipped by callers when the command exists.
_kvtier_apt_install() {
  local apt=(apt-get)
  [ "$(id -u)" = 0 ] || apt=(sudo apt-get)
  "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq "$@" >/dev/null
}

PY=${PYTHON:-$(_kvtier_venv_python)} || exit 1
export PY
case $PY in  # the environment's console scripts (kvtier, pytest) on the PATH, as activation would do
  /*) PATH="$(dirname "$PY"):$PATH"; export PATH ;;
esac
