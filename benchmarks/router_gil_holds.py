"""The longest single call holding the GIL in the router's handling of E-3's snapshot and R-2's big chat (issue 29).

A router's ``/health`` waits for its event loop, and its loop waits for the GIL: a worker thread inside one long C
call (decoding, freeing) holds it throughout. This measures, in CPU time of the calling thread (so a busy machine
adds little), the longest such call before and after the round-three changes, on this process alone:

* E-3 snapshot, 2.5 M keys: decoding it in one call (``wire.decode_snapshot``, as before) against decoding its
  structure (``decode_snapshot_head``) and then its keys in pieces (``snapshot_keys``), the longest of those;
* freeing the 2 M keys a snapshot replaces or an ejection forgets: one set of 2 M keys (before) against the
  longest shard of a ``ShardedKeys`` at the same cap (freed one per loop turn);
* R-2 chat of 240k messages (8 MiB): ``decode_json`` of the whole body (before) against ``parse_request``'s
  steps for a large body (splitting into raw fields, decoding the first 1 MiB of messages).

    PYTHONPATH=. python benchmarks/router_gil_holds.py [--quick]

Prints each pair and its ratio (before / after); last line RESULT {json}. Repetitions take the fastest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _util import result  # noqa: E402

from kvtier.core.events import TierHolding  # noqa: E402
from kvtier.events.wire import decode_snapshot, decode_snapshot_head, encode_snapshot, snapshot_keys  # noqa: E402
from kvtier.fleet.index import ShardedKeys  # noqa: E402
from kvtier.web.body import decode_json  # noqa: E402


def cpu_ms(call) -> tuple[float, object]:
    start = time.thread_time()
    out = call()
    return (time.thread_time() - start) * 1000, out


def longest(calls, reps: int) -> float:
    """The longest of ``calls`` (each a zero-argument call), each the fastest of ``reps`` repetitions."""
    return max(min(cpu_ms(call)[0] for _ in range(reps)) for call in calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    n_keys, cap, n_msgs, reps = (250_000, 200_000, 24_000, 2) if args.quick else (2_500_000, 2_000_000, 240_000, 3)
    keys = [hashlib.sha256(b"%d" % i).digest() for i in range(n_keys)]
    payload = encode_snapshot("e", 0, [TierHolding("memory", keys)])
    figures: dict = {"quick": args.quick}

    def pair(name: str, before: float, after: float) -> None:
        figures[name] = {"before_ms": round(before, 1), "after_ms": round(after, 1), "ratio": round(before / after, 1)}
        print(f"{name:28} before {before:8.1f} ms   after {after:7.1f} ms   x{before / after:.1f}")

    def decode_in_pieces() -> float:
        took, head = cpu_ms(lambda: decode_snapshot_head(payload))
        pieces = snapshot_keys(head.tiers[0].keys)
        steps = [took]
        while True:
            took, piece = cpu_ms(lambda: next(pieces, None))
            if piece is None:
                return max(steps)
            steps.append(took)

    pair("snapshot_decode", min(cpu_ms(lambda: decode_snapshot(payload))[0] for _ in range(reps)),
         min(decode_in_pieces() for _ in range(reps)))

    def free_set() -> float:
        held = set(keys[:cap])
        return cpu_ms(lambda: held.clear())[0]

    def free_shard() -> float:
        held = ShardedKeys(cap)
        held.update(keys[:cap])
        shards = held.shards
        return max(cpu_ms(lambda: shards.pop().clear())[0] for _ in range(len(shards)))

    pair("index_free", min(free_set() for _ in range(reps)), min(free_shard() for _ in range(reps)))

    body = json.dumps({"messages": [{"role": "user", "content": "hi"}] * n_msgs}).encode()
    fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    prefix = bytes(memoryview(fields["messages"])[: 1 << 20])
    after = longest([lambda: msgspec.json.decode(body, type=dict[str, msgspec.Raw]),
                     lambda: decode_json(prefix, partial=True)], reps)
    pair("chat_decode", min(cpu_ms(lambda: decode_json(body))[0] for _ in range(reps)), after)
    result(figures)


if __name__ == "__main__":
    main()
