import dataclasses
import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvtier.base.errors import ConfigError
from kvtier.base.keys import Namespace, chunk_hashes, token_array
from kvtier.base.layout import KVSpec

SPEC = KVSpec(2, 4, 8, torch.bfloat16)
NS = Namespace("golden/model@rev1", SPEC, 4, salt=b"tenant-a")
GOLDEN_ROOT = "86c8b513c0bb7f8237041adb466124bf5485967134eb02b116f94f27088bddb2"
GOLDEN_CHUNKS = [
    "e4ed8b5a0d9a1fbffdb6a34ea007408d6a992339c0a675ac9ae4889b9c0258fd",
    "b0b016ec937b62be22d4e449c4b8b8ffec68ddc2e522501ed4f19b43e398c774",
]


def test_golden_vectors():
    assert NS.root.hex() == GOLDEN_ROOT
    assert [h.hex() for h in NS.chunk_hashes(list(range(10)))] == GOLDEN_CHUNKS


def test_chain_definition_matches_the_documented_formula():
    tokens = list(range(10))
    prev = NS.root
    for i, got in enumerate(NS.chunk_hashes(tokens)):
        body = struct.pack("<I", 4) + struct.pack("<4I", *tokens[4 * i : 4 * i + 4])
        prev = hashlib.sha256(prev + body).digest()
        assert got == prev


@pytest.mark.parametrize("seed", ["0", "1", "random"])
def test_deterministic_across_processes(seed):
    code = (
        "import torch; from kvtier.base.keys import Namespace; from kvtier.base.layout import KVSpec;"
        "ns = Namespace('golden/model@rev1', KVSpec(2, 4, 8, torch.bfloat16), 4, salt=b'tenant-a');"
        "print(ns.root.hex(), *[h.hex() for h in ns.chunk_hashes(list(range(10)))])"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [GOLDEN_ROOT, *GOLDEN_CHUNKS]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "golden/model@rev2"},
        {"spec": KVSpec(3, 4, 8, torch.bfloat16)},
        {"spec": KVSpec(2, 2, 8, torch.bfloat16)},
        {"spec": KVSpec(2, 4, 16, torch.bfloat16)},
        {"spec": KVSpec(2, 4, 8, torch.float16)},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"adapter": "lora-7"},
        {"salt": b"tenant-b"},
        {"salt": b""},
    ],
)
def test_every_namespace_field_changes_every_key(change):
    other = dataclasses.replace(NS, **change)
    tokens = list(range(40))
    mine, theirs = NS.chunk_hashes(tokens), other.chunk_hashes(tokens)
    assert len(mine) == len(theirs) == 10
    assert not set(mine) & set(theirs)


def test_chunk_size_changes_every_key():
    other = dataclasses.replace(NS, chunk_size=8)
    assert not set(NS.chunk_hashes(list(range(64)))) & set(other.chunk_hashes(list(range(64))))


def test_prefix_sharing_and_partial_chunks():
    a = list(range(1000))
    b = a[:1000] + [7] * 50
    c = a[:999] + [5]
    ha, hb, hc = NS.chunk_hashes(a), NS.chunk_hashes(b), NS.chunk_hashes(c)
    assert len(ha) == 250 and hb[:250] == ha  # every full chunk of the shared 1,000 tokens hits
    assert hc[:249] == ha[:249] and hc[249] != ha[249]  # one token of difference changes that chunk
    assert NS.chunk_hashes(a[:3]) == []  # a partial chunk has no key


def test_a_change_early_changes_all_later_keys():
    a = list(range(40))
    b = [1] + a[1:]
    assert not set(NS.chunk_hashes(a)) & set(NS.chunk_hashes(b))


def test_token_containers_agree():
    tokens = list(range(100, 140))
    ref = NS.chunk_hashes(tokens)
    assert NS.chunk_hashes(np.array(tokens, dtype=np.int64)) == ref
    assert NS.chunk_hashes(np.array(tokens, dtype=np.uint32)) == ref
    assert NS.chunk_hashes(torch.tensor(tokens)) == ref
    assert chunk_hashes(NS.root, tokens, 4) == ref


@pytest.mark.parametrize("bad", [[-1, 2], [2**32], np.array([1.5, 2.0]), ["a"]])
def test_bad_tokens_are_rejected(bad):
    with pytest.raises(ConfigError):
        token_array(bad)


@pytest.mark.parametrize(
    "kwargs",
    [{"model": ""}, {"chunk_size": 0}, {"tp_rank": 2, "tp_size": 2}, {"salt": "text"}],
)
def test_invalid_namespaces(kwargs):
    with pytest.raises(ConfigError):
        dataclasses.replace(NS, **kwargs)


GOLDEN_SEGMENT_ROOT = "b9783ec15ed4259a1ba44a2260172861ec60aa90945c8c93e3f3bbbe7fcc953a"
GOLDEN_SEGMENT = "99da4e5a6810508f93db4f8d706d68593a034ea9e953637d7ec888f857ad7c1f"


def test_segment_keys_golden_vectors_and_formula():
    assert NS.segment_root.hex() == GOLDEN_SEGMENT_ROOT
    assert NS.segment_root == hashlib.sha256(b"kvtier/segment/v1" + NS.encode()).digest()
    tokens = list(range(10))
    assert NS.segment_hash(tokens, 0).hex() == GOLDEN_SEGMENT
    body = struct.pack("<II", 7, 10) + struct.pack("<10I", *tokens)
    assert NS.segment_hash(tokens, 7) == hashlib.sha256(NS.segment_root + body).digest()


def test_segment_keys_are_a_separate_domain_from_prefix_chains():
    tokens = list(range(4))  # one whole chunk: the same bytes a chunk hash covers
    assert NS.segment_root != NS.root
    chain = set(NS.chunk_hashes(tokens)) | {NS.root}
    assert NS.segment_hash(tokens, 0) not in chain
    assert NS.segment_root not in chain


@pytest.mark.parametrize("change", [{"model": "golden/model@rev2"}, {"salt": b"tenant-b"}, {"adapter": "lora-7"},
                                    {"spec": KVSpec(2, 4, 8, torch.float16)}])
def test_segment_keys_depend_on_namespace_tokens_and_base_position(change):
    tokens = list(range(12))
    key = NS.segment_hash(tokens, 0)
    assert dataclasses.replace(NS, **change).segment_hash(tokens, 0) != key
    assert NS.segment_hash(tokens, 1) != key
    assert NS.segment_hash(tokens[:-1], 0) != key
    assert NS.segment_hash(np.array(tokens), 0) == key == NS.segment_hash(torch.tensor(tokens), 0)
