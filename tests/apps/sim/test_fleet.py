"""The fleet file: the documented example parses, mistakes are errors that name the option."""

from __future__ import annotations

import pytest

from kvtier.apps.sim import fleet as fleet_module
from kvtier.apps.sim.fleet import FleetConfig, SimTier, TierKind
from kvtier.base.errors import ConfigError
from kvtier.fleet.scoring import Routing
from kvtier.tiers import WriteMode


def test_the_documented_example_parses(tmp_path):
    example = fleet_module.__doc__.split("YAML (every key optional)::", 1)[1].split("How tiers are simulated")[0]
    path = tmp_path / "fleet.yaml"
    path.write_text("\n".join(line[4:] for line in example.splitlines()))
    fleet = FleetConfig.from_yaml(path)
    assert fleet.replicas == 4 and fleet.routing.routing is Routing.LOAD_BOUNDED
    assert dict(fleet.routing.tier_weights) == {"disk": 0.9}
    assert fleet.replica_names == ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000")
    assert fleet.replica_name(2) == "10.0.0.3:8000" and fleet.routing.decode_stream_tokens == 128
    memory, disk = fleet.tiers
    assert memory == SimTier(chunks=2500, policy="arc-lfu")
    assert disk.kind is TierKind.DISK and disk.capacity_bytes == 2 * 2**40 and disk.write is WriteMode.BACK
    assert disk.admission == "second-hit"
    assert fleet.shared == SimTier(chunks=100_000, policy="lru", admission_max_bytes_per_s=2 * 2**30)


def test_defaults():
    fleet = FleetConfig.from_dict({})
    assert fleet.replicas == 1 and fleet.tiers == (SimTier(chunks=10_000),) and fleet.shared is None
    assert fleet.replica_names == () and fleet.replica_name(0) == "0" and fleet.routing.decode_stream_tokens == 0


@pytest.mark.parametrize("values, message", [
    ({"replica": 2}, "unknown option"),
    ({"replicas": 0}, "at least 1"),
    ({"routing": "nearest"}, "routing"),
    ({"tiers": [{"kind": "memory"}]}, "exactly one of chunks or capacity_bytes"),
    ({"tiers": [{"chunks": 10, "capacity_bytes": "1GiB"}]}, "exactly one"),
    ({"tiers": [{"chunks": 10, "policy": "mru"}]}, "unknown eviction policy"),
    ({"tiers": [{"kind": "tape", "chunks": 10}]}, "kind"),
    ({"tiers": [{"chunks": 10, "codec_ratio": 0}]}, "codec_ratio"),
    ({"shared": [1, 2]}, "expected a mapping"),
    ({"replicas": 2, "replica_names": ["a"]}, "replica_names must name each of the 2"),
    ({"replicas": 2, "replica_names": ["a", "a"]}, "replica_names"),
    ({"replicas": 2, "replica_names": ["a", ""]}, "replica_names"),
    ({"decode_stream_tokens": -1}, "decode_stream_tokens"),
])
def test_mistakes_are_config_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        FleetConfig.from_dict(values)


def test_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read fleet"):
        FleetConfig.from_yaml(tmp_path / "none.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        FleetConfig.from_yaml(bad)
