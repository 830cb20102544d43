"""Runs of pages that share one chunk layout, and their fields inside a wire buffer.

A device path that writes a per-page field (gear's fits and outliers, oscar's norms) with
one copy per page would launch as many copies as there are pages. The pages of one run have
the same quantized tokens and the same layout, so their chunks lie evenly spaced in each
layer: one strided view of the buffer holds the field of every chunk of the run, and one
copy writes (or reads) it. For the KIVI family's shared window the runs are the full pages,
then at most one shorter page (kcvt's page 0, which carries the keys' scales, is a run of
its own).

The geometry is kivi.geometry's (`geo` int64 [pages, GEO_COLS]; chunk (l, p) at
l * layer_bytes + geo[p, G_BASE]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.kivi.geometry import G_BASE, G_QK, G_T0

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


@dataclass(frozen=True)
class PageRun:
    """Consecutive pages with the same number q > 0 of quantized tokens and the same chunk
    layout, their tokens contiguous and their chunks `stride` bytes apart (within a layer)."""

    first: int  # first page
    count: int  # pages
    t0: int  # first token
    q: int  # quantized tokens per page
    stride: int  # bytes from one page's chunk to the next's (0: one page)

    @property
    def tokens(self) -> slice:
        return slice(self.t0, self.t0 + self.count * self.q)


def page_runs(geo: np.ndarray) -> list[PageRun]:
    """The runs of the pages with quantized tokens, in page order."""
    runs: list[PageRun] = []
    layout = np.delete(geo, [G_T0, G_BASE], axis=1)  # the token split and field offsets
    for p in range(geo.shape[0]):
        q, t0 = int(geo[p, G_QK]), int(geo[p, G_T0])
        if q == 0:
            continue
        if runs:
            last = runs[-1]
            step = int(geo[p, G_BASE] - geo[p - 1, G_BASE])
            if (last.first + last.count == p and last.tokens.stop == t0
                    and np.array_equal(layout[p], layout[last.first])
                    and (last.count == 1 or last.stride == step)):
                runs[-1] = replace(last, count=last.count + 1, stride=step)
                continue
        runs.append(PageRun(p, 1, t0, q, 0))
    return runs


def field_bytes(buf: torch.Tensor, geo: np.ndarray, run: PageRun, col: int, layer_bytes: int,
                layers: int, nbytes: int) -> torch.Tensor:
    """uint8 [layers, pages, nbytes]: the field at geo column `col` of every chunk of the
    run, a view of the wire buffer."""
    return buf.as_strided((layers, run.count, nbytes), (layer_bytes, run.stride, 1),
                          int(geo[run.first, G_BASE] + geo[run.first, col]))


def write_field(buf: torch.Tensor, geo: np.ndarray, run: PageRun, col: int, layer_bytes: int,
                values: torch.Tensor) -> None:
    """values [layers, pages, ...]: each chunk's field in its stored dtype -> the buffer."""
    if values.numel() == 0:
        return
    # flattened first: a field whose last dimension has one entry (a rank-1 factor) may be
    # "contiguous" with a stride that view() refuses
    raw = values.reshape(values.shape[0], values.shape[1], -1).contiguous().view(torch.uint8)
    field_bytes(buf, geo, run, col, layer_bytes, raw.shape[0], raw.shape[2]).copy_(raw)


def read_field(buf: torch.Tensor, geo: np.ndarray, run: PageRun, col: int, layer_bytes: int,
               layers: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The field of every chunk of the run, [layers, pages, *shape] in `dtype`."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = field_bytes(buf, geo, run, col, layer_bytes, layers, nbytes).contiguous()
    return raw.view(dtype).reshape(layers, run.count, *shape)


def run_tokens(x: torch.Tensor, run: PageRun) -> torch.Tensor:
    """[layers, 2, heads, tokens, ...] -> the run's tokens as [layers, 2, heads, pages, q,
    ...] (a view)."""
    return x[:, :, :, run.tokens].unflatten(3, (run.count, run.q))


def chunk_major(t: torch.Tensor, pages_dim: int) -> torch.Tensor:
    """t [layers, ..., pages (at pages_dim), ...] -> [layers, pages, ...]: each chunk's field
    in its order, contiguous once made so (a view)."""
    rest = [d for d in range(1, t.dim()) if d != pages_dim]
    return t.permute(0, pages_dim, *rest)
