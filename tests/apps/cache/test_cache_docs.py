"""The cache pages' examples work as written: every ``kvtier cache`` command in them parses into a call (in the
order shown), and every YAML block of the cache-control page loads as a cache config."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml

from kvtier.apps.cache.cli import add_parser, request_of
from kvtier.core.config import CacheConfig

ROOT = Path(__file__).resolve().parents[3]
PAGES = ["docs/commands/cache.md", "docs/operations/cache-control.md", "docs/integrations/vllm.md"]


def commands(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    spans = re.findall(r"`(kvtier cache [^`]+)`", text)
    lines = [line.split("kvtier cache", 1)[1] for line in text.splitlines() if "kvtier cache " in line
             and not line.lstrip().startswith("|") and "`kvtier cache" not in line]
    return [s.removeprefix("kvtier cache") for s in spans] + lines


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="kvtier", exit_on_error=False)
    add_parser(top.add_subparsers(dest="command"))
    return top


CASES = [(page, cmd) for page in PAGES for cmd in commands(page)]


def test_the_pages_show_commands():
    assert len(CASES) >= 10 and {page for page, _ in CASES} == set(PAGES)


@pytest.mark.parametrize("page,command", CASES)
def test_each_documented_command_parses_into_a_call(page, command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the examples name: a chat and a prompt
    (tmp_path / "messages.json").write_text('[{"role": "user", "content": "hi"}]')
    (tmp_path / "system.json").write_text('[{"role": "system", "content": "Be brief."}]')
    (tmp_path / "system_prompt.txt").write_text("Be brief.")
    words = shlex.split(command, comments=True)
    args = parser().parse_args(["cache", *words])
    assert args.url, command
    method, path, _ = request_of(args)
    assert path.startswith("/admin/v1/") and method in ("GET", "POST")


def test_each_yaml_block_of_the_cache_control_page_loads_as_a_config():
    text = (ROOT / "docs/operations/cache-control.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        config = CacheConfig.from_dict(yaml.safe_load(block))
        assert config.tenant_salts() and config.tiers
