"""What ``kvtier serve`` tells a router: ``GET /kvtier/info`` and the cache's event stream (kvtier.events).

``/kvtier/info`` answers with everything a router needs to compute the same chunk keys as this server and to
follow where they are::

    {"kvtier": 1, "model": "SmolLM2-135M-Instruct", "cache": true,
     "namespace": {"model": ..., "layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "float32",
                   "chunk_size": 256, "tp_rank": 0, "tp_size": 1, "adapter": ""},
     "tiers": [{"name": "memory", "store_id": null}, {"name": "redis", "store_id": "redis:h:6379/0#kvtier:raw:"}],
     "events": {"endpoint": "tcp://127.0.0.1:41234", "control": "tcp://127.0.0.1:41235", "epoch": "9f...",
                "key": "<the publisher's CURVE public key, Z85>"}}

``events`` is null when the server publishes none (``--no-events``), ``namespace`` null without a cache. The
tenant salt is never in it: the router derives it from the caller's API key exactly as the server does.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request

from kvtier.apps.serve.backend import Backend
from kvtier.core.events import TierHolding, holdings
from kvtier.events.publisher import EventPublisher, PublisherConfig
from kvtier.events.wire import namespace_json
from kvtier.tiers import SharedStore

WILDCARDS = ("0.0.0.0", "::", "*", "")
INFO_VERSION = 1


def attach_events(app: FastAPI, backend: Backend, config: PublisherConfig | None) -> EventPublisher | None:
    """Serve ``/kvtier/info`` on ``app`` and, when ``config`` is given and the server has a cache, publish the
    cache's events; the caller closes the publisher returned."""
    cache = backend.cache
    publisher = None
    if cache is not None and config is not None:
        publisher = EventPublisher(cache.events.subscribe, lambda: holdings(cache.tiers), config)

    @app.get("/kvtier/info")
    async def info(request: Request) -> dict[str, Any]:
        tiers = [{"name": h.name, "store_id": h.store_id} for h in _tier_ids(backend)]
        events = None
        if publisher is not None:
            host = request.url.hostname or "127.0.0.1"
            events = {"endpoint": _reachable(publisher.endpoint, host),
                      "control": _reachable(publisher.control_endpoint, host), "epoch": publisher.epoch,
                      "key": publisher.public_key.decode()}
        return {"kvtier": INFO_VERSION, "model": backend.name, "cache": cache is not None,
                "namespace": namespace_json(cache.namespace) if cache is not None else None,
                "tiers": tiers, "events": events}

    return publisher


def _tier_ids(backend: Backend) -> list[TierHolding]:
    if backend.cache is None:
        return []
    return [TierHolding(t.name, None, t.store_id if isinstance(t, SharedStore) else None)
            for t in backend.cache.tiers]


def _reachable(endpoint: str, host: str) -> str:
    """A bound endpoint as a client can reach it: a wildcard address becomes the host the client used."""
    where = urlsplit(endpoint)
    if where.hostname in WILDCARDS:
        return f"tcp://{host}:{where.port}"
    return endpoint
