"""Connection set-up for the Redis tier: the only module of the tier that imports redis-py.

The tier moves values over its own RESP code (resp.py) instead of redis-py's pipelines because that is
faster for KV-sized values: it sends memoryviews without joining them and receives bulk replies with
``recv_into`` straight into reused buffers (``benchmarks/redis_tier.py`` compares it with redis-py and
valkey-glide; the figures are on docs/benchmarks/tiers.md).

redis-py's public API never hands out a connection's socket, so this module opens the socket itself and
uses redis-py only through public functions: ``redis.connection.parse_url`` reads the URL (schemes, user,
password, database, query options) exactly as redis-py does, and ``redis.crc.key_slot`` gives Redis
Cluster hash slots. The set-up redis-py would do is small and done here: TCP (no Nagle) or a unix socket,
TLS for ``rediss://`` (CA, client certificate, hostname check), ``AUTH [user] password`` and ``SELECT``,
in RESP2. redis-py is imported lazily, on the first ``Endpoint``, so ``import kvtier`` works without it.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from time import monotonic
from typing import Any

from kvtier.base.errors import ConfigError
from kvtier.tiers.redis.resp import Packer, RespError, RespReader, WireClosed, WireTimeout, send_all

log = logging.getLogger(__name__)

#: What an Endpoint understands, from the URL or the tier's config (anything else is a ConfigError).
_OPTIONS = {"host", "port", "path", "db", "username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
            "ssl_cert_reqs", "ssl_check_hostname"}


def _redis() -> Any:
    try:
        import redis
        import redis.connection
        import redis.crc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("the redis tier needs redis-py: pip install 'kvtier[redis]'") from exc
    return redis


class RawConnection:
    """One connection, set up and authenticated: its socket, for resp.py to speak RESP on."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def close(self) -> None:
        """Drop the connection; one that is already broken is dropped all the same."""
        try:
            self.sock.close()
        except OSError as exc:
            log.debug("closing a redis connection: %s", exc)


@dataclass(frozen=True)
class Endpoint:
    """How to reach one server: host and port or a unix socket path, TLS, credentials and database."""

    tls: bool
    kwargs: dict[str, Any] = field(repr=False)

    @classmethod
    def from_url(cls, url: str, overrides: dict[str, Any]) -> Endpoint:
        """The endpoint of ``url`` with ``overrides`` (None values ignored); ConfigError for what it cannot use."""
        redis = _redis()
        try:
            parsed = redis.connection.parse_url(url)
        except ValueError as exc:
            raise ConfigError(f"redis url: {exc}") from None
        conn_class = parsed.pop("connection_class", redis.connection.Connection)
        kwargs = {**parsed, **{k: v for k, v in overrides.items() if v is not None}}
        unknown = sorted(set(kwargs) - _OPTIONS)
        if unknown:
            raise ConfigError(f"redis url: unsupported option(s) {unknown}")
        endpoint = cls(issubclass(conn_class, redis.connection.SSLConnection), kwargs)
        endpoint.tls_context()  # a missing or unreadable CA or certificate file is a config error, up front
        return endpoint

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

    def tls_context(self) -> ssl.SSLContext | None:
        """The client TLS context of a ``rediss://`` endpoint (None for plain ones)."""
        if not self.tls:
            return None
        kw = self.kwargs
        try:
            context = ssl.create_default_context(cafile=kw.get("ssl_ca_certs"))
            if kw.get("ssl_certfile"):
                context.load_cert_chain(kw["ssl_certfile"], kw.get("ssl_keyfile"))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"redis TLS files: {exc}") from None
        if str(kw.get("ssl_cert_reqs", "required")).lower() in ("none", "cert_none"):
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        elif str(kw.get("ssl_check_hostname", True)).lower() in ("false", "0", "no"):
            context.check_hostname = False
        return context

    def connect(self, deadline: float, connect_timeout: float) -> RawConnection:
        """A connection set up before ``deadline``; WireTimeout or WireClosed if it cannot be."""
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise WireTimeout("deadline passed before connecting")
        try:
            sock = self._open(min(connect_timeout, remaining))
        except TimeoutError as exc:
            raise WireTimeout(f"connect timed out: {exc}") from None
        except (OSError, ssl.SSLError) as exc:
            raise WireClosed(f"connect failed: {exc}") from None
        try:
            self._handshake(sock, deadline)
        except BaseException:
            sock.close()
            raise
        return RawConnection(sock)

    def _open(self, timeout: float) -> socket.socket:
        if self.kwargs.get("path"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(self.kwargs["path"])
            except BaseException:
                sock.close()
                raise
            return sock
        sock = socket.create_connection((self.host, int(self.kwargs.get("port", 6379))), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        context = self.tls_context()
        if context is None:
            return sock
        try:
            return context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        """AUTH and SELECT as redis-py would send them (RESP2); a refusal closes the connection."""
        kw, packer = self.kwargs, Packer()
        if kw.get("password"):
            user = (kw["username"].encode(),) if kw.get("username") else ()
            packer.add(b"AUTH", *user, str(kw["password"]).encode())
        if int(kw.get("db") or 0):
            packer.add(b"SELECT", b"%d" % int(kw["db"]))
        if not packer.count:
            return
        send_all(sock, packer.finish(), deadline)
        reader = RespReader(sock, size=4096)
        reader.arm(deadline, 0.0)
        for _ in range(packer.count):
            reply = reader.read_reply()
            if isinstance(reply, RespError):
                raise WireClosed(f"connection set-up refused: {reply.message}")


def key_slot_function() -> Callable[[bytes], int]:
    """redis-py's Redis Cluster hash slot of a key (CRC16 of its ``{hash tag}``, modulo 16384)."""
    return _redis().crc.key_slot
