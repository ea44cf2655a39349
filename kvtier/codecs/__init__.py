"""Codec registry: one instance per name, looked up by name (configs) or by id (blob headers)."""

from __future__ import annotations

from kvtier.codecs.base import BytesPayload, Codec, Payload
from kvtier.codecs.raw import RawCodec
from kvtier.errors import BlobError, ConfigError

_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    """Add a codec to the registry; names and ids must be unique."""
    if codec.name in _BY_NAME or codec.codec_id in _BY_ID:
        raise ConfigError(f"codec {codec.name!r} (id {codec.codec_id}) is already registered")
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.codec_id] = codec
    return codec


def get_codec(name: str) -> Codec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; known: {sorted(_BY_NAME)}") from None


def codec_by_id(codec_id: int) -> Codec:
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise BlobError(f"unknown codec id {codec_id}") from None


def codec_names() -> list[str]:
    return sorted(_BY_NAME)


register(RawCodec())

__all__ = ["BytesPayload", "Codec", "Payload", "codec_by_id", "codec_names", "get_codec", "register"]
