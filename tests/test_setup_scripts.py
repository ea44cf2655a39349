"""The set-up scripts' choice of Python: the active virtual environment, else ./.venv, never the system's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def chosen_python(repo: Path, **env: str) -> str:
    """What ``scripts/python-env.sh`` sets PY to when sourced in ``repo`` with only ``env`` (and a bare PATH)."""
    (repo / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "python-env.sh", repo / "scripts")
    run_env = {"PATH": SYSTEM_PATH, "HOME": os.environ.get("HOME", "/root"), **env}
    done = subprocess.run(["bash", "-c", 'set -euo pipefail; source scripts/python-env.sh; echo "$PY"; '
                           'command -v python'], cwd=repo, env=run_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    py, on_path = done.stdout.split()
    assert Path(on_path).parent == Path(py).parent  # its environment's bin/ comes first on the PATH
    return py


def in_a_venv(python: str) -> bool:
    out = subprocess.run([python, "-c", "import sys; print(sys.prefix != sys.base_prefix)"], capture_output=True,
                         text=True, timeout=60)
    return out.stdout.strip() == "True"


@pytest.fixture(scope="module")
def fresh_repo(tmp_path_factory) -> tuple[Path, str]:
    if not (shutil.which("python3", path=SYSTEM_PATH) and not in_a_venv(shutil.which("python3", path=SYSTEM_PATH))):
        pytest.skip("no system python3 outside a virtual environment on this machine")
    repo = tmp_path_factory.mktemp("clone")
    return repo, chosen_python(repo)


def test_without_an_active_environment_a_dot_venv_is_created_and_used(fresh_repo):
    repo, py = fresh_repo
    assert py == str(repo / ".venv" / "bin" / "python")
    assert in_a_venv(py)
    assert subprocess.run([py, "-m", "pip", "--version"], capture_output=True, timeout=120).returncode == 0
    assert chosen_python(repo) == py  # a second run reuses it


def test_an_active_environment_is_used_as_it_is(fresh_repo, tmp_path):
    venv = fresh_repo[0] / ".venv"
    assert chosen_python(tmp_path, VIRTUAL_ENV=str(venv)) == str(venv / "bin" / "python")
    # a venv's python3 first on the PATH counts as active too (no activate script was sourced)
    assert chosen_python(tmp_path, PATH=f"{venv / 'bin'}:{SYSTEM_PATH}") == str(venv / "bin" / "python3")
    assert not (tmp_path / ".venv").exists()


def test_an_explicit_python_wins(tmp_path):
    assert chosen_python(tmp_path, PYTHON=sys.executable) == sys.executable
    assert not (tmp_path / ".venv").exists()
