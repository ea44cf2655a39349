"""The command line's own contract: one purpose per command, defaults in the help, one line for a missing extra."""

from __future__ import annotations

import os
import subprocess
import sys

from kvtier.cli import COMMANDS, main


def run_cli(prelude: str, argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    """``kvtier ARGV`` in a fresh interpreter after ``prelude`` (which may block modules), KVTIER_HOME empty."""
    code = f"import sys\n{prelude}\nfrom kvtier.cli import main\nsys.exit(main({argv!r}))"
    env = {**os.environ, "KVTIER_HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_the_top_level_help_gives_each_command_its_purpose(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name, (_, purpose) in COMMANDS.items():
        assert f"{name}" in out and purpose[:30] in " ".join(out.split())


def test_a_command_help_shows_defaults(capsys):
    try:
        main(["route", "--help"])
    except SystemExit as done:
        assert done.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: " in out
    assert "(default: None)" not in out


def test_a_missing_extra_in_a_command_is_one_line_naming_it(tmp_path):
    # uvicorn blocked as if kvtier[server] were not installed: kvtier route imports it first
    done = run_cli("sys.modules['uvicorn'] = None", ["route", "--replica", "http://127.0.0.1:9"], tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "uvicorn" in lines[0] and 'pip install "kvtier[server]"' in lines[0]


def test_the_default_model_without_the_demo_extra_is_one_line_naming_it(tmp_path):
    # a fresh machine (empty KVTIER_HOME) whose install lacks gguf and accelerate: the packaged SmolLM2
    # cannot be converted, and kvtier serve says which extra brings them instead of a traceback
    done = run_cli("sys.modules['gguf'] = None\nsys.modules['accelerate'] = None", ["serve", "--port", "9"], tmp_path)
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("kvtier")]
    assert "Traceback" not in done.stderr
    assert len(lines) == 1 and 'pip install "kvtier[demo]"' in lines[0] and "gguf" in lines[0], done.stderr
    assert not (tmp_path / "home" / "models").exists() or not any((tmp_path / "home" / "models").iterdir())
