"""Codec registry: looked up by name (configs) or by id (blob headers).

Each registered codec is a *family* with a stable id (raw 0, lossless 1, int8 2, int4 3, cachegen 4; never
renumber, the ids are on disk) and a default name. Parameterised families also accept ``<name>-<params>``
(``int4-g32``, ``lossless-lz4``, ``cachegen-q2``): the parameters are written into each payload, so one id
decodes every variant of its family, and a tier reads any blob of its codec family whatever its parameters.
"""

from __future__ import annotations

import threading

from kvtier.base.errors import BlobError, CodecError, ConfigError
from kvtier.codecs.base import BytesPayload, Codec, Payload
from kvtier.codecs.raw import RawCodec

_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}
_VARIANTS: dict[str, Codec] = {}
_LOCK = threading.Lock()


def register(codec: Codec) -> Codec:
    """Add a codec family (its default instance) to the registry; names and ids must be unique."""
    if codec.name in _BY_NAME or codec.codec_id in _BY_ID or "-" in codec.name:
        raise ConfigError(f"codec {codec.name!r} (id {codec.codec_id}) is already registered or misnamed")
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.codec_id] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The codec for a config name: a family's default (``int4``) or a variant (``int4-g32``)."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    with _LOCK:
        if name in _VARIANTS:
            return _VARIANTS[name]
        family, _, params = name.partition("-")
        base = _BY_NAME.get(family)
        make = getattr(base, "variant", None)
        if base is None or make is None or not params:
            raise ConfigError(f"unknown codec {name!r}; known: {codec_names()} (and <name>-<params> variants)")
        try:
            codec = make(params)
        except CodecError as exc:
            raise ConfigError(str(exc)) from None
        _VARIANTS[name] = codec
        return codec


def codec_by_id(codec_id: int) -> Codec:
    """The family of a blob header's codec id (it decodes every variant of that family)."""
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise BlobError(f"unknown codec id {codec_id}") from None


def codec_names() -> list[str]:
    return sorted(_BY_NAME)


def _register_builtins() -> None:
    from kvtier.codecs.cachegen import CacheGenCodec
    from kvtier.codecs.lossless import LosslessCodec
    from kvtier.codecs.quant import GroupQuantCodec

    for codec in (RawCodec(), LosslessCodec(), GroupQuantCodec(8), GroupQuantCodec(4), CacheGenCodec()):
        register(codec)


_register_builtins()

__all__ = ["BytesPayload", "Codec", "Payload", "codec_by_id", "codec_names", "get_codec", "register"]
