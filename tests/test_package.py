"""``import kvtier`` and ``kvtier --help`` load no torch: the public names load on first use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return set(out.split())


def test_importing_kvtier_and_its_help_load_no_torch():
    assert "torch" not in _modules_after("import kvtier")
    show_help = ("import contextlib, io, kvtier.cli\n"
                 "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
                 "    kvtier.cli.main(['--help'])")
    assert "torch" not in _modules_after(show_help)


def test_a_public_name_loads_its_module_on_first_use():
    loaded = _modules_after("from kvtier import KVCache")
    assert "kvtier.core.cache" in loaded and "torch" in loaded
