"""Every command the README and the docs show works as written: kvtier's own commands parse with kvtier's
parser, ``kvtier vllm serve`` lines with vLLM's own parser and their connector config with kvtier's, the
scripts and extras they name exist, and every YAML and JSON block loads (a kvtier config through CacheConfig).

Placeholders a reader replaces (MODEL, TRACE, ``...``) are arguments like any other to a parser.
"""

from __future__ import annotations

import json
import tomllib

import pytest
import yaml

from kvtier.cli import parse
from tests.doc_blocks import ROOT, doc_files, fenced_blocks, shell_commands

SHELLS = ("", "bash", "sh", "shell", "console")
BLOCKS = [block for path in doc_files() for block in fenced_blocks(path)]
COMMANDS = [(block, argv) for block in BLOCKS if block.language in SHELLS for argv in shell_commands(block)]
KVTIER = [(b, argv) for b, argv in COMMANDS if argv[0] == "kvtier" and argv[1:2] != ["vllm"]]
KVTIER_VLLM = [(b, argv) for b, argv in COMMANDS if argv[:2] == ["kvtier", "vllm"]]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def ids(cases) -> list[str]:
    return [f"{block.where}:{' '.join(argv[:3])}" for block, argv in cases]


def test_the_docs_show_commands():
    assert len(KVTIER) >= 20 and KVTIER_VLLM, "the extraction found the docs' commands"


@pytest.mark.parametrize(("block", "argv"), KVTIER, ids=ids(KVTIER))
def test_each_kvtier_command_parses(block, argv):
    words = [w for w in argv[1:] if w != "..."]
    try:
        parse(words)
    except SystemExit as stop:  # --help exits 0 after printing; anything else is a refusal
        if stop.code:
            pytest.fail(f"{block.where}: `{' '.join(argv)}` is refused by kvtier's parser (exit {stop.code})")


@pytest.mark.parametrize(("block", "argv"), KVTIER_VLLM, ids=ids(KVTIER_VLLM))
def test_each_kvtier_vllm_serve_line_parses_with_vllms_parser_and_kvtiers_config(block, argv):
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.cli import ensure_vllm_metadata

    ensure_vllm_metadata()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvtier.integrations.vllm.config import ConnectorConfig

    assert argv[2] == "serve", f"{block.where}: only `kvtier vllm serve` lines are checked"
    top = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(top.add_subparsers(dest="subcommand"))
    try:
        args = top.parse_args([w for w in argv[2:] if w != "..."])
    except SystemExit as stop:
        if not stop.code:
            return
        pytest.fail(f"{block.where}: vLLM's parser refuses `{' '.join(argv)}` (exit {stop.code})")
    transfer = args.kv_transfer_config
    if transfer is not None and transfer.kv_connector == "KVTierConnector":
        ConnectorConfig.from_extra(transfer.kv_connector_extra_config)


SCRIPTS = [(b, argv) for b, argv in COMMANDS if argv[0] == "bash" and argv[1:2] and argv[1].startswith("scripts/")]
PIPS = [(b, argv) for b, argv in COMMANDS if argv[:2] == ["pip", "install"]]


@pytest.mark.parametrize(("block", "argv"), SCRIPTS + PIPS, ids=ids(SCRIPTS + PIPS))
def test_scripts_and_extras_named_exist(block, argv):
    if argv[0] == "bash":
        assert (ROOT / argv[1]).is_file(), f"{block.where}: {argv[1]} does not exist"
        return
    for word in argv[2:]:
        if word.startswith("kvtier["):
            extras = set(word.removeprefix("kvtier[").rstrip("]").split(","))
            assert extras <= EXTRAS, f"{block.where}: no extra {extras - EXTRAS} in pyproject.toml"


DATA = [b for b in BLOCKS if b.language in ("yaml", "yml", "json")]


@pytest.mark.parametrize("block", DATA, ids=[b.where for b in DATA])
def test_each_yaml_and_json_block_loads(block):
    from kvtier.core.config import CacheConfig

    try:
        data = json.loads(block.text) if block.language == "json" else yaml.safe_load(block.text)
    except (ValueError, yaml.YAMLError) as exc:
        pytest.fail(f"{block.where}: the {block.language} block does not load: {exc}")
    if isinstance(data, dict) and "tiers" in data and "replicas" not in data:
        CacheConfig.from_dict(data)  # a kvtier config (not a fleet file for kvtier sim): kvtier loads it
