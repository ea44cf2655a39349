"""Codec registry: looked up by name (configs) or by id (blob headers).

Each registered codec is a *family* with a stable id (raw 0, lossless 1, int8 2, int4 3, cachegen 4; never
renumber, the ids are on disk) and a default name. Parameterised families also accept ``<name>-<params>``
(``int4-g32``, ``lossless-lz4``, ``cachegen-q2``): the parameters are written into each payload, so one id
decodes every variant of its family, and a tier reads any blob of its codec family whatever its parameters.

Families are registered lazily (kvtier.base.registry): name and id are known up front, a family's module is
imported and its default codec made the first time its name or id is looked up, once per process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvtier.base.errors import BlobError, CodecError, ConfigError
from kvtier.base.registry import Registry
from kvtier.codecs.base import BytesPayload, Codec, Payload

_FAMILIES: Registry[Callable[[], Codec]] = Registry("codec")
_NAME_OF_ID: dict[int, str] = {}
_BY_NAME: dict[str, Codec] = {}  # families whose default codec is made
_BY_ID: dict[int, Codec] = {}
_VARIANTS: dict[str, Codec] = {}
_LOCK = threading.RLock()


def register_family(name: str, codec_id: int, module: str, attr: str, **kwargs: Any) -> None:
    """Add a codec family whose default codec is ``module.attr(**kwargs)``, made on first use; it must carry
    this ``name`` and ``codec_id``. Names and ids must be unique and names free of ``-``."""
    with _LOCK:
        _claim(name, codec_id)
        _FAMILIES.register(name, module, attr, **kwargs)
        _NAME_OF_ID[codec_id] = name


def register(codec: Codec) -> Codec:
    """Add a codec family (its default instance, already made) to the registry; names and ids must be unique."""
    with _LOCK:
        _claim(codec.name, codec.codec_id)
        _FAMILIES.add(codec.name, lambda: codec)
        _NAME_OF_ID[codec.codec_id] = codec.name
        _BY_NAME[codec.name] = _BY_ID[codec.codec_id] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The codec for a config name: a family's default (``int4``) or a variant (``int4-g32``)."""
    codec = _BY_NAME.get(name)
    if codec is None:
        codec = _family(name)
    if codec is not None:
        return codec
    with _LOCK:
        if name in _VARIANTS:
            return _VARIANTS[name]
        family, _, params = name.partition("-")
        base = _family(family)
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
    codec = _BY_ID.get(codec_id)
    if codec is not None:
        return codec
    name = _NAME_OF_ID.get(codec_id)
    if name is None:
        raise BlobError(f"unknown codec id {codec_id}")
    return _family(name)  # type: ignore[return-value]  # registered, so never None


def codec_names() -> list[str]:
    return _FAMILIES.names()


def _family(name: str) -> Codec | None:
    """The default codec of family ``name`` (made now if this is its first use); None for no such family."""
    if name not in _FAMILIES:
        return None
    make = _FAMILIES[name]  # imports the family's module, outside the lock
    with _LOCK:
        codec = _BY_NAME.get(name)
        if codec is None:
            codec = make()
            if codec.name != name or _NAME_OF_ID.get(codec.codec_id) != name:
                raise ConfigError(f"codec family {name!r} made {codec.name!r} (id {codec.codec_id}): "
                                  f"its registration names another codec")
            _BY_NAME[name] = _BY_ID[codec.codec_id] = codec
        return codec


def _claim(name: str, codec_id: int) -> None:
    if name in _FAMILIES or codec_id in _NAME_OF_ID or "-" in name:
        raise ConfigError(f"codec {name!r} (id {codec_id}) is already registered or misnamed")


register_family("raw", 0, "kvtier.codecs.raw", "RawCodec")
register_family("lossless", 1, "kvtier.codecs.lossless", "LosslessCodec")
register_family("int8", 2, "kvtier.codecs.quant", "GroupQuantCodec", bits=8)
register_family("int4", 3, "kvtier.codecs.quant", "GroupQuantCodec", bits=4)
register_family("cachegen", 4, "kvtier.codecs.cachegen", "CacheGenCodec")

__all__ = ["BytesPayload", "Codec", "Payload", "codec_by_id", "codec_names", "get_codec", "register",
           "register_family"]
