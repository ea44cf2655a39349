"""The redis-py adapter: the only module of the Redis tier that imports or touches redis-py.

redis-py parses the URL and sets each connection up (socket, TLS, AUTH/HELLO with username and password,
SELECT); after that the tier speaks RESP itself (resp.py) over the connection's socket, which redis-py keeps
in a private attribute. It also computes Redis Cluster hash slots. redis-py is imported lazily, on the first
``Endpoint``, so ``import kvtier`` works without it.
"""

from __future__ import annotations

import inspect
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from time import monotonic
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.redis.resp import WireClosed, WireTimeout

log = logging.getLogger(__name__)


def _redis() -> Any:
    try:
        import redis
        import redis.backoff
        import redis.connection
        import redis.crc
        import redis.exceptions
        import redis.retry
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("the redis tier needs redis-py: pip install 'kvtier[redis]'") from exc
    return redis


def _accepted(cls: type) -> set[str]:
    """The keyword arguments a redis-py connection class accepts, over its whole class hierarchy."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names.update(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD)
    names.discard("self")
    return names


class RawConnection:
    """One connection redis-py has set up: its socket, for resp.py to speak RESP on, and how to close it."""

    __slots__ = ("_conn", "sock")

    def __init__(self, conn: Any, sock: socket.socket) -> None:
        self._conn, self.sock = conn, sock

    def close(self) -> None:
        """Drop the connection; one that is already broken is dropped all the same."""
        try:
            self._conn.disconnect()
        except (OSError, _redis().exceptions.RedisError) as exc:
            log.debug("closing a redis connection: %s", exc)


@dataclass(frozen=True)
class Endpoint:
    """How to reach one server: the redis-py connection class and its arguments (host and port, or path)."""

    conn_class: type
    kwargs: dict[str, Any] = field(repr=False)

    @classmethod
    def from_url(cls, url: str, overrides: dict[str, Any]) -> Endpoint:
        """The endpoint of ``url`` with ``overrides`` (None values ignored); ConfigError for what redis-py rejects."""
        redis = _redis()
        try:
            parsed = redis.connection.parse_url(url)
        except ValueError as exc:
            raise ConfigError(f"redis url: {exc}") from None
        conn_class = parsed.pop("connection_class", redis.connection.Connection)
        kwargs = {**parsed, **{k: v for k, v in overrides.items() if v is not None}}
        # one attempt: the tier's deadline and circuit breaker decide what happens after a failure
        kwargs["retry"] = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
        unknown = sorted(set(kwargs) - _accepted(conn_class))
        if unknown:
            raise ConfigError(f"redis url: unsupported option(s) {unknown}")
        return cls(conn_class, kwargs)

    @property
    def name(self) -> str:
        """``host:port``, or the unix socket's path."""
        kwargs = self.kwargs
        return kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"

    @property
    def host(self) -> str:
        return str(self.kwargs.get("host", "127.0.0.1"))

    def at(self, host: str, port: int) -> Endpoint:
        """The same settings (credentials, TLS, database) for another server."""
        return replace(self, kwargs={**self.kwargs, "host": host, "port": port})

    def connect(self, deadline: float, connect_timeout: float) -> RawConnection:
        """A connection set up before ``deadline``; WireTimeout or WireClosed if it cannot be."""
        exceptions = _redis().exceptions
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise WireTimeout("deadline passed before connecting")
        conn = self.conn_class(**self.kwargs)
        conn.socket_connect_timeout = min(connect_timeout, remaining)
        conn.socket_timeout = remaining  # bounds the handshake (AUTH/HELLO, SELECT)
        try:
            conn.connect()
        except exceptions.TimeoutError as exc:
            raise WireTimeout(f"connect timed out: {exc}") from None
        except (exceptions.RedisError, OSError) as exc:
            raise WireClosed(f"connect failed: {exc}") from None
        sock = getattr(conn, "_sock", None)  # redis-py's private attribute: the one place it is read
        if sock is None:
            raise WireClosed("connection has no socket after connect")
        return RawConnection(conn, sock)


def key_slot_function() -> Callable[[bytes], int]:
    """redis-py's Redis Cluster hash slot of a key (CRC16 of its ``{hash tag}``, modulo 16384)."""
    return _redis().crc.key_slot
