"""The frequency sketch: never under-counts (before aging), ages by halving, grows without losing counts."""

from __future__ import annotations

import collections
import random

from kvtier.policy.sketch import MAX_COUNT, FrequencySketch
from tests.conformance.policy_suite import key


def test_estimates_never_under_count_and_saturate():
    sketch = FrequencySketch(1000)
    rng = random.Random(1)
    counts = collections.Counter(rng.randrange(500) for _ in range(3000))
    for i, n in counts.items():
        for _ in range(n):
            sketch.increment(key(i))
    assert all(sketch.estimate(key(i)) >= min(n, MAX_COUNT) for i, n in counts.items())
    sketch.increment(key(9999))
    for _ in range(40):
        sketch.increment(key(1234567))
    assert sketch.estimate(key(1234567)) == MAX_COUNT


def test_keys_never_seen_read_zero_almost_always():
    sketch = FrequencySketch(2000)
    for i in range(9000):  # about what a period of aging sees: several times the entries
        sketch.increment(key(i))
    false = sum(sketch.estimate(key(10**6 + i)) > 0 for i in range(5000))
    assert false <= 2  # about one in 20,000 is expected


def test_counts_are_halved_every_ten_times_the_entries():
    sketch = FrequencySketch(100)
    for _ in range(8):
        sketch.increment(key(1))
    assert sketch.estimate(key(1)) == 8
    for i in range(1000 - 8):  # the 1,000th increment (10 x 100 entries) ages every counter
        sketch.increment(key(10_000 + i))
    assert sketch.estimate(key(1)) == 4


def test_growing_keeps_every_estimate():
    sketch = FrequencySketch(64)
    for i in range(50):
        for _ in range(i % 5 + 1):
            sketch.increment(key(i))
    before = [sketch.estimate(key(i)) for i in range(50)]
    width, nbytes = sketch.width, sketch.nbytes
    sketch.ensure_capacity(5000)
    assert sketch.width > width and sketch.nbytes > nbytes
    assert [sketch.estimate(key(i)) for i in range(50)] == before


def test_short_keys_are_hashed():
    sketch = FrequencySketch(10)
    sketch.increment(b"a")
    assert sketch.estimate(b"a") == 1 and sketch.estimate(b"b") == 0
