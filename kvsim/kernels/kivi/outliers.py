"""GEAR's outliers (kivi/gear.py): the k largest and k smallest entries of each vector, kept
in fp16 with their index, their slots filled before quantization; 'ceil' counts (k per
vector) and 'exact' ones (k_i per vector, s % of a head-page's entries in all)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, NamedTuple

from kvsim.core.lazy_module import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


def outliers_per_side(n: int, pct: float) -> int:
    """k entries kept at each end of a vector of n entries (exact rational ceil)."""
    if n <= 1 or pct <= 0:
        return 0
    return min(math.ceil(Fraction(str(pct)) * n / 200), (n - 1) // 2)


def outlier_side_counts(n: int, m: int, pct: float, exact: bool) -> list[int]:
    """Per-side outlier counts of m vectors of n entries. exact: vector i keeps
    floor((i+1)c) - floor(ic) per side, c = pct% of n / 2 (so m vectors keep pct% of their
    entries in all), capped at (n - 1) // 2; else ceil(c) each."""
    if not exact:
        return [outliers_per_side(n, pct)] * m
    if n <= 1 or pct <= 0:
        return [0] * m
    c = Fraction(str(pct)) * n / 200
    cap = (n - 1) // 2
    return [min(math.floor((i + 1) * c) - math.floor(i * c), cap) for i in range(m)]


def outlier_schedule(n: int, m: int, pct: float, exact: bool) -> torch.Tensor:
    """`outlier_side_counts` as int64 [m]."""
    return torch.tensor(outlier_side_counts(n, m, pct, exact), dtype=torch.int64)


class Extremes(NamedTuple):
    values: torch.Tensor
    indices: torch.Tensor


def extremes(x: torch.Tensor, m: int) -> tuple[Extremes, Extremes]:
    """The m largest entries of each vector of x [..., n] (largest first) and the m smallest
    (smallest first), values and indices [..., m]. Equal values come in index order (a
    stable sort): a defined choice among ties, which torch.topk does not promise, and the
    one kivi_cpu's outlier kernel makes."""
    top = torch.sort(x, dim=-1, descending=True, stable=True)
    bot = torch.sort(x, dim=-1, stable=True)
    return (Extremes(top.values[..., :m], top.indices[..., :m]),
            Extremes(bot.values[..., :m], bot.indices[..., :m]))


def ragged_vectors(counts: torch.Tensor) -> torch.Tensor:
    """counts [m] -> the vector of each stored outlier [2 S] (k_i top, then k_i bottom)."""
    return torch.repeat_interleave(torch.arange(counts.numel()), 2 * counts)


def scatter_ragged(x: torch.Tensor, idx: torch.Tensor, vec: torch.Tensor,
                   values: torch.Tensor | float) -> torch.Tensor:
    """x [..., m, n] with x[..., vec[j], idx[..., j]] = values[..., j] (a new tensor)."""
    m, n = x.shape[-2:]
    out = x.reshape(*x.shape[:-2], m * n).clone()
    pos = vec.to(idx.device) * n + idx.long()
    if isinstance(values, float):
        out.scatter_(-1, pos, values)
    else:
        out.scatter_(-1, pos, values.to(out.dtype))
    return out.reshape(x.shape)


def split_outliers_ragged(x: torch.Tensor, counts: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., m, n], counts [m] -> (filled x, idx [..., 2 S] int64, values [..., 2 S]):
    split_outliers with k_i per vector i (stored vector by vector: k_i top, k_i bottom)."""
    kmax = int(counts.max()) if counts.numel() else 0
    if kmax == 0:
        empty = x.new_zeros((*x.shape[:-2], 0))
        return x, empty.long(), empty
    top, bot = extremes(x, kmax + 1)
    keep = torch.arange(kmax) < counts.unsqueeze(-1)  # [m, kmax]
    mask = torch.cat((keep, keep), dim=-1).to(x.device)  # [m, 2 kmax]
    cand = torch.cat((top.indices[..., :kmax], bot.indices[..., :kmax]), dim=-1)
    idx = cand[..., mask]  # [..., 2 S], vector-major
    vec = ragged_vectors(counts)
    at = counts.to(x.device).view(-1, 1).expand(*x.shape[:-1], 1)
    fill = torch.clamp(torch.zeros_like(x[..., :1]), bot.values.gather(-1, at),
                       top.values.gather(-1, at)).squeeze(-1)  # [..., m]
    vals = x.reshape(*x.shape[:-2], -1).gather(-1, vec.to(x.device) * x.shape[-1] + idx)
    filled = scatter_ragged(x, idx, vec, fill[..., vec.to(x.device)])
    return filled, idx, vals


def index_kind(extent: int) -> str:
    return "u8" if extent <= 256 else "u16"


def stored_index(idx: torch.Tensor, kind: str) -> torch.Tensor:
    """int64 indices -> their stored dtype (u16 as int16's bits, as groupquant writes them)."""
    return idx.to(torch.uint8) if kind == "u8" else idx.to(torch.int32).to(torch.int16)


def loaded_index(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """Stored indices (u8, or u16 as int16's bits) -> int64."""
    wide = raw.to(torch.int64)
    return wide if kind == "u8" else wide & 0xFFFF


def index_dtype(kind: str) -> torch.dtype:
    """The torch dtype an index field of `kind` is stored in."""
    return torch.uint8 if kind == "u8" else torch.int16


def split_outliers(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., n] -> (filled x, idx [..., 2k] int64, values [..., 2k]): the k largest and k
    smallest entries of each vector, replaced by clamp(0, remaining min, remaining max)."""
    if k == 0:
        empty = x.new_zeros((*x.shape[:-1], 0))
        return x, empty.long(), empty
    top, bot = extremes(x, k + 1)
    idx = torch.cat((top.indices[..., :k], bot.indices[..., :k]), dim=-1)
    vals = torch.gather(x, -1, idx)
    fill = torch.clamp(torch.zeros_like(top.values[..., k]), bot.values[..., k],
                       top.values[..., k])
    filled = x.scatter(-1, idx, fill.unsqueeze(-1).expand_as(vals))
    return filled, idx, vals


def restore_outliers(x: torch.Tensor, k_idx: torch.Tensor, k_val: torch.Tensor,
                     v_idx: torch.Tensor, v_val: torch.Tensor) -> None:
    """In place: the stored outliers ('ceil' layout) back over their slots of pages
    x [..., 2 (K, V), heads, q, head_dim]: k_idx / k_val [..., heads, head_dim, 2 kK] (token
    in the page, per key channel), v_idx / v_val [..., heads, q, 2 kV] (channel, per value
    token); indices int64, values any float dtype."""
    x[..., 0, :, :, :].transpose(-1, -2).scatter_(-1, k_idx, k_val.to(x.dtype))
    x[..., 1, :, :, :].scatter_(-1, v_idx, v_val.to(x.dtype))
