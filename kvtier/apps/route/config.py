"""``kvtier route``'s configuration: frozen dataclasses, one per concern, checked when built."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.base.errors import ConfigError
from kvtier.fleet.scoring import Routing, RoutingConfig
from kvtier.web.body import DEFAULT_MAX_BODY_BYTES
from kvtier.web.http_limits import HttpLimits

#: What a cached token of each tier is worth against recomputing it (the fastest tier's 1.0): a load from
#: disk or a shared store is cheap next to prefill, but not free, so RAM wins a tie with disk.
DEFAULT_TIER_WEIGHTS = (("memory", 1.0), ("disk", 0.9), ("redis", 0.8), ("recent", 1.0),
                        # vLLM replicas' media (VllmEvents): GPU and CPU as llm-d weights them by default
                        ("GPU", 1.0), ("CPU", 0.8), ("DISK", 0.7), ("STORAGE", 0.7), ("SHARED", 0.6))
#: A vLLM replica's media, fastest first: vLLM's device cache, kvtier's tiers under the connector's default
#: media (memory CPU, disk DISK, shared stores SHARED) and vLLM's own offloading's (CPU, STORAGE).
DEFAULT_VLLM_MEDIA = ("GPU", "CPU", "DISK", "STORAGE", "SHARED")
#: One decoding request costs its replica about this many prefill tokens (kvtier serve decodes one request at
#: a time, so a stream ahead of a request delays it by its whole decode).
DEFAULT_DECODE_STREAM_TOKENS = 128.0


def default_routing() -> RoutingConfig:
    return RoutingConfig(Routing.LOAD_BOUNDED, epsilon=0.25, sticky=True, tier_weights=DEFAULT_TIER_WEIGHTS,
                         decode_stream_tokens=DEFAULT_DECODE_STREAM_TOKENS)


@dataclass(frozen=True)
class ProxyConfig:
    """Per replica: ``max_connections`` pooled; ``connect_timeout_s`` to connect; ``read_timeout_s`` the longest
    wait for the next bytes (a long prefill on a CPU replica is slow). ``max_attempts`` replicas are tried
    for a request that failed before any byte reached the client.

    ``max_body_bytes``: larger request bodies are a 413 (a replica's own cap by default: a body it would refuse
    is not worth reading). ``max_prompt_tokens``: the router tokenizes no more of a prompt than this (and a
    margin), at a cost bounded accordingly: enough to find where its prefix is cached; the replica judges
    whether the whole of it fits its context.

    ``admin_timeout_s``: one admin call's fan-out to every replica ends this long after it started; a replica
    that has not answered by then is listed with that error (its call may still complete on it)."""

    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    max_connections: int = 64
    max_attempts: int = 3
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int = 131_072
    admin_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if min(self.connect_timeout_s, self.read_timeout_s, self.admin_timeout_s) <= 0 or min(
                self.max_connections, self.max_attempts, self.max_body_bytes, self.max_prompt_tokens) < 1:
            raise ConfigError("proxy timeouts must be positive and max_connections/max_attempts/max_body_bytes/"
                              "max_prompt_tokens at least 1")


@dataclass(frozen=True)
class AdmissionConfig:
    """At most ``max_in_flight`` requests are proxied at once; up to ``max_queue`` more wait; beyond, 429."""

    max_in_flight: int = 256
    max_queue: int = 1024
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_queue < 0 or self.retry_after_s < 0:
            raise ConfigError("max_in_flight must be at least 1, max_queue and retry_after_s not negative")


@dataclass(frozen=True)
class HealthConfig:
    """Active checks every ``interval_s``; ``eject_after`` failed checks (or ``passive_eject_after`` failed
    requests in a row) eject a replica, ``readmit_after`` good checks bring it back."""

    interval_s: float = 2.0
    timeout_s: float = 2.0
    eject_after: int = 2
    passive_eject_after: int = 3
    readmit_after: int = 2

    def __post_init__(self) -> None:
        if min(self.interval_s, self.timeout_s) <= 0 or min(self.eject_after, self.passive_eject_after,
                                                            self.readmit_after) < 1:
            raise ConfigError("health intervals must be positive and the thresholds at least 1")


@dataclass(frozen=True)
class IndexConfig:
    """``recent_ttl_s``: how long the router trusts its own record of what it sent where (replicas without
    events); ``in_flight_ttl_s``: the same for replicas with events (until their stores are reported);
    ``shared_ttl_s``: for chunks in shared stores; ``chunk_size``: of the router's own record."""

    recent_ttl_s: float = 600.0
    in_flight_ttl_s: float = 60.0
    shared_ttl_s: float = 3600.0
    chunk_size: int = 256
    resync_s: float = 300.0

    def __post_init__(self) -> None:
        if min(self.recent_ttl_s, self.in_flight_ttl_s, self.shared_ttl_s, self.resync_s) <= 0 or self.chunk_size < 1:
            raise ConfigError("index times and chunk_size must be positive")


@dataclass(frozen=True)
class VllmEvents:
    """Where a vLLM replica publishes its KV events (``vllm serve --kv-events-config``): ``endpoint`` its PUB
    socket, ``replay`` its replay socket (None: gaps and restarts are not replayed, the replica's index is
    reset instead), ``topic`` its topic (a prefix filter, as ZMQ subscribes), ``block_size`` its ``--block-size``
    (the router's keys for it are blocks of that size: kvtier.fleet.vllm_index), ``media`` the media it reports,
    fastest first (events naming others are dropped and counted), ``shared`` the id of the store behind its
    ``SHARED`` medium (replicas naming the same id share what any of them stored there; None: the medium is the
    replica's own). vLLM's sockets have no authentication: keep them on loopback or a firewalled network."""

    endpoint: str
    replay: str | None = None
    topic: str = ""
    block_size: int = 16
    media: tuple[str, ...] = DEFAULT_VLLM_MEDIA
    shared: str | None = None

    def __post_init__(self) -> None:
        for where in (self.endpoint, self.replay):
            if where is not None and not where.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"a vLLM events endpoint is tcp://HOST:PORT or ipc://PATH, got {where!r}")
        if "*" in self.endpoint or (self.replay is not None and "*" in self.replay):
            raise ConfigError("a vLLM events endpoint to connect to names a host, not *")
        if not 1 <= self.block_size <= 1 << 16 or not self.media:
            raise ConfigError("a vLLM replica's block_size must be in [1, 65536] and it must name a medium")


@dataclass(frozen=True)
class ReplicaEntry:
    """One replica: its base URL and, for vLLM, its KV events (None: kvtier serve, which says itself at
    ``/kvtier/info`` where it publishes, or any server the router keeps its own record for)."""

    url: str
    vllm_events: VllmEvents | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"replica {self.url!r} is not an http(s) URL")


def parse_replica(text: str) -> ReplicaEntry:
    """``URL`` or ``URL,events=tcp://H:P[,replay=tcp://H:P][,topic=T][,block-size=N][,media=GPU:CPU][,shared=ID]``."""
    url, *options = text.split(",")
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key.strip() not in ("events", "replay", "topic", "block-size", "media", "shared"):
            raise ConfigError(f"replica option {option!r}: expected events=, replay=, topic=, block-size=, media=, "
                              "shared=")
        values[key.strip()] = value.strip()
    if not values:
        return ReplicaEntry(url.rstrip("/"))
    if "events" not in values:
        raise ConfigError(f"replica {url!r}: its options need events=tcp://HOST:PORT")
    try:
        block_size = int(values.get("block-size", "16"))
    except ValueError:
        raise ConfigError(f"replica {url!r}: block-size must be an integer") from None
    media = tuple(m for m in values.get("media", ":".join(DEFAULT_VLLM_MEDIA)).split(":") if m)
    return ReplicaEntry(url.rstrip("/"), VllmEvents(values["events"], values.get("replay"), values.get("topic", ""),
                                               block_size, media, values.get("shared") or None))


class SessionPlacement(enum.Enum):
    """Where a sticky session goes: back to the replica this router last sent it to (``remembered``), or to its
    rendezvous home within the load bound (``rendezvous``: the same in every router, with no shared state;
    kvtier.fleet.sessions)."""

    REMEMBERED = "remembered"
    RENDEZVOUS = "rendezvous"


@dataclass(frozen=True)
class RouterConfig:
    """The replicas (base URLs), how to choose among them, the tokenizer's model folder (None: SmolLM2), and
    the limits of the router's own HTTP server, and the file of the router's events key pair (None: this
    user's default, kvtier.events.keys.default_key_file(), which replicas of the same user on this host allow
    without configuration; replicas elsewhere need its public key in ``kvtier serve --events-allow``)."""

    replicas: tuple[str | ReplicaEntry, ...]  #: URLs are taken as ``ReplicaEntry(url)``
    routing: RoutingConfig = field(default_factory=default_routing)
    proxy: ProxyConfig = ProxyConfig()
    admission: AdmissionConfig = AdmissionConfig()
    health: HealthConfig = HealthConfig()
    index: IndexConfig = IndexConfig()
    tokenizer: Path | None = None
    #: what a client may cost the router's HTTP server: head size and count, read timeouts, connections
    http: HttpLimits = HttpLimits()
    events_key: Path | None = None
    sessions: SessionPlacement = SessionPlacement.REMEMBERED

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("kvtier route needs at least one replica URL")
        object.__setattr__(self, "replicas", tuple(r if isinstance(r, ReplicaEntry) else ReplicaEntry(r)
                                                   for r in self.replicas))
        if len({r.url for r in self.replicas}) != len(self.replicas):
            raise ConfigError("a replica URL is given twice")
