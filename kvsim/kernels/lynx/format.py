"""`lynx`: Lynx hierarchical split-stream quantization (seed 003, Algorithm 1 and §4.1).

Every channel (one (K|V, kv_head, head_dim index), running along tokens) is quantized in
three stages, then its sign + 7-bit (in general M-bit) magnitude code is split into
priority streams (anchor first, then signed residual corrections), nibble/bit-packed.

Stage 1, page normalization (per channel, per page of `page_tokens` tokens):
    lo = min(x) + 0.0 (canonical zero), r = hi/2 - lo/2 (half range, cannot overflow),
    k = smallest int with r < 2^k (from r's exponent bits, clamped to [-126, 126]);
    x' = (x/2 - lo/2) * 2^-k in [0, 1) (in [0, 4) only when the range is >= 2^127). The scale
    is a power of two, so the normalization is exact scaling and needs no division; `lo` is
    stored fp32, `k` int8.
Stage 2, chunk centering (per channel, per chunk of `chunk_tokens` tokens):
    mu = floor(mean(trunc(x' * 2^14))) * 2^-14  (integer sum: order-independent, so the torch,
    numba and Triton backends agree bit for bit; stored uint16), xc = x' - mu,
    sigma = max|xc| stored fp16 (round to nearest; values above it saturate, see stage 3).
Stage 3, alpha-law companding to a sign + M-bit magnitude code, M = sum(split) - 1:
    y = ln(1 + alpha*u) / ln(1 + alpha) * (2^M - 1), code = round(y), u = |xc| / sigma.
    Implemented without a transcendental: u = xc * fp32(1/sigma) (0 when sigma is 0), the
    sign is u < 0 (so -0.0 is positive), and the code is the number of precomputed fp32
    thresholds t_i = ((1+alpha)^((i - 1/2)/(2^M - 1)) - 1)/alpha strictly below |u| (the
    rounding points of y), so every backend computes the same code. |u| can exceed 1 by a
    rounding of sigma; the code then saturates at 2^M - 1 (never overflows).
Stage 4, split streams. split = [b0, b1, ...]: stream 0 (anchor) holds the sign and the top
    b0-1 magnitude bits; stream j >= 1 holds the next b_j bits as a *signed* digit
    d_j = field_j - 2^(b_j-1) in [-2^(b_j-1), 2^(b_j-1)-1] (two's complement, i.e. the
    field with its top bit flipped). Decoding from the first s streams reconstructs at the
    centre of the code interval still possible, through the companding inverse (Eq. 4):
    anchor-only sits in the middle of its bucket (except a narrow top bucket, which
    reconstructs at |u| = 1 where each chunk's max-abs element lies) and each residual digit
    is a signed correction around that centre; with every stream it is the exact inverse
    L(code), which reconstructs closer than the value-space midpoint of a code's thresholds
    (docs/codecs/lynx.md).

The overflow of Algorithm 1 as printed ((127 + 7) >> 4 = 8 does not fit sign + 3 bits) comes
from rounding the anchor to the *nearest* multiple of 16 while the code range [0, 127] is
not symmetric around multiples of 16. General rule used here, for any split: a magnitude
code I in [0, 2^M) is written in mixed radix as I = a*u0 + sum_j t_j*u_j with u_j =
2^(bits after stream j), a = I >> (M - b0 + 1) (fits b0-1 bits because I < 2^M) and
t_j in [0, 2^b_j); the signed digit is d_j = t_j - 2^(b_j-1). Every field fits its width by
construction, no code is wasted (rounding to nearest would have to cap I at
(2^(b0-1) - 1)*u0 + window, e.g. 119 for 4+4, 95 for 2+6, 87 for 2+2+4), and the decoder's
bucket-centre reconstruction plays the role of the paper's round-half-down bias.
tests/test_lynx.py proves the widths with hypothesis on arbitrary inputs incl. extremes.

Wire layout of chunk (layer l, page p) with n tokens, nc = ceil(n / chunk_tokens) chunks,
channels = 2*kv_heads*head_dim, all little-endian, C-order:
    anchor:  lo fp32 [2, H, D] | token scales fp16 [T_kv, H, n] (oscar only; T_kv = 2 for
             targets "kv", 1 for "k") | mu uint16 [2, H, nc, D] | sigma fp16 [2, H, nc, D] |
             k int8 [2, H, D] | codes: 2H rows of ceil(n*D*b0/8) bytes
    residual j: codes: 2H rows of ceil(n*D*b_j/8) bytes
A row packs the codes of one (K|V, head) in token-major order [n, D], b bits each,
little-end first (bit i of the row = bit i%8 of byte i//8), zero-padded at the row end.
The last page (and its last chunk) may be shorter: statistics then run over the tokens present.
Metadata is 1 + 40 / page_tokens bits per element at the defaults (32-token chunks).

OScaR preconditioning (`precondition: oscar`): Hadamard rotation per head over head_dim,
then per-token L2-norm scaling (one fp16 scale per token per head, in the anchor stream),
before the hierarchy; applied to K and V (`oscar_targets: kv`) or K only (`k`). Decode
undoes the scaling then the rotation, so decode returns unrotated K/V and callers need not
rotate queries. The preconditioning runs as torch ops (on the tensor's device) for the torch
and triton backends; the cpu backend runs it (and its inverse) as numba kernels with the
same bits (lynx_cpu.oscar_forward_cpu / oscar_inverse_cpu).

Backends (`backend`: auto | torch | cpu | triton) all produce identical bytes; auto uses the
Triton kernels for CUDA tensors and the numba kernel for CPU tensors. `backend` is an
execution choice, not a format parameter, so it is left out of the preamble (params_dict).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.codec import (
    CodecError,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

# alpha of the companding (the paper does not state it): chunk max-abs centering already
# removes most of the dynamic range, so mild companding wins; 4 is near the best anchor-only
# and full-precision error on outlier data (the measured sweep: docs/codecs/lynx.md).
ALPHA_DEFAULT = 4.0

MU_FRAC_BITS = 14  # mu is stored as uint16 fixed point with 14 fractional bits (x' < 4)
K_MIN, K_MAX = -126, 126  # page scale 2^k stays a normal fp32 for both 2^-k and 2^(k+1)
OSCAR_MAX_ABS = 2.0**100  # fp32 Hadamard sums of |x| < 2^100 over head_dim cannot overflow
MAX_CHUNK_TOKENS = 4096  # integer sums of 16-bit fixed point values fit int32
# decode clamps the hierarchy's output to +-2^64 before undoing oscar: then scaling by an
# fp16 norm (< 2^16) and the Hadamard sums over head_dim (<= 2^12) stay finite in fp32.
# Valid caches never reach it (preconditioned values are about +-1); forged metadata can.
OSCAR_DECODE_MAX = 2.0**64
BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class LynxParams:
    page_tokens: int = 256
    chunk_tokens: int = 32
    split: tuple[int, ...] = (4, 4)  # bits per stream, first includes the sign
    alpha: float = ALPHA_DEFAULT
    precondition: str = "none"  # none | oscar
    oscar_targets: str = "kv"  # kv | k: which of K, V the oscar preconditioner applies to
    backend: str = "auto"  # auto | torch | cpu | triton (not part of the wire format)

    def __post_init__(self) -> None:
        if isinstance(self.split, (int, np.integer)):
            raise ValueError(f"split must be a list of bit widths, got {self.split!r}")
        split = tuple(int(b) for b in self.split)
        object.__setattr__(self, "split", split)
        object.__setattr__(self, "alpha", float(self.alpha))
        if not split:
            raise ValueError("split must name at least one stream")
        if any(b < 1 or b > 8 for b in split):
            raise ValueError(f"split widths must be in 1..8 bits, got {list(split)}")
        if split[0] < 2:
            raise ValueError(f"split[0] holds the sign plus >= 1 magnitude bit: needs >= 2, "
                             f"got {split[0]}")
        if sum(split) > 8:
            raise ValueError(f"split {list(split)} totals {sum(split)} bits; at most 8 "
                             "(sign + 7-bit magnitude)")
        if self.page_tokens < 1 or self.chunk_tokens < 1:
            raise ValueError("page_tokens and chunk_tokens must be >= 1")
        if self.chunk_tokens % 8:
            raise ValueError(f"chunk_tokens must be a multiple of 8 (chunks then start on a "
                             f"byte boundary at any bit width), got {self.chunk_tokens}")
        if self.chunk_tokens > MAX_CHUNK_TOKENS:
            raise ValueError(f"chunk_tokens must be <= {MAX_CHUNK_TOKENS}")
        if self.page_tokens % self.chunk_tokens:
            raise ValueError(f"page_tokens ({self.page_tokens}) must be a multiple of "
                             f"chunk_tokens ({self.chunk_tokens})")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha must be a positive finite number, got {self.alpha}")
        if self.precondition not in ("none", "oscar"):
            raise ValueError(f"precondition must be 'none' or 'oscar', got {self.precondition!r}")
        if self.oscar_targets not in ("kv", "k"):
            raise ValueError(f"oscar_targets must be 'kv' or 'k', got {self.oscar_targets!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def mag_bits(self) -> int:
        return sum(self.split) - 1


# ---- quantizer tables (shared by every backend) ------------------------------------------
@dataclass(frozen=True, eq=False)  # hashed by identity (tables are lru-cached)
class LynxTables:
    """Everything data-independent the quantizer and the decoder need, fp32 from float64.

    thresholds: [2^M - 1] ascending; code(u) = #{t < u}.
    lut_*: a lookup table over the fp32 bit pattern of u, with at most one threshold per cell:
    cell = min(max(bits(u) - lut_lo, 0) >> lut_shift, cells - 1) (cell 0 also holds every u
    below 2^floor(log2 t_1), the last cell [1, inf)), code = lut_base[cell] + (u > lut_thr[cell]).
    Offsetting by lut_lo keeps the table small enough for L1 (a few hundred cells).
    recon[s-1]: [2^(magnitude bits known after s streams)] magnitude in [0, 1]: the companding
    inverse L(y) = ((1+alpha)^(y/(2^M-1)) - 1)/alpha (paper Eq. 4) at the centre code of the
    interval the known bits leave (the code itself once all streams arrived).
    """

    split: tuple[int, ...]
    mag_bits: int
    thresholds: np.ndarray
    lut_lo: int
    lut_shift: int
    lut_base: np.ndarray
    lut_thr: np.ndarray
    recon: tuple[np.ndarray, ...]

    @property
    def lut_cells(self) -> int:
        return int(self.lut_base.shape[0])

    def field_shift(self, stream: int) -> int:
        """Right shift of the magnitude code that brings stream `stream`'s bits to bit 0."""
        known = sum(self.split[: stream + 1]) - 1
        return self.mag_bits - known

    def torch_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        return _torch_tables(self, str(device))


# Partial reconstructions whose magnitude is known to at least this many bits put their top
# bucket at |u| = 1 (see lynx_tables).
TOP_AT_ONE_MIN_BITS = 2


@functools.lru_cache(maxsize=64)
def lynx_tables(alpha: float, split: tuple[int, ...]) -> LynxTables:
    m = sum(split) - 1
    top = (1 << m) - 1  # the paper's 2^7 - 1 for M = 7
    i = np.arange(1, top + 1, dtype=np.float64)
    t64 = np.expm1((i - 0.5) / top * np.log1p(alpha)) / alpha
    thr = t64.astype(np.float32)
    if not (np.all(np.diff(thr) > 0) and thr[0] > 0 and thr[-1] < 1):
        raise CodecError(f"lynx: alpha={alpha} makes fp32 thresholds collide for {m} bits")
    tbits = thr.view(np.uint32).astype(np.int64)
    one_bits = int(np.float32(1.0).view(np.uint32))
    lut_lo = int(tbits[0] >> 23) << 23  # bits of the largest power of two <= t_1
    for mant_bits in range(4, 24):
        shift = 23 - mant_bits
        cells = ((one_bits - lut_lo) >> shift) + 1
        cell_of = np.minimum((tbits - lut_lo) >> shift, cells - 1)
        if np.bincount(cell_of, minlength=cells).max() <= 1:
            break
    else:  # pragma: no cover - thresholds are distinct fp32 values, 23 bits always separate
        raise CodecError(f"lynx: no lookup table for alpha={alpha}")
    starts = lut_lo + (np.arange(cells, dtype=np.int64) << shift)
    base = np.searchsorted(tbits, starts, side="left").astype(np.uint8)
    lut_thr = np.full(cells, np.inf, dtype=np.float32)
    lut_thr[cell_of] = thr
    recon = []  # |x^| = L(centre code of the interval the known bits allow), L = Eq. 4
    known = 0
    for s, b in enumerate(split):
        known += b - (1 if s == 0 else 0)
        width = 1 << (m - known)
        centre = (np.arange(1 << known) * width + (width - 1) / 2) / top
        levels = (np.expm1(centre * np.log1p(alpha)) / alpha).astype(np.float32)
        if s < len(split) - 1 and known >= TOP_AT_ONE_MIN_BITS:
            # Every chunk's max-abs element sits at |u| = 1 (code 2^M - 1) by construction,
            # so a narrow top bucket is mostly those elements: reconstruct it at 1, not at
            # its centre (which shrinks each chunk's largest value by ~11 % for a 3-bit
            # magnitude anchor). A wide top bucket (1 magnitude bit) holds mostly non-max
            # elements and keeps its centre. The errors behind both: docs/codecs/lynx.md.
            levels[-1] = 1.0
        recon.append(levels)
    return LynxTables(tuple(split), m, thr, lut_lo, shift, base, lut_thr, tuple(recon))


@functools.lru_cache(maxsize=256)
def signed_values(tab: LynxTables, streams: int) -> np.ndarray:
    """fp32 [2^(b0 + ... + b_{streams-1})]: decoded value (sign * bucket centre, in units of
    sigma) for every concatenation key = f0 << (b1 + ...) | f1 << ... | f_{streams-1} of the
    raw stream fields; one gather per element in the fast decoders."""
    widths = tab.split[:streams]
    keys = np.arange(1 << sum(widths), dtype=np.int64)
    fields, rest = [], keys
    for b in reversed(widths):
        fields.append(rest & ((1 << b) - 1))
        rest = rest >> b
    fields.reverse()
    neg, prefix = join_fields([torch.from_numpy(f) for f in fields], tab)
    mag = tab.recon[streams - 1][prefix.numpy()]
    return np.where(neg.numpy(), -mag, mag).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _torch_tables(tab: LynxTables, device: str) -> dict[str, torch.Tensor]:
    return {
        "thresholds": torch.from_numpy(tab.thresholds).to(device),
        "lut_base": torch.from_numpy(tab.lut_base.astype(np.int32)).to(device),
        "lut_thr": torch.from_numpy(tab.lut_thr).to(device),
        "recon": [torch.from_numpy(r).to(device) for r in tab.recon],
    }


# ---- layout of the bytes ------------------------------------------------------------------
@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one chunk (layer x page) of every stream, for a page of `tokens`."""

    tokens: int
    chunks: int
    lo_off: int
    scale_off: int
    mu_off: int
    sigma_off: int
    k_off: int
    code_off: tuple[int, ...]  # per stream: where the packed codes start in the chunk
    row_bytes: tuple[int, ...]  # per stream: bytes of one (K|V, head) row of codes
    chunk_bytes: tuple[int, ...]  # per stream: payload bytes of the chunk


@dataclass(frozen=True)
class LynxLayout:
    shape: KVShape
    page_tokens: int
    chunk_tokens: int
    split: tuple[int, ...]
    scale_kv: int  # 0 (no oscar), 1 (K only) or 2 (K and V) token-scale planes
    pages: int
    full: PageLayout | None  # layout of pages 0 .. pages-2 (None when pages == 1)
    last: PageLayout

    @property
    def full_pages(self) -> int:
        return self.pages - 1

    def page(self, p: int) -> PageLayout:
        return self.last if p == self.pages - 1 else self.full  # type: ignore[return-value]

    def layer_bytes(self, stream: int) -> int:
        full = self.full.chunk_bytes[stream] if self.full else 0
        return full * self.full_pages + self.last.chunk_bytes[stream]

    def chunk_offset(self, stream: int, layer: int, page: int) -> int:
        """Offset of chunk (layer, page) in the stream buffer (chunks in (layer, page) order)."""
        full = self.full.chunk_bytes[stream] if self.full else 0
        return layer * self.layer_bytes(stream) + page * full

    def chunk_tokens_of(self, chunk: int) -> int:
        return min(self.chunk_tokens, self.shape.tokens - chunk * self.chunk_tokens)

    @property
    def total_chunks(self) -> int:
        return -(-self.shape.tokens // self.chunk_tokens)


def make_layout(shape: KVShape, p: LynxParams) -> LynxLayout:
    pages = -(-shape.tokens // p.page_tokens)
    scale_kv = 0 if p.precondition == "none" else (2 if p.oscar_targets == "kv" else 1)

    def page_layout(n: int) -> PageLayout:
        h, d = shape.kv_heads, shape.head_dim
        ch = 2 * h * d
        nc = -(-n // p.chunk_tokens)
        lo_off = 0
        scale_off = lo_off + 4 * ch
        mu_off = scale_off + 2 * scale_kv * h * n
        sigma_off = mu_off + 2 * ch * nc
        k_off = sigma_off + 2 * ch * nc
        meta = k_off + ch
        rows = tuple(-(-n * d * b // 8) for b in p.split)
        code_off = (meta,) + (0,) * (len(p.split) - 1)
        sizes = tuple(code_off[s] + 2 * h * rows[s] for s in range(len(p.split)))
        return PageLayout(n, nc, lo_off, scale_off, mu_off, sigma_off, k_off, code_off, rows,
                          sizes)

    last_n = shape.tokens - (pages - 1) * p.page_tokens
    full = page_layout(p.page_tokens) if pages > 1 else None
    return LynxLayout(shape, p.page_tokens, p.chunk_tokens, p.split, scale_kv, pages, full,
                      page_layout(last_n))


# ---- the quantized state every backend produces / consumes --------------------------------
@dataclass
class LynxArrays:
    """Metadata of a whole cache plus the stream buffers (packed codes already in place).

    lo: [L, pages, 2, H, D] fp32; k: [L, pages, 2, H, D] int8; mu: [L, 2, H, chunks, D]
    uint16 (stored as int16 bits in torch); sigma: [L, 2, H, chunks, D] fp16;
    scales: [L, T_kv, H, T] fp16 or None; buffers[s]: [L * layer_bytes(s)] uint8 whose code
    regions are filled (metadata regions are filled by `write_metadata`).
    """

    lo: torch.Tensor
    k: torch.Tensor
    mu: torch.Tensor
    sigma: torch.Tensor
    scales: torch.Tensor | None
    buffers: list[torch.Tensor]


def alloc_buffers(lay: LynxLayout, device: torch.device | str) -> list[torch.Tensor]:
    return [torch.empty(lay.shape.layers * lay.layer_bytes(s), dtype=torch.uint8, device=device)
            for s in range(len(lay.split))]


def _region(buf: torch.Tensor, lay: LynxLayout, stream: int, last: bool, off: int,
            nbytes: int) -> torch.Tensor:
    """View [L, pages_in_group, nbytes] of bytes [off, off + nbytes) of every chunk of the
    full pages (last=False) or [L, 1, nbytes] of the last page."""
    layer_b = lay.layer_bytes(stream)
    full_b = lay.full.chunk_bytes[stream] if lay.full else 0
    if last:
        start = (lay.pages - 1) * full_b + off
        return buf.as_strided((lay.shape.layers, 1, nbytes), (layer_b, 1, 1), start)
    return buf.as_strided((lay.shape.layers, lay.full_pages, nbytes), (layer_b, full_b, 1), off)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[..., n] any dtype -> [..., n * itemsize] uint8 (contiguous)."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(*t.shape[:-1], -1)


def code_regions(buf: torch.Tensor, lay: LynxLayout, stream: int
                 ) -> list[tuple[PageLayout, int, torch.Tensor]]:
    """[(page layout, first page, view [L, pages_in_group, 2H, row_bytes])] for the full
    pages and the last page of a stream buffer."""
    out = []
    h2 = 2 * lay.shape.kv_heads
    for last, pl, first in ((False, lay.full, 0), (True, lay.last, lay.pages - 1)):
        if pl is None or (not last and lay.full_pages == 0):
            continue
        rb = pl.row_bytes[stream]
        view = _region(buf, lay, stream, last, pl.code_off[stream], h2 * rb)
        out.append((pl, first, view.unflatten(2, (h2, rb))))
    return out


def _page_groups(lay: LynxLayout):
    """(page layout, last?, page slice, chunk slice) for the full pages and the last page."""
    cpp = lay.page_tokens // lay.chunk_tokens
    if lay.full_pages:
        yield lay.full, False, slice(0, lay.full_pages), slice(0, lay.full_pages * cpp)
    yield lay.last, True, slice(lay.pages - 1, lay.pages), slice(lay.full_pages * cpp, None)


def write_metadata(arr: LynxArrays, lay: LynxLayout) -> None:
    """Copy the metadata arrays into the anchor buffer's metadata regions (vectorized)."""
    buf = arr.buffers[0]
    L, H, D = lay.shape.layers, lay.shape.kv_heads, lay.shape.head_dim
    for pl, last, ps, cs in _page_groups(lay):
        npg = ps.stop - ps.start
        lo = arr.lo[:, ps].reshape(L, npg, -1)
        _region(buf, lay, 0, last, pl.lo_off, lo.shape[-1] * 4).copy_(_as_bytes(lo))
        k = arr.k[:, ps].reshape(L, npg, -1)
        _region(buf, lay, 0, last, pl.k_off, k.shape[-1]).copy_(_as_bytes(k))
        for src, off in ((arr.mu, pl.mu_off), (arr.sigma, pl.sigma_off)):
            m = src[:, :, :, cs].reshape(L, 2, H, npg, pl.chunks, D).permute(0, 3, 1, 2, 4, 5)
            m = m.reshape(L, npg, -1)
            _region(buf, lay, 0, last, off, m.shape[-1] * 2).copy_(_as_bytes(m))
    if arr.scales is not None:
        write_scales(buf, arr.scales, lay)


def write_scales(buf: torch.Tensor, scales: torch.Tensor, lay: LynxLayout) -> None:
    """Copy oscar token scales [L, T_kv, H, T] fp16 into the anchor buffer."""
    L, H = lay.shape.layers, lay.shape.kv_heads
    for pl, last, ps, _ in _page_groups(lay):
        npg = ps.stop - ps.start
        t0 = ps.start * lay.page_tokens
        sc = scales[..., t0: t0 + npg * pl.tokens]
        sc = sc.reshape(L, lay.scale_kv, H, npg, pl.tokens).permute(0, 3, 1, 2, 4)
        sc = sc.reshape(L, npg, -1)
        _region(buf, lay, 0, last, pl.scale_off, sc.shape[-1] * 2).copy_(_as_bytes(sc))


def read_metadata(buf: torch.Tensor, lay: LynxLayout) -> LynxArrays:
    """Inverse of write_metadata: metadata arrays from an anchor stream buffer."""
    L, H, D = lay.shape.layers, lay.shape.kv_heads, lay.shape.head_dim
    dev = buf.device
    lo = torch.empty(L, lay.pages, 2, H, D, dtype=torch.float32, device=dev)
    k = torch.empty(L, lay.pages, 2, H, D, dtype=torch.int8, device=dev)
    mu = torch.empty(L, 2, H, lay.total_chunks, D, dtype=torch.int16, device=dev)
    sigma = torch.empty(L, 2, H, lay.total_chunks, D, dtype=torch.float16, device=dev)
    for pl, last, ps, cs in _page_groups(lay):
        npg = ps.stop - ps.start
        ch = 2 * H * D

        def grab(off: int, n: int, dtype: torch.dtype, pl=pl, last=last) -> torch.Tensor:
            raw = _region(buf, lay, 0, last, off, n * _itemsize(dtype))
            return raw.reshape(-1).clone().view(dtype)  # fresh storage: aligned offset

        lo[:, ps] = grab(pl.lo_off, ch, torch.float32).view(L, npg, 2, H, D)
        k[:, ps] = grab(pl.k_off, ch, torch.int8).view(L, npg, 2, H, D)
        for dst, off, dt in ((mu, pl.mu_off, torch.int16), (sigma, pl.sigma_off, torch.float16)):
            m = grab(off, ch * pl.chunks, dt).view(L, npg, 2, H, pl.chunks, D)
            dst[:, :, :, cs] = m.permute(0, 2, 3, 1, 4, 5).reshape(L, 2, H, -1, D)
    return LynxArrays(lo, k, mu, sigma, read_scales(buf, lay), [buf])


def read_scales(buf: torch.Tensor, lay: LynxLayout) -> torch.Tensor | None:
    """oscar token scales [L, T_kv, H, T] fp16 from an anchor buffer (None without oscar)."""
    if not lay.scale_kv:
        return None
    L, H = lay.shape.layers, lay.shape.kv_heads
    scales = torch.empty(L, lay.scale_kv, H, lay.shape.tokens, dtype=torch.float16,
                         device=buf.device)
    for pl, last, ps, _ in _page_groups(lay):
        npg = ps.stop - ps.start
        t0 = ps.start * lay.page_tokens
        n = lay.scale_kv * H * pl.tokens
        sc = _region(buf, lay, 0, last, pl.scale_off, 2 * n).reshape(-1).clone()
        sc = sc.view(torch.float16)
        sc = sc.view(L, npg, lay.scale_kv, H, pl.tokens).permute(0, 2, 3, 1, 4)
        scales[..., t0: t0 + npg * pl.tokens] = sc.reshape(L, lay.scale_kv, H, -1)
    return scales


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- stream fields of a sign + magnitude code ------------------------------------------
def split_fields(sign: torch.Tensor, code: torch.Tensor, tab: LynxTables) -> list[torch.Tensor]:
    """sign (bool), code (int magnitude) -> one uint8 field per stream (see module doc)."""
    out = []
    for s, b in enumerate(tab.split):
        sh = tab.field_shift(s)
        if s == 0:
            f = (code >> sh) | (sign.to(code.dtype) << (b - 1))
        else:
            f = ((code >> sh) & ((1 << b) - 1)) ^ (1 << (b - 1))
        out.append(f.to(torch.uint8))
    return out


def join_fields(fields: list[torch.Tensor], tab: LynxTables) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of split_fields on the first len(fields) streams -> (negative?, prefix)."""
    b0 = tab.split[0]
    a = fields[0].to(torch.int32)
    neg = (a >> (b0 - 1)) != 0
    prefix = a & ((1 << (b0 - 1)) - 1)
    for s in range(1, len(fields)):
        b = tab.split[s]
        prefix = (prefix << b) | (fields[s].to(torch.int32) ^ (1 << (b - 1)))
    return neg, prefix
