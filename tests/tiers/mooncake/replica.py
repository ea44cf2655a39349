"""One engine replica for the multi-process tests: a KVCache on a Mooncake pool in its own interpreter,
driven over stdin/stdout (a script, not a test).

``python replica.py '<tier options as JSON>'`` joins the pool (the options go to tests/tiers/mooncake/helpers'
``make_cache``, plus ``master``: the master's ``[master_address, metadata_url, metrics_url]``), prints
``{"ready": true}`` once in the pool and then answers one JSON command per line:

* ``{"op": "store", "seed": s, "chunks": n}`` -> ``{"stored": tokens newly stored}``
* ``{"op": "retrieve", "seed": s, "chunks": n}`` -> ``{"tokens": prefix retrieved, "same": bytes equal}``
* ``{"op": "lookup", "seed": s, "chunks": n}`` -> ``{"tokens": prefix cached}``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from tests.tiers.mooncake.helpers import make_cache, prompt  # noqa: E402


def answer(cache, command: dict) -> dict:
    tokens, kv = prompt(command["chunks"], seed=command["seed"])
    if command["op"] == "store":
        return {"stored": cache.store(tokens, kv)}
    if command["op"] == "lookup":
        return {"tokens": cache.lookup(tokens)}
    if command["op"] == "retrieve":
        out, n = cache.retrieve(tokens)
        return {"tokens": n, "same": n > 0 and torch.equal(out[:, :, :n], kv[:, :, :n])}
    raise ValueError(f"unknown op {command['op']!r}")


def main(options: dict) -> None:
    address, metadata, metrics = options.pop("master")
    master = SimpleNamespace(master_address=address, metadata_url=metadata, metrics_url=metrics)
    with make_cache(master, **options) as cache:
        print(json.dumps({"ready": cache.tiers[0].joined}), flush=True)
        for line in sys.stdin:
            print(json.dumps(answer(cache, json.loads(line))), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
