"""The KV cache layout every layer of kvsim agrees on.

kv: [layers, 2 (K, V), kv_heads, tokens, head_dim]   (GQA-aware: kv_heads, not query heads)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

K, V = 0, 1  # index of keys / values on dim 1


class _TorchDtypes(Mapping):
    """{name: torch dtype} of the supported KV dtypes. torch is imported on the first value
    looked up, not with this module: the simulator and the command line use the layout's
    shapes and byte counts without torch (importing it costs ~1.5 s per process)."""

    _names = ("bfloat16", "float16", "float32")

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in self._names:
            raise KeyError(name)
        import torch

        return getattr(torch, name)

    def __contains__(self, name: object) -> bool:  # Mapping's would look the value up
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


DTYPES = _TorchDtypes()
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(DTYPES)}")


@dataclass(frozen=True)
class KVShape:
    """Shape (and source dtype) of one request's KV cache."""

    layers: int
    kv_heads: int
    tokens: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "tokens", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVShape.{field} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ValueError(f"KVShape.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.tokens, self.head_dim)

    @property
    def numel(self) -> int:
        return self.layers * 2 * self.kv_heads * self.tokens * self.head_dim

    @property
    def bf16_bytes(self) -> int:
        """Size of this cache in bf16: the baseline every ratio and GB/s is quoted against."""
        return 2 * self.numel

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, kv: torch.Tensor) -> KVShape:
        """Shape of a KV tensor, validating the layout."""
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(
                "KV tensor must be [layers, 2 (K,V), kv_heads, tokens, head_dim], "
                f"got shape {tuple(kv.shape)}"
            )
        layers, _, heads, tokens, head_dim = (int(s) for s in kv.shape)
        return cls(layers, heads, tokens, head_dim, dtype_name(kv.dtype))


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in a float tensor. aminmax propagates NaN and is ~15x faster than
    isfinite(t).all() on CPU, where the receiver checks every layer it dequantizes."""
    if t.numel() == 0:
        return True
    import torch

    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def check_finite(kv: torch.Tensor, what: str = "KV tensor") -> None:
    """Refuse NaN/Inf: a quantizer fed one would emit silent garbage for the whole group."""
    if all_finite(kv):
        return
    import torch

    bad = (~torch.isfinite(kv)).nonzero()
    first = tuple(int(i) for i in bad[0])
    raise ValueError(
        f"{what} contains {bad.shape[0]} non-finite value(s) (NaN/Inf), first at index "
        f"{first} of [layers, 2, kv_heads, tokens, head_dim]; refusing to encode"
    )
