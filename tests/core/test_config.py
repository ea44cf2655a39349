import pytest

from kvtier.base.errors import ConfigError
from kvtier.core.config import CacheConfig, parse_size
from kvtier.tiers import MemoryTierConfig, WriteMode


@pytest.mark.parametrize(
    "text,value",
    [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1_000", 1000), (1234, 1234), ("1.5KiB", 1536), ("0", 0)],
)
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["four", "4 parsecs", -1, True, "1e9"])
def test_bad_sizes(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_defaults():
    config = CacheConfig()
    assert config.chunk_size == 256 and config.tiers == (MemoryTierConfig(),)


def test_from_yaml(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("chunk_size: 128\ntiers:\n  - kind: memory\n    capacity_bytes: 2GiB\n    write: back\n")
    config = CacheConfig.from_yaml(path)
    assert config.chunk_size == 128
    assert config.tiers == (MemoryTierConfig(capacity_bytes=2 * 2**30, write=WriteMode.BACK),)


def test_from_env_and_load_overrides(monkeypatch):
    env = {"KVTIER_CHUNK_SIZE": "64", "KVTIER_MEMORY_CAPACITY_BYTES": "16MiB", "KVTIER_MEMORY_PREFAULT": "no"}
    config = CacheConfig.from_env(env)
    assert config.chunk_size == 64
    assert config.tiers[0] == MemoryTierConfig(capacity_bytes=16 * 2**20, prefault=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert CacheConfig.load(chunk_size=32).chunk_size == 32


@pytest.mark.parametrize(
    "values,match",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": "many"}, "chunk_size"),
        ({"tiers": []}, "at least one tier"),
        ({"tiers": [{"kind": "tape"}]}, "tape"),
        ({"tiers": [{"kind": "memory", "capacity": 5}]}, "unknown option"),
        ({"tiers": [{"kind": "memory", "codec": "zip"}]}, "codec"),
        ({"tiers": [{"kind": "memory", "write": "sideways"}]}, "write"),
        ({"tiers": "memory"}, "list"),
        ({"colour": "blue"}, "unknown option"),
    ],
)
def test_bad_configs_are_clear_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        CacheConfig.from_dict(values)


def test_unreadable_yaml(tmp_path):
    with pytest.raises(ConfigError):
        CacheConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        CacheConfig.from_yaml(bad)
