"""benchmarks/alternatives.py without LMCache's interpreter: one line saying how to set it up, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_lmcache_interpreter_is_one_line_naming_the_setup_script(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "alternatives.py"), "--rounds", "1",
                           "--dir", str(tmp_path), "--lmcache-python", str(tmp_path / "nope" / "python")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "scripts/lmcache-venv.sh" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # the temporary folder it made is gone again
