"""KV spec and the canonical chunk layout.

The canonical chunk tensor is ``[layers, 2, tokens, kv_heads, head_dim]`` (index 0 of dim 1 is K, 1 is V).
Every codec and tier speaks this layout; engine integrations convert to and from their own.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvtier.base.errors import ConfigError, InvalidArgument

#: Stable one-byte codes for the dtypes a stored chunk may have. Never renumber: they are on disk.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.uint8: 6,
    torch.int8: 7,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
_DTYPES_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in DTYPE_CODES}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or ``torch.bfloat16``) -> ``torch.bfloat16``; raises ConfigError for unknown names."""
    if isinstance(name, torch.dtype):
        if name not in DTYPE_CODES:
            raise ConfigError(f"unsupported KV dtype {name}")
        return name
    try:
        return _DTYPES_BY_NAME[name.removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"unsupported KV dtype {name!r}; known: {sorted(_DTYPES_BY_NAME)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the stable spelling used in keys."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVSpec:
    """Shape and dtype of one model's KV cache as seen by one tensor-parallel rank."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVSpec.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))

    def chunk_shape(self, n_tokens: int) -> tuple[int, int, int, int, int]:
        """Canonical shape of ``n_tokens`` tokens of KV."""
        return (self.num_layers, 2, n_tokens, self.num_kv_heads, self.head_dim)

    def key_fields(self) -> Iterator[tuple[str, str | int]]:
        """Named fields hashed into the namespace root (see keys.Namespace)."""
        yield "layers", self.num_layers
        yield "kv_heads", self.num_kv_heads
        yield "head_dim", self.head_dim
        yield "dtype", dtype_name(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def empty(self, n_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.chunk_shape(n_tokens), dtype=self.dtype, device=device)

    def check(self, kv: torch.Tensor, n_tokens: int | None = None) -> None:
        """Raise InvalidArgument unless ``kv`` is a canonical tensor of this spec (with ``n_tokens`` tokens)."""
        want = self.chunk_shape(kv.shape[2] if n_tokens is None and kv.dim() == 5 else (n_tokens or 0))
        if kv.dim() != 5 or tuple(kv.shape) != want or kv.dtype != self.dtype:
            raise InvalidArgument(f"expected KV {want} {self.dtype}, got {tuple(kv.shape)} {kv.dtype}")


def tensor_view(buffer: memoryview | bytes | bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor that views ``buffer`` without copying. The caller must not write through a view of read-only
    bytes; kvtier only ever copies out of such views."""
    if isinstance(buffer, memoryview) and not buffer.readonly:  # most views: no warning to silence
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns about read-only buffers
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).view(shape)
