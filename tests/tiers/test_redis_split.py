"""The split-value header of the Redis tier, without a server: what a head says about its parts."""

from __future__ import annotations

from kvtier.tiers.redis.split import HEADER_BYTES, SplitHeader, part_keys_of


def test_header_round_trips_and_names_its_parts():
    header = SplitHeader.new(total=10_000, part_len=4096)
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert SplitHeader.parse(packed + b"part 0 follows") == header
    assert header.n_parts == 3
    keys = part_keys_of(b"kvtier:raw:{ab}", packed)
    assert keys == [b"kvtier:raw:{ab}:" + header.nonce.hex().encode() + b":%d" % i for i in (1, 2)]
    ranges = [header.part_range(i) for i in range(header.n_parts)]
    assert [(r.start, r.stop) for r in ranges] == [(0, 4096), (4096, 8192), (8192, 10_000)]


def test_anything_else_is_not_a_split_header():
    packed = SplitHeader.new(total=10_000, part_len=4096).pack()
    wrong_count = packed[:-4] + (7).to_bytes(4, "little")  # the part count must follow from the lengths
    wrong_version = packed[:4] + (2).to_bytes(2, "little") + packed[6:]
    for header in (b"", packed[:-1], b"XXXX" + packed[4:], wrong_count, wrong_version, b"plain value" * 4):
        assert SplitHeader.parse(header) is None
        assert part_keys_of(b"k", header) == []
