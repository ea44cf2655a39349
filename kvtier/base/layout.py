"""KV spec and the canonical chunk layout.

The canonical chunk tensor is ``[layers, 2, tokens, kv_heads, head_dim]`` (index 0 of dim 1 is K, 1 is V).
Every codec and tier speaks this layout; engine integrations convert to and from their own.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from kvtier.base.errors import ConfigError, InvalidArgument

if TYPE_CHECKING:  # torch is imported only where tensors are made: a router (keys, no tensors) never loads it
    import torch

#: Stable one-byte codes for the dtypes a stored chunk may have, by their stable names. Never renumber: they
#: are on disk. ``DTYPE_CODES`` / ``DTYPES_BY_CODE`` give the same keyed by ``torch.dtype`` (module __getattr__).
DTYPE_CODES_BY_NAME: dict[str, int] = {
    "float16": 1, "bfloat16": 2, "float32": 3, "float8_e4m3fn": 4, "float8_e5m2": 5, "uint8": 6, "int8": 7,
}
_ITEMSIZES: dict[str, int] = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
}


def __getattr__(name: str) -> Any:
    """``DTYPE_CODES`` (torch.dtype -> code) and ``DTYPES_BY_CODE``, built on first use so that importing this
    module does not import torch."""
    if name == "DTYPE_CODES":
        return {dtype_from_name(n): code for n, code in DTYPE_CODES_BY_NAME.items()}
    if name == "DTYPES_BY_CODE":
        return {code: dtype_from_name(n) for n, code in DTYPE_CODES_BY_NAME.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: str | torch.dtype) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``: the stable spelling used in keys (checked without
    importing torch); raises ConfigError for dtypes a chunk may not have."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        name = str(dtype).removeprefix("torch.")
    else:
        raise ConfigError(f"unsupported KV dtype {dtype!r}")
    if name not in DTYPE_CODES_BY_NAME:
        raise ConfigError(f"unsupported KV dtype {dtype!r}; known: {sorted(DTYPE_CODES_BY_NAME)}")
    return name


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or ``torch.bfloat16``) -> ``torch.bfloat16`` (imports torch); raises ConfigError for
    unknown names."""
    return _torch_dtype(dtype_name(name))


@cache
def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


@dataclass(frozen=True, init=False)
class KVSpec:
    """Shape and dtype of one model's KV cache as seen by one tensor-parallel rank.

    The dtype is held by its stable name (``dtype_key``), so that specs and the keys derived from them need no
    torch (the router); ``dtype`` resolves it to a ``torch.dtype``, importing torch on first use."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_key: str  #: e.g. "bfloat16"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str | torch.dtype) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVSpec.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "dtype_key", dtype_name(dtype))

    @property
    def dtype(self) -> torch.dtype:
        return _torch_dtype(self.dtype_key)

    def chunk_shape(self, n_tokens: int) -> tuple[int, int, int, int, int]:
        """Canonical shape of ``n_tokens`` tokens of KV."""
        return (self.num_layers, 2, n_tokens, self.num_kv_heads, self.head_dim)

    def key_fields(self) -> Iterator[tuple[str, str | int]]:
        """Named fields hashed into the namespace root (see keys.Namespace)."""
        yield "layers", self.num_layers
        yield "kv_heads", self.num_kv_heads
        yield "head_dim", self.head_dim
        yield "dtype", self.dtype_key

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * _ITEMSIZES[self.dtype_key]

    def empty(self, n_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
        import torch

        return torch.empty(self.chunk_shape(n_tokens), dtype=self.dtype, device=device)

    def check(self, kv: torch.Tensor, n_tokens: int | None = None) -> None:
        """Raise InvalidArgument unless ``kv`` is a canonical tensor of this spec (with ``n_tokens`` tokens)."""
        want = self.chunk_shape(kv.shape[2] if n_tokens is None and kv.dim() == 5 else (n_tokens or 0))
        if kv.dim() != 5 or tuple(kv.shape) != want or kv.dtype != self.dtype:
            raise InvalidArgument(f"expected KV {want} {self.dtype}, got {tuple(kv.shape)} {kv.dtype}")


def tensor_view(buffer: memoryview | bytes | bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor that views ``buffer`` without copying. The caller must not write through a view of read-only
    bytes; kvtier only ever copies out of such views."""
    import torch

    if isinstance(buffer, memoryview) and not buffer.readonly:  # most views: no warning to silence
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns about read-only buffers
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).view(shape)
