"""Model-state specs, snapshot keys and snapshot policies (kvtier.base.state)."""

import hashlib
import struct

import pytest
import torch

from kvtier import CacheConfig
from kvtier.base.errors import ConfigError
from kvtier.base.keys import Namespace
from kvtier.base.layout import KVSpec
from kvtier.base.state import ModelStateSpec, SnapshotPolicy, StateKind, StateSpec, state_key

KV = KVSpec(2, 4, 8, torch.bfloat16)
CONV = StateSpec(StateKind.CONV, 3, (160, 4), torch.bfloat16)
SSM = StateSpec(StateKind.SSM, 3, (8, 16, 16), torch.float32)
HYBRID = ModelStateSpec(KV, (CONV, SSM))


def test_specs_validate_and_size():
    assert CONV.snapshot_shape == (3, 160, 4) and CONV.nbytes == 3 * 160 * 4 * 2
    assert HYBRID.snapshot_bytes == CONV.nbytes + SSM.nbytes
    assert HYBRID.kinds == (StateKind.ATTENTION_KV, StateKind.CONV, StateKind.SSM)
    assert ModelStateSpec(None, (SSM,)).kinds == (StateKind.SSM,)
    assert ModelStateSpec.of(KV) == ModelStateSpec(KV) and ModelStateSpec.of(HYBRID) is HYBRID
    with pytest.raises(ConfigError):
        ModelStateSpec(None)  # holds nothing
    with pytest.raises(ConfigError):
        ModelStateSpec(KV, (CONV, CONV))
    with pytest.raises(ConfigError):
        StateSpec(StateKind.ATTENTION_KV, 1, (4,), torch.float32)
    with pytest.raises(ConfigError):
        StateSpec(StateKind.SSM, 0, (4,), torch.float32)
    with pytest.raises(ConfigError):
        SSM.check(torch.zeros(3, 8, 16, 16, dtype=torch.bfloat16))


def test_attention_only_spec_keeps_the_kv_namespace():
    """A KVSpec and a ModelStateSpec around it hash to the same root: attention models' keys are unchanged."""
    assert Namespace("m@1", KV, 16).root == Namespace("m@1", ModelStateSpec(KV), 16).root


def test_state_shapes_and_dtypes_are_part_of_the_namespace():
    roots = {Namespace("m@1", spec, 16).root for spec in (
        HYBRID,
        ModelStateSpec(KV, (CONV,)),
        ModelStateSpec(KV, (CONV, StateSpec(StateKind.SSM, 3, (8, 16, 16), torch.bfloat16))),
        ModelStateSpec(KV, (CONV, StateSpec(StateKind.SSM, 3, (8, 16, 32), torch.float32))),
        ModelStateSpec(None, (CONV, SSM)),
        KV,
    )}
    assert len(roots) == 6


def test_state_key_golden_and_distinct_per_kind():
    chunk = bytes(range(32))
    conv, ssm = state_key(chunk, StateKind.CONV), state_key(chunk, StateKind.SSM)
    expected = hashlib.sha256(b"kvtier/state/v1" + struct.pack("<I", 4) + b"conv" + chunk).digest()
    assert conv == expected
    assert conv.hex() == "7334731bed8e7baa9092e35b49b36218e971e8acd1b800ff939ec43e915bbadf"
    assert len({conv, ssm, chunk, state_key(bytes(32), StateKind.CONV)}) == 4


@pytest.mark.parametrize("text, policy", [
    ("every", SnapshotPolicy(1, False)),
    ("every-8", SnapshotPolicy(8, False)),
    ("last", SnapshotPolicy(None, True)),
    ("last+every-16", SnapshotPolicy(16, True)),
    (" Every-4 + LAST ", SnapshotPolicy(4, True)),
])
def test_policy_strings(text, policy):
    assert SnapshotPolicy.parse(text) == policy
    assert SnapshotPolicy.parse(str(policy)) == policy


@pytest.mark.parametrize("text", ["", "every-0", "first", "every-x", "last+"])
def test_bad_policy_strings_are_config_errors(text):
    with pytest.raises(ConfigError):
        SnapshotPolicy.parse(text)


def test_policy_boundaries():
    assert SnapshotPolicy(1, False).boundaries(2, 100, 16) == [3, 4, 5, 6]
    assert SnapshotPolicy(4, False).boundaries(2, 210, 16) == [4, 8, 12]
    assert SnapshotPolicy(4, False).boundaries(4, 120, 16) == []  # boundary 4 came from the cache
    assert SnapshotPolicy(None, True).boundaries(2, 100, 16) == [6]
    assert SnapshotPolicy(None, True).boundaries(6, 100, 16) == []  # a full hit stores nothing new
    assert SnapshotPolicy(4, True).boundaries(0, 170, 16) == [4, 8, 10]


def test_last_boundary_of_a_whole_chunk_prompt():
    """A repeat must compute a token, so it restores boundary 5 of a 6-chunk prompt; a longer prompt, 6."""
    assert SnapshotPolicy(None, True).boundaries(0, 96, 16) == [5, 6]
    assert SnapshotPolicy(None, True).boundaries(5, 96, 16) == [6]
    assert SnapshotPolicy(None, True).boundaries(0, 97, 16) == [6]


def test_cache_config_reads_the_policy():
    assert CacheConfig().state_snapshots == SnapshotPolicy(None, True)
    assert CacheConfig.from_dict({"state_snapshots": "every-4"}).state_snapshots == SnapshotPolicy(4, False)
    env = CacheConfig.from_env({"KVTIER_STATE_SNAPSHOTS": "last+every-2"})
    assert env.state_snapshots == SnapshotPolicy(2, True)
    with pytest.raises(ConfigError):
        CacheConfig.from_dict({"state_snapshots": "sometimes"})
