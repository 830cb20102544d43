"""Fast CPU pieces of the KIVI backbone (kivi / kcvt / gear / oscar): numba kernels that are
byte-identical to the torch reference in groupquant.py and bitpack.py.

On CPU, the torch path's time (8x8x2048x128 bf16) goes to bit packing (int32 widen + shift
+ sum over a tiny last dim), unpacking, and the fp32 temporaries of the quantizer /
dequantizer, not to the arithmetic. These kernels do each in one pass:

- quantize_rows: x [rows, n] fp32 -> codes uint8 [rows, n], scale16 / zero16 fp16
  [rows, n / group] and the reconstruction x_hat [rows, n] fp32, the exact op sequence of
  groupquant.quantize_groups + dequantize_groups (IEEE fp32, no FMA contraction; only the
  order-free min / max may be reordered):
      mn, mx  = group min, max (+ 0.0: -0.0 -> +0.0)
      scale16 = fp16((mx - mn) / qmax)      zero16 = fp16(mn)     (nearest even)
      code    = clamp(floor((x - zero16) / scale16 + 0.5), 0, qmax), 0 when scale16 == 0
      x_hat   = zero16 + code * scale16
  floor then clamp == clamp then truncate (0 and qmax are integers).
- dequantize_rows: codes uint8 [rows, n], fp16 scale / zero [rows, n / group] -> fp32.

The whole-cache quantizer runs its rows and the page decoder its (K|V, head) blocks in
parallel (numba prange); pack / unpack (many small calls, each a fraction of a page's work)
run serially, because waking numba's OpenMP pool that often, interleaved with torch's own
pool on few cores, cost more than the work. These per-page pieces serve the configurations
the fused path below leaves to BackboneCodec's generic path (gear 'exact' outliers and
'sequence' fits).

The fused path (encode_fused / decode_fused, the default for CPU tensors): one parallel
kernel writes every chunk payload of the cache straight from the bf16 bits (gear's outliers,
low-rank fits and oscar's rotations and per-token norms inside it), one writes the decoded
cache in the output dtype; see "fused whole-cache encode / decode" below.
tests/test_kivi_cpu.py checks bytes and decoded bits against torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from kvsim.kernels.fp16_bits import (
    f16_bits_to_f32_bits,
    f16_bits_to_f32_rows,
    f32_bits_to_f16_bits,
    f32_to_f16_bits_rows,
)
from kvsim.kernels.groupquant import qmax_of
from kvsim.kernels.kivi.geometry import (
    G_BASE,
    G_KC,
    G_KK,
    G_KN,
    G_KOI,
    G_KOV,
    G_KR,
    G_KS,
    G_KV,
    G_KZ,
    G_LA,
    G_LB,
    G_QK,
    G_QV,
    G_RANK,
    G_RK,
    G_RV,
    G_T0,
    G_VC,
    G_VN,
    G_VOI,
    G_VOV,
    G_VR,
    G_VS,
    G_VZ,
)
from kvsim.kernels.uniform.cpu import group_minmax, quantize_group

_JIT = dict(cache=True, nogil=True, error_model="numpy")


@numba.njit(parallel=True, **_JIT)
def _quantize_kernel(x, G, qmax_i, codes, sbits, zbits, xhat, with_xhat):
    """x: [rows, n] fp32 contiguous; writes codes [rows, n] uint8, sbits / zbits
    [rows, n // G] uint16 (fp16 bits), and xhat [rows, n] fp32 if with_xhat."""
    rows, n = x.shape
    ng = n // G
    qmax = np.float32(qmax_i)
    for r in numba.prange(rows):
        xr = x[r]
        cr = codes[r]
        tmp = np.empty(2, np.float32)  # scratch for quantize_group's bit round trips
        for g in range(ng):
            a = g * G
            b = a + G
            hs, hz, _lo, _hi, s, z = quantize_group(xr, a, b, qmax, tmp, cr)
            sbits[r, g] = np.uint16(hs)
            zbits[r, g] = np.uint16(hz)
            if with_xhat:  # z + code * s; a constant group: -0.0 + 0 * 0 = +0.0, as torch
                for i in range(a, b):
                    xhat[r, i] = z + np.float32(cr[i]) * s


@numba.njit(parallel=True, **_JIT)
def _dequantize_kernel(codes, sbits, zbits, G, out):
    """codes [rows, n] uint8, sbits / zbits [rows, n // G] uint16 fp16 bits -> out fp32."""
    rows, n = codes.shape
    ng = n // G
    for r in numba.prange(rows):
        tmp = np.empty(2, np.float32)
        tmpu = tmp.view(np.uint32)
        for g in range(ng):
            tmpu[0] = np.uint32(f16_bits_to_f32_bits(np.int64(sbits[r, g])))
            tmpu[1] = np.uint32(f16_bits_to_f32_bits(np.int64(zbits[r, g])))
            s = tmp[0]
            z = tmp[1]
            for i in range(g * G, (g + 1) * G):
                out[r, i] = z + np.float32(codes[r, i]) * s


def _rows(x: torch.Tensor, group: int) -> tuple[np.ndarray, int]:
    n = int(x.shape[-1])
    if group < 1 or n % group:
        raise ValueError(f"last dim {n} is not a multiple of the group size {group}")
    rows = int(np.prod(x.shape[:-1])) if x.dim() > 1 else 1
    return x.reshape(rows, n).numpy(), n


def _fp16(bits_u16: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(bits_u16.view(np.int16)).view(torch.float16).reshape(shape)


def quantize_rows(x: torch.Tensor, group: int, bits: int, with_xhat: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x: [..., n] CPU float (n % group == 0) -> (codes uint8 [..., n], scale16, zero16 fp16
    [..., n // group], x_hat fp32 [..., n] or None unless with_xhat); equal to
    groupquant.quantize_groups followed by dequantize_groups."""
    qmax = qmax_of(bits)
    xf = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
    x2, n = _rows(xf, group)
    rows = x2.shape[0]
    codes = np.empty((rows, n), np.uint8)
    sb = np.empty((rows, n // group), np.uint16)
    zb = np.empty((rows, n // group), np.uint16)
    xhat = np.empty((rows, n) if with_xhat else (1, 1), np.float32)
    if rows and n:
        _quantize_kernel(x2, group, qmax, codes, sb, zb, xhat, with_xhat)
    meta = (*x.shape[:-1], n // group)
    return (torch.from_numpy(codes).reshape(x.shape), _fp16(sb, meta), _fp16(zb, meta),
            torch.from_numpy(xhat).reshape(x.shape) if with_xhat else None)


def dequantize_rows(codes: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor,
                    group: int) -> torch.Tensor:
    """groupquant.dequantize_groups on CPU: codes [..., n] uint8 -> fp32 [..., n]."""
    c2, n = _rows(codes.detach().cpu().to(torch.uint8).contiguous(), group)
    rows = c2.shape[0]
    meta = (rows, n // group)

    def bits16(t: torch.Tensor) -> np.ndarray:
        t = t.detach().cpu().to(torch.float16).contiguous().view(torch.int16)
        return t.numpy().view(np.uint16).reshape(meta)

    out = np.empty((rows, n), np.float32)
    if rows and n:
        _dequantize_kernel(c2, bits16(scale16), bits16(zero16), group, out)
    return torch.from_numpy(out).reshape(codes.shape)


@numba.njit(inline="always", **_JIT)
def _f16_at(src, o):
    """fp16 (little-endian bytes src[o], src[o + 1]) -> its fp32 bit pattern (int64)."""
    return f16_bits_to_f32_bits(np.int64(src[o]) | (np.int64(src[o + 1]) << 8))


@numba.njit(parallel=True, **_JIT)
def _page_decode_kernel(src, kc_at, kmeta, ks_at, kz_at, KG, vc_at, vs_at, vz_at, VG, bits,
                        out):
    """One chunk's backbone fields -> out [2, H, q, D] fp32 (any strides).
    src: the chunk payload; kmeta: the payload holding the K scales (kcvt: page 0's).
    K codes [H, D, q] (channel-major) with fp16 scale / zero [H, D, q // KG] at ks_at / kz_at;
    V codes [H, q, D] with fp16 scale / zero [H, q, D // VG]. Codes are bit-packed over the
    flattened field, little end first. x_hat = zero16 + code * scale16 (fp32)."""
    _, H, q, D = out.shape
    lp = 2 if bits == 2 else (1 if bits == 4 else 0)  # log2(codes per byte)
    pm = (1 << lp) - 1
    mask = (1 << bits) - 1
    nkg = q // KG
    nvg = D // VG
    for w in numba.prange(2 * H):
        h = w % H
        tmp = np.empty(2, np.float32)
        tmpu = tmp.view(np.uint32)
        if w < H:  # keys
            for c in range(D):
                for g in range(nkg):
                    m = ((h * D + c) * nkg + g) * 2
                    tmpu[0] = np.uint32(_f16_at(kmeta, ks_at + m))
                    tmpu[1] = np.uint32(_f16_at(kmeta, kz_at + m))
                    s = tmp[0]
                    z = tmp[1]
                    for t in range(g * KG, (g + 1) * KG):
                        i = (h * D + c) * q + t
                        code = (np.int32(src[kc_at + (i >> lp)]) >> ((i & pm) * bits)) & mask
                        out[0, h, t, c] = z + np.float32(code) * s
        else:  # values
            for t in range(q):
                for g in range(nvg):
                    m = ((h * q + t) * nvg + g) * 2
                    tmpu[0] = np.uint32(_f16_at(src, vs_at + m))
                    tmpu[1] = np.uint32(_f16_at(src, vz_at + m))
                    s = tmp[0]
                    z = tmp[1]
                    for c in range(g * VG, (g + 1) * VG):
                        i = (h * q + t) * D + c
                        code = (np.int32(src[vc_at + (i >> lp)]) >> ((i & pm) * bits)) & mask
                        out[1, h, t, c] = z + np.float32(code) * s


def decode_page(src: np.ndarray, offsets: dict[str, int], kmeta: np.ndarray,
                kmeta_offsets: dict[str, int], key_group: int, value_group: int, bits: int,
                out: torch.Tensor) -> None:
    """Dequantize the backbone fields of one chunk payload `src` straight into `out`
    ([2, heads, q, head_dim] fp32 CPU tensor, may be a strided view). offsets: byte offset
    of each field in src; kmeta / kmeta_offsets: the payload (and its offsets) holding the K
    scales and zero points (kcvt keeps them in page 0). Same values as
    Backbone.dequantize_page on the parsed fields."""
    qmax_of(bits)
    if out.dtype != torch.float32 or out.device.type != "cpu" or out.dim() != 4:
        raise ValueError("decode_page writes a [2, heads, q, head_dim] fp32 CPU tensor")
    _, _, q, d = out.shape
    if q == 0:
        return
    if key_group < 1 or q % key_group or value_group < 1 or d % value_group:
        raise ValueError(f"decode_page: q={q}, head_dim={d} not multiples of the groups "
                         f"{key_group}, {value_group}")
    _page_decode_kernel(src, offsets["k_codes"], kmeta, kmeta_offsets["k_scale"],
                        kmeta_offsets["k_zero"], key_group, offsets["v_codes"],
                        offsets["v_scale"], offsets["v_zero"], value_group, bits, out.numpy())


# ---- fused whole-cache encode / decode ---------------------------------------------------
# The codec-level CPU path (kivi.py BackboneCodec._encode_fused / _decode_fused): one numba
# call writes every chunk payload of the cache, one reads them all back. No fp32 copy of
# the cache, no unpacked codes, no per-page torch calls. Work item = (layer, page, K|V,
# head): a head-page of q quantized + r bf16 tokens, loaded once into a thread-local fp32
# [q, D] buffer (bf16 input straight from its bits) where gear's outliers and oscar's
# rotations and norms happen before it is quantized; all heads of a (layer, page, K|V) in
# one item when the packed codes of two heads would share a byte (D * q not a multiple of the codes
# per byte), so that no two threads ever write the same byte. Page geometry `geo`: see
# kivi/geometry.py.
K_TILE = 32  # kcvt: tokens per key tile (its groups span the whole layer)


@numba.njit(inline="always", **_JIT)
def _bits_f32(u, tmp):
    """fp32 bit pattern (int) -> fp32 value, through tmp (fp32[2] scratch, slot 0)."""
    tmp.view(np.uint32)[0] = np.uint32(u)
    return tmp[0]


@numba.njit(inline="always", **_JIT)
def _f32_bits(v, tmp):
    """fp32 value -> its bit pattern (int64), through tmp (fp32[2] scratch, slot 0)."""
    tmp[0] = v
    return np.int64(tmp.view(np.uint32)[0])


@numba.njit(inline="always", **_JIT)
def _h2f(src, o, tmp):
    """The little-endian fp16 at bytes src[o], src[o + 1] as fp32."""
    return _bits_f32(f16_bits_to_f32_bits(np.int64(src[o]) | (np.int64(src[o + 1]) << 8)), tmp)


@numba.njit(inline="always", **_JIT)
def _scale_zero(lo, hi, qmax, tmp):
    """Group min / max -> (scale16 bits, zero16 bits, scale, zero as fp32): the op sequence
    of uniform_cpu.quantize_group (signs of zero normalized, fp16 round trips)."""
    zero = np.float32(0.0)
    tmpu = tmp.view(np.uint32)
    lo = lo + zero
    hi = hi + zero
    tmp[0] = (hi - lo) / qmax
    tmp[1] = lo
    hs = f32_bits_to_f16_bits(np.int64(tmpu[0]))
    hz = f32_bits_to_f16_bits(np.int64(tmpu[1]))
    tmpu[0] = np.uint32(f16_bits_to_f32_bits(hs))
    tmpu[1] = np.uint32(f16_bits_to_f32_bits(hz))
    return hs, hz, tmp[0], tmp[1]


@numba.njit(inline="always", **_JIT)
def _code(v, s, z, qmax):
    """One code: clamp(floor((v - z) / s + 0.5), 0, qmax); 0 when s == 0. Selects, not
    branches (the loops over a row vectorize); dividing by 1 where s == 0 is discarded."""
    zero = np.float32(0.0)
    live = s > zero
    w = (v - z) / (s if live else np.float32(1.0)) + np.float32(0.5)
    w = w if w > zero else zero
    w = w if w < qmax else qmax
    return np.int32(w) if live else np.int32(0)


@numba.njit(inline="always", **_JIT)
def _put16(out, o, h):
    """Little-endian 16-bit value h at byte o."""
    out[o] = np.uint8(h & 0xFF)
    out[o + 1] = np.uint8((h >> 8) & 0xFF)


@numba.njit(inline="always", **_JIT)
def _get16(src, o):
    return np.int64(src[o]) | (np.int64(src[o + 1]) << 8)


@numba.njit(inline="always", **_JIT)
def _lane_peak(acc, row, D):
    """acc[c] = max(acc[c], |row[c]|) for c < D: per-lane maxima (a vector loop; a scalar
    running max would be a serial chain), reduced once by the caller."""
    for c in range(D):
        a = abs(row[c])
        acc[c] = a if a > acc[c] else acc[c]


@numba.njit(**_JIT)
def _put_run(out, base, i0, c, n, bits):
    """Bit-pack codes c[0:n] as codes i0 .. i0+n-1 of the field at byte `base` (little end
    first, bitpack.pack's order). Whole bytes are stored, bytes shared with a neighbouring
    run are OR-ed in (the buffer starts zeroed)."""
    if bits == 8:
        for i in range(n):
            out[base + i0 + i] = np.uint8(c[i])
        return
    per = 8 // bits
    i = 0
    while i < n and (i0 + i) % per != 0:
        j = i0 + i
        out[base + j // per] |= np.uint8(c[i] << ((j % per) * bits))
        i += 1
    b = base + (i0 + i) // per
    if bits == 2:
        while i + 4 <= n:
            out[b] = np.uint8(c[i] | (c[i + 1] << 2) | (c[i + 2] << 4) | (c[i + 3] << 6))
            b += 1
            i += 4
    else:
        while i + 2 <= n:
            out[b] = np.uint8(c[i] | (c[i + 1] << 4))
            b += 1
            i += 2
    while i < n:
        j = i0 + i
        out[base + j // per] |= np.uint8(c[i] << ((j % per) * bits))
        i += 1


@numba.njit(inline="always", **_JIT)
def _pack_row(out, base, c, n, bits):
    """_put_run(out, base, 0, c, n, bits) for bits 2 or 4 and n a multiple of 8 // bits:
    whole bytes only, in a counted loop over a view (vectorizes; _put_run's byte cursor
    does not)."""
    if bits == 2:
        ob = out[base: base + n // 4]
        c4 = c[:n].reshape((n // 4, 4))
        for i in range(n // 4):
            ob[i] = np.uint8(c4[i, 0] | (c4[i, 1] << 2) | (c4[i, 2] << 4) | (c4[i, 3] << 6))
    else:
        ob = out[base: base + n // 2]
        c2 = c[:n].reshape((n // 2, 2))
        for i in range(n // 2):
            ob[i] = np.uint8(c2[i, 0] | (c2[i, 1] << 4))


@numba.njit(inline="always", **_JIT)
def _pack_columns(out, base, stride, tile, n, D, bits, word):
    """Channel c's codes tile[0:n, c] (a K tile, token-major) as whole bytes at out[base +
    c * stride:], for bits 2 or 4 and n a multiple of 8 // bits: what _put_run writes per
    channel from an aligned start, built for all channels at once (loads along the row
    vectorize; one byte store per channel and byte) instead of gathering each channel's
    column. word: [D] int32 scratch."""
    per = 8 // bits
    for jb in range(n // per):
        r0 = tile[jb * per]
        for c in range(D):
            word[c] = r0[c]
        for u in range(1, per):
            ru = tile[jb * per + u]
            sh = np.int32(u * bits)
            for c in range(D):
                word[c] |= ru[c] << sh
        o = base + jb
        for c in range(D):
            out[o + c * stride] = np.uint8(word[c])


@numba.njit(inline="always", **_JIT)
def _get_code(src, base, i, bits):
    """Code i of the packed field at byte base."""
    if bits == 8:
        return np.int32(src[base + i])
    if bits == 4:
        return (np.int32(src[base + (i >> 1)]) >> ((i & 1) * 4)) & 15
    return (np.int32(src[base + (i >> 2)]) >> ((i & 3) * 2)) & 3


@numba.njit(inline="always", **_JIT)
def _load_row(sb, sf, use_bits, o, D, dst):
    """D source values at flat offset o (bf16 bits or fp32) -> dst[0:D] fp32."""
    if use_bits:
        du = dst.view(np.uint32)
        for c in range(D):
            du[c] = np.uint32(sb[o + c]) << np.uint32(16)
    else:
        for c in range(D):
            dst[c] = sf[o + c]


@numba.njit(**_JIT)
def _fwht_rows(buf, n, D, scale):
    """In place: the orthonormal Walsh-Hadamard transform of each row of buf[0:n] ([*, D],
    D a power of two): hadamard.hadamard's butterflies in its order (level h pairs (j, j + h)
    in blocks of 2h), then * scale, so bit-identical to the torch reference (as
    lynx_cpu.fwht_cpu). Levels 1, 2, 4 as unrolled 8-point blocks (the same sums and
    differences of the same operands), the longer levels as vector loops."""
    for r in range(n):
        y = buf[r]
        h = 1
        if D >= 8:
            for i in range(0, D, 8):
                x0, x1, x2, x3 = y[i], y[i + 1], y[i + 2], y[i + 3]
                x4, x5, x6, x7 = y[i + 4], y[i + 5], y[i + 6], y[i + 7]
                a0, a1, a2, a3 = x0 + x1, x0 - x1, x2 + x3, x2 - x3  # level 1
                a4, a5, a6, a7 = x4 + x5, x4 - x5, x6 + x7, x6 - x7
                b0, b1, b2, b3 = a0 + a2, a1 + a3, a0 - a2, a1 - a3  # level 2
                b4, b5, b6, b7 = a4 + a6, a5 + a7, a4 - a6, a5 - a7
                y[i], y[i + 1], y[i + 2], y[i + 3] = b0 + b4, b1 + b5, b2 + b6, b3 + b7  # 4
                y[i + 4], y[i + 5], y[i + 6], y[i + 7] = b0 - b4, b1 - b5, b2 - b6, b3 - b7
            h = 8
        while h < D:
            for i in range(0, D, 2 * h):
                for j in range(i, i + h):
                    a = y[j]
                    b = y[j + h]
                    y[j] = a + b
                    y[j + h] = a - b
            h *= 2
        for j in range(D):
            y[j] = y[j] * scale


@numba.njit(inline="always", **_JIT)
def _keep_extremes(v, i, tv, ti, r, n, m, top):
    """Insert value v (index i) into the sorted list tv[r] / ti[r] [0:n] (2-D lists, row r:
    a row view would cost a reference count per call) of at most m entries: largest first
    (top) or smallest first; an entry never passes an equal one, so ties keep the lower
    index first (visit indices in increasing order): torch.sort(stable=True)'s order,
    gear.extremes. Returns the new length."""
    if n == m:
        if (v > tv[r, m - 1]) if top else (v < tv[r, m - 1]):
            pos = m - 1
        else:
            return n
    else:
        pos = n
        n += 1
    while pos > 0 and ((v > tv[r, pos - 1]) if top else (v < tv[r, pos - 1])):
        tv[r, pos] = tv[r, pos - 1]
        ti[r, pos] = ti[r, pos - 1]
        pos -= 1
    tv[r, pos] = v
    ti[r, pos] = i
    return n


OUT_BLOCK = 8  # K outliers: tokens per block whose per-channel max / min gate a scan
OUT_LANES = 8  # V outliers: channel lanes (c % 8) whose maxima / minima bound a threshold


@numba.njit(**_JIT)
def _put_f16_rows(out, at, x):
    """x: fp32 [n] -> n little-endian fp16 (f32_bits_to_f16_bits of each) at bytes at ..
    at + 2n, rounded all at once in branch-free loops (f32_to_f16_bits_rows)."""
    n = x.shape[0]
    h16 = np.empty(n, np.uint16)
    f32_to_f16_bits_rows(x, h16, np.empty(n, np.float32))
    out[at: at + 2 * n] = h16.view(np.uint8)


@numba.njit(**_JIT)
def _page_outliers(buf, q, D, kv, k, h, out, idx_at, val_at, ib):
    """gear 'ceil' outliers of one head-page buf [q, D] (in place): the k top and k bottom
    entries of every K channel over the q tokens (kv 0) or of every V token over the D
    channels (kv 1), as gear.split_outliers picks them, stored as the idx / val fields at
    bytes idx_at / val_at (head h's part; index bytes ib), each slot then filled with
    clamp(0, (k+1)-th smallest, (k+1)-th largest).

    The m = k + 1 extremes of a vector come from _keep_extremes fed, in index order, only
    the entries >= a lower bound of its m-th largest (and <= an upper bound of its m-th
    smallest): those include all m extremes, in the same relative order, so the stable lists
    are those of the whole vector (the input is finite: the codec refuses NaN / inf). The
    bound is a value that m distinct entries reach, found with branch-free vector loops: K,
    per channel, the m-th largest of the maxima of its blocks of OUT_BLOCK tokens, and a
    block whose maximum is below the bound is skipped whole; V, per token, the least of the
    maxima of m parts, the channel lanes l = c % OUT_LANES with the same l % m. Vectors with
    fewer blocks / lanes than m are scanned whole.
    """
    m = k + 1
    zero = np.float32(0.0)
    ninf = np.float32(-np.inf)
    pinf = np.float32(np.inf)
    if kv == 0:  # per channel over tokens; m <= q since k <= (q - 1) // 2
        tv = np.empty((D, m), np.float32)
        ti = np.empty((D, m), np.int64)
        bv = np.empty((D, m), np.float32)
        bi = np.empty((D, m), np.int64)
        nb = (q + OUT_BLOCK - 1) // OUT_BLOCK
        bmax = np.empty((nb, D), np.float32)  # per block of tokens, per channel
        bmin = np.empty((nb, D), np.float32)
        for b in range(nb):  # 2-D indexing: numba's row views here cost 2x
            j0 = b * OUT_BLOCK
            for c in range(D):
                bmax[b, c] = buf[j0, c]
                bmin[b, c] = buf[j0, c]
            for j in range(j0 + 1, min(q, j0 + OUT_BLOCK)):
                for c in range(D):
                    v = buf[j, c]
                    hi = bmax[b, c]
                    lo = bmin[b, c]
                    bmax[b, c] = v if v > hi else hi
                    bmin[b, c] = v if v < lo else lo
        tlb = np.full(D, ninf, np.float32)  # lower bound of each channel's m-th largest
        bub = np.full(D, pinf, np.float32)  # upper bound of its m-th smallest
        if nb >= m:  # m largest block maxima per channel: a branch-free insertion network
            tops = np.full((m, D), ninf, np.float32)
            bots = np.full((m, D), pinf, np.float32)
            cu = np.empty(D, np.float32)  # the value carried down the network
            cl = np.empty(D, np.float32)
            for b in range(nb):
                for c in range(D):
                    cu[c] = bmax[b, c]
                    cl[c] = bmin[b, c]
                for s in range(m):
                    for c in range(D):
                        t = tops[s, c]
                        u = cu[c]
                        tops[s, c] = u if u > t else t
                        cu[c] = t if u > t else u
                        t = bots[s, c]
                        u = cl[c]
                        bots[s, c] = u if u < t else t
                        cl[c] = t if u < t else u
            for c in range(D):
                tlb[c] = tops[m - 1, c]
                bub[c] = bots[m - 1, c]
        nt = np.zeros(D, np.int64)  # list lengths
        nbt = np.zeros(D, np.int64)
        hu = np.empty(D, np.int64)  # channels whose block max / min passes the bound
        hl = np.empty(D, np.int64)
        for b in range(nb):
            nu = 0  # branch-free compaction
            nl = 0
            for c in range(D):
                hu[nu] = c
                nu += 1 if bmax[b, c] >= tlb[c] else 0
                hl[nl] = c
                nl += 1 if bmin[b, c] <= bub[c] else 0
            for j in range(b * OUT_BLOCK, min(q, (b + 1) * OUT_BLOCK)):  # rows in order
                row = buf[j]
                for i in range(nu):
                    c = hu[i]
                    v = row[c]
                    if v >= tlb[c]:
                        nt[c] = _keep_extremes(v, j, tv, ti, c, nt[c], m, True)
                for i in range(nl):
                    c = hl[i]
                    v = row[c]
                    if v <= bub[c]:
                        nbt[c] = _keep_extremes(v, j, bv, bi, c, nbt[c], m, False)
        ov = np.empty(D * 2 * k, np.float32)  # the head's values, [D, 2k] as stored
        for c in range(D):
            fill = min(max(zero, bv[c, k]), tv[c, k])
            for s in range(2 * k):
                t = ti[c, s] if s < k else bi[c, s - k]
                ov[c * 2 * k + s] = tv[c, s] if s < k else bv[c, s - k]
                o = (h * D + c) * 2 * k + s
                if ib == 1:
                    out[idx_at + o] = np.uint8(t)
                else:
                    _put16(out, idx_at + 2 * o, t)
            for s in range(2 * k):
                buf[ti[c, s] if s < k else bi[c, s - k], c] = fill
        _put_f16_rows(out, val_at + 2 * h * D * 2 * k, ov)
    else:  # per token over channels; m <= D
        tv = np.empty((1, m), np.float32)  # lists as in _keep_extremes: 2-D, one row
        ti = np.empty((1, m), np.int64)
        bv = np.empty((1, m), np.float32)
        bi = np.empty((1, m), np.int64)
        lanes = D % OUT_LANES == 0 and m <= OUT_LANES
        lm = np.empty(OUT_LANES, np.float32)  # per channel lane c % OUT_LANES: max, min
        ln = np.empty(OUT_LANES, np.float32)
        pmax = np.empty(m, np.float32)  # per part (the lanes with the same lane % m)
        pmin = np.empty(m, np.float32)
        cand = np.empty(D, np.int64)  # channels inside the bounds, in index order
        cbot = np.empty(D, np.int64)
        ov = np.empty(q * 2 * k, np.float32)  # the head-page's values, [q, 2k] as stored
        for j in range(q):
            row = buf[j]
            tlb = ninf  # lower bound of the row's m-th largest
            bub = pinf  # upper bound of its m-th smallest
            if lanes:  # eight lanes as scalars: one vector register each for max and min
                a0, a1, a2, a3 = row[0], row[1], row[2], row[3]
                a4, a5, a6, a7 = row[4], row[5], row[6], row[7]
                b0, b1, b2, b3, b4, b5, b6, b7 = a0, a1, a2, a3, a4, a5, a6, a7
                for i in range(OUT_LANES, D, OUT_LANES):
                    v0, v1, v2, v3 = row[i], row[i + 1], row[i + 2], row[i + 3]
                    v4, v5, v6, v7 = row[i + 4], row[i + 5], row[i + 6], row[i + 7]
                    a0, a1 = (v0 if v0 > a0 else a0), (v1 if v1 > a1 else a1)
                    a2, a3 = (v2 if v2 > a2 else a2), (v3 if v3 > a3 else a3)
                    a4, a5 = (v4 if v4 > a4 else a4), (v5 if v5 > a5 else a5)
                    a6, a7 = (v6 if v6 > a6 else a6), (v7 if v7 > a7 else a7)
                    b0, b1 = (v0 if v0 < b0 else b0), (v1 if v1 < b1 else b1)
                    b2, b3 = (v2 if v2 < b2 else b2), (v3 if v3 < b3 else b3)
                    b4, b5 = (v4 if v4 < b4 else b4), (v5 if v5 < b5 else b5)
                    b6, b7 = (v6 if v6 < b6 else b6), (v7 if v7 < b7 else b7)
                lm[0], lm[1], lm[2], lm[3], lm[4], lm[5], lm[6], lm[7] = (
                    a0, a1, a2, a3, a4, a5, a6, a7)
                ln[0], ln[1], ln[2], ln[3], ln[4], ln[5], ln[6], ln[7] = (
                    b0, b1, b2, b3, b4, b5, b6, b7)
                for c in range(m):
                    pmax[c] = lm[c]
                    pmin[c] = ln[c]
                for c in range(m, OUT_LANES):
                    s = c % m
                    pmax[s] = lm[c] if lm[c] > pmax[s] else pmax[s]
                    pmin[s] = ln[c] if ln[c] < pmin[s] else pmin[s]
                tlb = pmax.min()
                bub = pmin.max()
            nc = 0  # branch-free compaction of the candidates
            nd = 0
            for c in range(D):
                v = row[c]
                cand[nc] = c
                nc += 1 if v >= tlb else 0
                cbot[nd] = c
                nd += 1 if v <= bub else 0
            nt = 0
            for i in range(nc):
                c = cand[i]
                nt = _keep_extremes(row[c], c, tv, ti, 0, nt, m, True)
            nbt = 0
            for i in range(nd):
                c = cbot[i]
                nbt = _keep_extremes(row[c], c, bv, bi, 0, nbt, m, False)
            fill = min(max(zero, bv[0, k]), tv[0, k])
            for s in range(2 * k):
                c = ti[0, s] if s < k else bi[0, s - k]
                ov[j * 2 * k + s] = tv[0, s] if s < k else bv[0, s - k]
                o = (h * q + j) * 2 * k + s
                if ib == 1:
                    out[idx_at + o] = np.uint8(c)
                else:
                    _put16(out, idx_at + 2 * o, c)
            for s in range(2 * k):
                row[ti[0, s] if s < k else bi[0, s - k]] = fill
        _put_f16_rows(out, val_at + 2 * h * q * 2 * k, ov)


FP16_MAX_F32 = np.float32(65504.0)


@numba.njit(**_JIT)
def _token_norms(buf, q, D, out, at, tmp):
    """oscar's per-token scaling of buf [q, D] in place (oscar.norm_scale_factors op for op):
    n = sqrt(x_0^2 + x_1^2 + ...) (squares and sums in fp32, in index order; sqrt rounded
    to nearest), n16 = fp16(min(n, 65504)), stored little-endian at bytes at + 2 j; row j
    divided by fp32(n16), or by 1 where n16 == 0. Eight rows at a time: eight independent
    sums (each still in index order), not one sum's chain of dependent adds."""
    acc = np.empty(q, np.float32)
    j8 = q - q % 8
    for j0 in range(0, j8, 8):
        r0, r1, r2, r3 = buf[j0], buf[j0 + 1], buf[j0 + 2], buf[j0 + 3]
        r4, r5, r6, r7 = buf[j0 + 4], buf[j0 + 5], buf[j0 + 6], buf[j0 + 7]
        a0, a1, a2, a3 = r0[0] * r0[0], r1[0] * r1[0], r2[0] * r2[0], r3[0] * r3[0]
        a4, a5, a6, a7 = r4[0] * r4[0], r5[0] * r5[0], r6[0] * r6[0], r7[0] * r7[0]
        for c in range(1, D):
            a0, a1 = a0 + r0[c] * r0[c], a1 + r1[c] * r1[c]
            a2, a3 = a2 + r2[c] * r2[c], a3 + r3[c] * r3[c]
            a4, a5 = a4 + r4[c] * r4[c], a5 + r5[c] * r5[c]
            a6, a7 = a6 + r6[c] * r6[c], a7 + r7[c] * r7[c]
        acc[j0], acc[j0 + 1], acc[j0 + 2], acc[j0 + 3] = a0, a1, a2, a3
        acc[j0 + 4], acc[j0 + 5], acc[j0 + 6], acc[j0 + 7] = a4, a5, a6, a7
    for j in range(j8, q):
        row = buf[j]
        a = row[0] * row[0]
        for c in range(1, D):
            a = a + row[c] * row[c]
        acc[j] = a
    for j in range(q):
        row = buf[j]
        n = np.float32(np.sqrt(acc[j]))
        n = n if n < FP16_MAX_F32 else FP16_MAX_F32
        h16 = f32_bits_to_f16_bits(_f32_bits(n, tmp))
        _put16(out, at + 2 * j, h16)
        d = _bits_f32(f16_bits_to_f32_bits(h16), tmp)
        d = d if d > np.float32(0.0) else np.float32(1.0)
        for c in range(D):
            row[c] = row[c] / d


@numba.njit(parallel=True, **_JIT)
def _kcvt_stats_kernel(sb, sf, use_bits, sst, L, H, D, tq, bits, kstat):
    """kcvt: per (layer, head, channel) fp16 scale / zero bits of the key group made of all
    tq quantized tokens -> kstat uint16 [L, H, D, 2]."""
    qmax = np.float32((1 << bits) - 1)
    for w in numba.prange(L * H):
        l = w // H
        h = w % H
        tmp = np.empty(2, np.float32)
        row = np.empty(D, np.float32)
        lo = np.empty(D, np.float32)
        hi = np.empty(D, np.float32)
        o = l * sst[0] + h * sst[2]
        _load_row(sb, sf, use_bits, o, D, lo)
        hi[:] = lo
        for t in range(1, tq):
            _load_row(sb, sf, use_bits, o + t * sst[3], D, row)
            for c in range(D):
                v = row[c]
                lo[c] = v if v < lo[c] else lo[c]
                hi[c] = v if v > hi[c] else hi[c]
        for c in range(D):
            hs, hz, _s, _z = _scale_zero(lo[c], hi[c], qmax, tmp)
            kstat[l, h, c, 0] = np.uint16(hs)
            kstat[l, h, c, 1] = np.uint16(hz)


@numba.njit(parallel=True, **_JIT)
def _encode_kernel(kb, kf, kbits, kst, vb, vf, vbits, vst, speak, nflag, rot, scale,
                   kstat, kcvt, select, xr, rst, rpeak, geo, layer_bytes, L, H, D, G, VG, bits,
                   whole, out, peak, want_lr, b0, iters, fa, aoff, fb, boff, ik, iv):
    """Quantize, pack and serialize the backbone fields of every chunk into `out` (uint8,
    zeroed, chunks at l * layer_bytes + geo[p, G_BASE]).

    kb / kf (K) and vb / vf (V): flat quantization sources, bf16 bits (kbits / vbits) or
    fp32, element (l, kv, h, t, c) at l*st[0] + kv*st[1] + h*st[2] + t*st[3] + c (strides kst
    / vst); speak[kv]: whether they are the cache's values (count in the peak). oscar, on
    load: rot[kv]: K / V rotated (_fwht_rows, fp32 scale = 1 / sqrt(D)), then nflag[kv]: each
    token divided by its norm (_token_norms: the k_norm / v_norm field written). kstat: kcvt's
    per-channel key scale / zero bits [L, H, D, 2]. select: gear's outliers picked here
    (_page_outliers; else, if the page has outlier fields, already written and filled in the
    sources). xr: flat bf16 bits of the cache (bf16 window), strides rst.
    peak[item, 0]: max |x| over the item's source values as loaded (speak) and (rpeak: xr is the
    cache itself, not a rounding of it) its bf16 tokens; peak[item, 1]: max |rotated V|.
    want_lr (gear): the low-rank fit (_low_rank) of each head-page's quantization error
    E = source - x_hat, zero on the outlier slots named by the page's ko_idx / vo_idx fields
    (index bytes ik / iv), rank geo[p, G_RANK], start b0[p] [D, rank]: A into fa (page (l, p)
    as [2, H, q, rank] at aoff[l, p]), B into fb ([2, H, D, rank] at boff[l, p]), fp32."""
    P = geo.shape[0]
    hb = 1 if whole else H
    qmax = np.float32((1 << bits) - 1)
    zero = np.float32(0.0)
    for w in numba.prange(L * P * 2 * hb):
        h0 = w % hb
        kv = (w // hb) % 2
        p = (w // (2 * hb)) % P
        l = w // (2 * hb * P)
        g = geo[p]
        base = l * layer_bytes + g[G_BASE]
        t0 = g[G_T0]
        q = g[G_QK] if kv == 0 else g[G_QV]
        r = g[G_RK] if kv == 0 else g[G_RV]
        tmp = np.empty(2, np.float32)
        tt = K_TILE if kcvt else G  # K tokens per tile
        buf = np.empty((max(q, 1), D), np.float32)  # the head-page
        codes = np.empty(max(D, tt), np.int32)
        ctile = np.empty((tt, D), np.int32)  # K codes of one tile, token-major
        lo = np.empty(D, np.float32)
        hi = np.empty(D, np.float32)
        sv = np.empty(D, np.float32)
        zv = np.empty(D, np.float32)
        pkl = np.zeros(D, np.float32)  # per-channel peaks: |source| and bf16 window
        prl = np.zeros(D, np.float32)  # |rotated V|
        h_lo = 0 if whole else h0
        h_hi = H if whole else h0 + 1
        want_err = want_lr and q > 0
        err = np.empty((q if want_err else 1, D), np.float32)  # E of one head-page [q, D]
        nv = max(q, 1) * (D // VG) if kv == 1 else 1  # V groups of the head-page
        vs = np.empty(nv, np.float32)  # their scales, then zero points (fp32)
        vz = np.empty(nv, np.float32)
        vs16 = np.empty(nv, np.uint16)  # ... as fp16 bits
        vz16 = np.empty(nv, np.uint16)
        vscr = np.empty(nv, np.float32)
        ks16 = np.empty(D, np.uint16)  # K groups' scales / zero points as fp16 bits
        kz16 = np.empty(D, np.uint16)
        kscr = np.empty(D, np.float32)
        for h in range(h_lo, h_hi):
            if q > 0:
                for j in range(q):
                    t = t0 + j
                    if kv == 0:
                        _load_row(kb, kf, kbits, l * kst[0] + h * kst[2] + t * kst[3], D, buf[j])
                    else:
                        _load_row(vb, vf, vbits, l * vst[0] + vst[1] + h * vst[2] + t * vst[3],
                                  D, buf[j])
                    if speak[kv]:
                        _lane_peak(pkl, buf[j], D)
                if rot[kv]:
                    _fwht_rows(buf, q, D, scale)
                    if kv == 1:
                        for j in range(q):
                            _lane_peak(prl, buf[j], D)
                if nflag[kv]:
                    _token_norms(buf, q, D, out, base + (g[G_KN] if kv == 0 else g[G_VN])
                                 + h * q * 2, tmp)
                k = g[G_KK] if kv == 0 else g[G_KV]
                if select and k > 0:
                    _page_outliers(buf, q, D, kv, k, h, out,
                                   base + (g[G_KOI] if kv == 0 else g[G_VOI]),
                                   base + (g[G_KOV] if kv == 0 else g[G_VOV]),
                                   ik if kv == 0 else iv)
            if kv == 0 and q > 0:
                if kcvt:
                    for c in range(D):
                        sv[c] = _bits_f32(f16_bits_to_f32_bits(np.int64(kstat[l, h, c, 0])),
                                          tmp)
                        zv[c] = _bits_f32(f16_bits_to_f32_bits(np.int64(kstat[l, h, c, 1])),
                                          tmp)
                        if p == 0:
                            _put16(out, base + g[G_KS] + (h * D + c) * 2, kstat[l, h, c, 0])
                            _put16(out, base + g[G_KZ] + (h * D + c) * 2, kstat[l, h, c, 1])
                for a in range(0, q, tt):
                    n = min(tt, q - a)
                    if not kcvt:  # one group of G tokens per channel: its min / max
                        lo[:] = buf[a]
                        hi[:] = buf[a]
                        for j in range(a + 1, a + n):
                            row = buf[j]
                            for c in range(D):
                                v = row[c]
                                lo[c] = v if v < lo[c] else lo[c]
                                hi[c] = v if v > hi[c] else hi[c]
                        gi = a // G
                        ng = q // G
                        # _scale_zero for every channel at once (branch-free fp16 rounding)
                        for c in range(D):
                            glo = lo[c] + zero  # -0.0 -> +0.0
                            sv[c] = ((hi[c] + zero) - glo) / qmax
                            zv[c] = glo
                        f32_to_f16_bits_rows(sv, ks16, kscr)
                        f32_to_f16_bits_rows(zv, kz16, kscr)
                        f16_bits_to_f32_rows(ks16, sv)
                        f16_bits_to_f32_rows(kz16, zv)
                        for c in range(D):
                            _put16(out, base + g[G_KS] + ((h * D + c) * ng + gi) * 2, ks16[c])
                            _put16(out, base + g[G_KZ] + ((h * D + c) * ng + gi) * 2, kz16[c])
                    for j in range(n):  # row-major codes (vectorized), packed by channel
                        row = buf[a + j]
                        cr = ctile[j]
                        for c in range(D):
                            cr[c] = _code(row[c], sv[c], zv[c], qmax)
                    per = 8 // bits
                    if bits != 8 and (q % per + a % per + n % per) == 0:
                        # every channel's run starts and ends on a byte: whole bytes
                        _pack_columns(out, base + g[G_KC] + (h * D * q + a) // per, q // per,
                                      ctile, n, D, bits, codes)
                    else:
                        for c in range(D):
                            for j in range(n):
                                codes[j] = ctile[j, c]
                            _put_run(out, base + g[G_KC], (h * D + c) * q + a, codes, n, bits)
                    if want_err:
                        for j in range(n):
                            row = buf[a + j]
                            er = err[a + j]
                            cr = ctile[j]
                            for c in range(D):
                                er[c] = row[c] - (zv[c] + np.float32(cr[c]) * sv[c])
            elif kv == 1 and q > 0:
                # quantize_group's ops for every group of the head-page, in passes: min /
                # max of each group, then all scales and zero points rounded to fp16 at once
                # (branch-free vector loops, not the scalar rounding per group), then the codes
                nvg = D // VG
                ngr = q * nvg
                gs, gz = vs[:ngr], vz[:ngr]
                for j in range(q):
                    row = buf[j]
                    for gg in range(nvg):
                        glo, ghi = group_minmax(row, gg * VG, (gg + 1) * VG)
                        glo = glo + zero  # -0.0 -> +0.0
                        gs[j * nvg + gg] = ((ghi + zero) - glo) / qmax
                        gz[j * nvg + gg] = glo
                f32_to_f16_bits_rows(gs, vs16[:ngr], vscr[:ngr])
                f32_to_f16_bits_rows(gz, vz16[:ngr], vscr[:ngr])
                f16_bits_to_f32_rows(vs16[:ngr], gs)  # the fp32 values after the round trip
                f16_bits_to_f32_rows(vz16[:ngr], gz)
                mo = h * ngr * 2  # the head-page's fields: [q, nvg] fp16, contiguous
                out[base + g[G_VS] + mo: base + g[G_VS] + mo + 2 * ngr] = \
                    vs16[:ngr].view(np.uint8)
                out[base + g[G_VZ] + mo: base + g[G_VZ] + mo + 2 * ngr] = \
                    vz16[:ngr].view(np.uint8)
                for j in range(q):  # codes (and E) of a row with its groups' scale / zero
                    row = buf[j]  # per channel: loops over the whole row vectorize
                    for gg in range(nvg):
                        sv[gg * VG:(gg + 1) * VG] = gs[j * nvg + gg]
                        zv[gg * VG:(gg + 1) * VG] = gz[j * nvg + gg]
                    for c in range(D):
                        codes[c] = _code(row[c], sv[c], zv[c], qmax)
                    if want_err:
                        er = err[j]
                        for c in range(D):
                            er[c] = row[c] - (zv[c] + np.float32(codes[c]) * sv[c])
                    if bits != 8 and D % (8 // bits) == 0:  # the row starts on a byte
                        _pack_row(out, base + g[G_VC] + (h * q + j) * D // (8 // bits), codes,
                                  D, bits)
                    else:
                        _put_run(out, base + g[G_VC], (h * q + j) * D, codes, D, bits)
            # bf16 window: copied bits
            ro = base + (g[G_KR] if kv == 0 else g[G_VR])
            for j in range(r):
                x0 = l * rst[0] + kv * rst[1] + h * rst[2] + (t0 + q + j) * rst[3]
                o = ro + ((h * r + j) * D) * 2
                for c in range(D):
                    u = np.int64(xr[x0 + c])
                    _put16(out, o + 2 * c, u)
                    if rpeak:
                        a = abs(_bits_f32(u << 16, tmp))
                        pkl[c] = a if a > pkl[c] else pkl[c]
            if want_err:  # outlier slots: left out of the low-rank fit
                if kv == 0 and g[G_KK] > 0:
                    m = 2 * g[G_KK]
                    for c in range(D):
                        for j in range(m):
                            o = base + g[G_KOI] + ((h * D + c) * m + j) * ik
                            t = np.int64(out[o]) if ik == 1 else _get16(out, o)
                            err[t, c] = zero
                elif kv == 1 and g[G_KV] > 0:
                    m = 2 * g[G_KV]
                    for j in range(q):
                        for i in range(m):
                            o = base + g[G_VOI] + ((h * q + j) * m + i) * iv
                            c = np.int64(out[o]) if iv == 1 else _get16(out, o)
                            err[j, c] = zero
                rank = g[G_RANK]
                _low_rank(err, q, D, rank, iters, b0[p],
                          fa[aoff[l, p] + (kv * H + h) * q * rank:],
                          fb[boff[l, p] + (kv * H + h) * D * rank:])
        peak[w, 0] = pkl.max()
        peak[w, 1] = prl.max()


@numba.njit(**_JIT)
def _seq_dot(x, y, n):
    """sum_t x[t] * y[t], t = 0 .. n-1 in order, each product and sum rounded to fp32 (the
    order gear.seq_sum uses)."""
    acc = x[0] * y[0]
    for t in range(1, n):
        acc = acc + x[t] * y[t]
    return acc


@numba.njit(**_JIT)
def _mgs(m, n, r):
    """In place: orthonormalize the r columns of an [n, r] matrix held as rows m[j, 0:n]
    (modified Gram-Schmidt in gear.orthonormalize's op order; a zero column stays zero)."""
    for j in range(r):
        v = m[j]
        for i in range(j):
            dot = _seq_dot(m[i], v, n)
            qi = m[i]
            for t in range(n):
                v[t] = v[t] - dot * qi[t]
        nrm = np.float32(np.sqrt(_seq_dot(v, v, n)))  # rounded to fp32, as gear.sqrt_rn
        if nrm > np.float32(0.0):
            for t in range(n):
                v[t] = v[t] / nrm
        else:
            for t in range(n):
                v[t] = np.float32(0.0)


@numba.njit(**_JIT)
def _matmul_seq(xt, yt, out, m, k, r):
    """out[j, i] = sum_c xt[c, i] * yt[j, c] over c = 0 .. k-1 in order (each product and sum
    rounded to fp32: gear.matmul_seq's order), i < m, j < r: the product X Y of X [m, k]
    held as xt = X^T [k, m] and Y [k, r] held as yt = Y^T [r, k], out = (X Y)^T [r, m].
    Vectorized across i; four output columns per pass over X, and four terms c added to each
    output per load and store of it (the same sums in the same order: a register carries
    the partial sum from term c to c + 1 instead of memory)."""
    for j0 in range(0, r, 4):
        if r - j0 >= 4:
            y0, y1, y2, y3 = out[j0], out[j0 + 1], out[j0 + 2], out[j0 + 3]
            x = xt[0]
            c0, c1, c2, c3 = yt[j0, 0], yt[j0 + 1, 0], yt[j0 + 2, 0], yt[j0 + 3, 0]
            for i in range(m):
                e = x[i]
                y0[i] = e * c0
                y1[i] = e * c1
                y2[i] = e * c2
                y3[i] = e * c3
            c = 1
            while c + 4 <= k:
                xa, xb, xc, xd = xt[c], xt[c + 1], xt[c + 2], xt[c + 3]
                a0, a1, a2, a3 = yt[j0, c], yt[j0, c + 1], yt[j0, c + 2], yt[j0, c + 3]
                b0, b1 = yt[j0 + 1, c], yt[j0 + 1, c + 1]
                b2, b3 = yt[j0 + 1, c + 2], yt[j0 + 1, c + 3]
                d0, d1 = yt[j0 + 2, c], yt[j0 + 2, c + 1]
                d2, d3 = yt[j0 + 2, c + 2], yt[j0 + 2, c + 3]
                f0, f1 = yt[j0 + 3, c], yt[j0 + 3, c + 1]
                f2, f3 = yt[j0 + 3, c + 2], yt[j0 + 3, c + 3]
                for i in range(m):
                    ea, eb, ec, ed = xa[i], xb[i], xc[i], xd[i]
                    y0[i] = (((y0[i] + ea * a0) + eb * a1) + ec * a2) + ed * a3
                    y1[i] = (((y1[i] + ea * b0) + eb * b1) + ec * b2) + ed * b3
                    y2[i] = (((y2[i] + ea * d0) + eb * d1) + ec * d2) + ed * d3
                    y3[i] = (((y3[i] + ea * f0) + eb * f1) + ec * f2) + ed * f3
                c += 4
            while c < k:
                x = xt[c]
                c0, c1, c2, c3 = yt[j0, c], yt[j0 + 1, c], yt[j0 + 2, c], yt[j0 + 3, c]
                for i in range(m):
                    e = x[i]
                    y0[i] = y0[i] + e * c0
                    y1[i] = y1[i] + e * c1
                    y2[i] = y2[i] + e * c2
                    y3[i] = y3[i] + e * c3
                c += 1
        else:
            for j in range(j0, r):
                y = out[j]
                x = xt[0]
                c0 = yt[j, 0]
                for i in range(m):
                    y[i] = x[i] * c0
                for c in range(1, k):
                    x = xt[c]
                    c0 = yt[j, c]
                    for i in range(m):
                        y[i] = y[i] + x[i] * c0


@numba.njit(**_JIT)
def _transpose(e, q, D, et):
    """et [D, q] = e[0:q] [.., D]^T (fp32, C order). Eight rows at a time, through flat
    views with unsigned offsets (no wraparound test per element): 3x as fast as 8 x 8 blocks
    of 2-D indexing, and the transpose is the larger part of a low-rank fit's time."""
    ef = e.reshape(-1)
    etf = et.reshape(-1)
    uq = np.uint64(q)
    ud = np.uint64(D)
    one = np.uint64(1)
    t8 = q - q % 8
    for t0 in range(0, t8, 8):
        ut0 = np.uint64(t0)
        for c in range(D):
            uc = np.uint64(c)
            o = uc * uq + ut0
            i = ut0 * ud + uc
            etf[o] = ef[i]
            etf[o + one] = ef[i + ud]
            etf[o + np.uint64(2)] = ef[i + np.uint64(2) * ud]
            etf[o + np.uint64(3)] = ef[i + np.uint64(3) * ud]
            etf[o + np.uint64(4)] = ef[i + np.uint64(4) * ud]
            etf[o + np.uint64(5)] = ef[i + np.uint64(5) * ud]
            etf[o + np.uint64(6)] = ef[i + np.uint64(6) * ud]
            etf[o + np.uint64(7)] = ef[i + np.uint64(7) * ud]
    for t in range(t8, q):
        for c in range(D):
            et[c, t] = e[t, c]


@numba.njit(**_JIT)
def _low_rank(e, q, D, r, iters, b0, fa, fb):
    """gear.low_rank of one matrix E = e [q, D] (fp32), op for op: B = b0 [D, r]; iters
    times B = MGS(B); A = MGS(E B); B = E^T A; every dot product summed in index order
    (_matmul_seq, _mgs). Writes A [q, r] to fa[0:q*r] and B [D, r] to fb[0:D*r]."""
    et = np.empty((D, q), np.float32)  # E^T
    _transpose(e, q, D, et)
    at = np.zeros((r, q), np.float32)  # A^T
    bt = np.empty((r, D), np.float32)  # B^T
    for j in range(r):
        for c in range(D):
            bt[j, c] = b0[c, j]
    for _ in range(iters):
        _mgs(bt, D, r)
        _matmul_seq(et, bt, at, q, D, r)  # A = E B: a[t, j] = sum_c e[t, c] b[c, j]
        _mgs(at, q, r)
        _matmul_seq(e, at, bt, D, q, r)  # B = E^T A: b[c, j] = sum_t e[t, c] a[t, j]
    for t in range(q):
        for j in range(r):
            fa[t * r + j] = at[j, t]
    for c in range(D):
        for j in range(r):
            fb[c * r + j] = bt[j, c]


@numba.njit(inline="always", **_JIT)
def _store_row(buf, D, mode, out_f, out_b, o, scr):
    """One fp32 row -> the output at flat offset o: fp32 (mode 0), bf16 bits (1, round to
    nearest even as torch .to()), fp16 bits (2, clamped to +-65504 first as
    codec.cast_finite, then rounded in branch-free vector loops). scr: fp32 [2, >= D]
    scratch (mode 2)."""
    if mode == 0:
        for c in range(D):
            out_f[o + c] = buf[c]
    elif mode == 1:
        bu = buf.view(np.uint32)
        for c in range(D):
            ub = bu[c]
            ub = ub + np.uint32(0x7FFF) + ((ub >> np.uint32(16)) & np.uint32(1))
            out_b[o + c] = np.uint16(ub >> np.uint32(16))
    else:
        big = np.float32(65504.0)
        clamped = scr[0, :D]
        for c in range(D):
            clamped[c] = max(-big, min(big, buf[c]))
        f32_to_f16_bits_rows(clamped, out_b[o: o + D], scr[1, :D])


@numba.njit(parallel=True, **_JIT)
def _decode_kernel(src, geo, layer_bytes, L, H, D, T, G, VG, bits, kcvt, ik, iv, rot_k, rot_v,
                   scale, mode, out_f, out_b):
    """Inverse of _encode_kernel (+ the fields gear and oscar add): every chunk in `src`
    (layout as _encode_kernel's `out`) -> the cache [L, 2, H, T, D] as flat out_f (fp32,
    mode 0) or out_b (uint16 bf16 / fp16 bits, modes 1 / 2). Per head-page, in fp32:
    x = zero16 + code * scale16; gear: x = x + (a_0 b_0 + a_1 b_1 + ...) (lr_a, lr_b; the
    products summed in rank order), then the stored outliers overwrite their slots; oscar:
    K (and V where geo has v_norm) * the fp16 norm, then the Walsh-Hadamard rotation of K
    (rot_k) and V (rot_v), `scale` = fp32(1 / sqrt(D))."""
    P = geo.shape[0]
    for w in numba.prange(L * P * 2 * H):
        h = w % H
        kv = (w // H) % 2
        p = (w // (2 * H)) % P
        l = w // (2 * H * P)
        g = geo[p]
        base = l * layer_bytes + g[G_BASE]
        t0 = g[G_T0]
        q = g[G_QK] if kv == 0 else g[G_QV]
        r = g[G_RK] if kv == 0 else g[G_RV]
        tmp = np.empty(2, np.float32)
        scr = np.empty((2, D), np.float32)  # _store_row's fp16 scratch
        buf = np.empty((max(q, 1), D), np.float32)
        o0 = ((l * 2 + kv) * H + h) * T * D
        if q > 0:
            if kv == 0:
                if kcvt:  # one group of all the layer's quantized tokens, scales in page 0
                    ks_at = l * layer_bytes + geo[0, G_BASE] + geo[0, G_KS]
                    kz_at = l * layer_bytes + geo[0, G_BASE] + geo[0, G_KZ]
                else:
                    ks_at = base + g[G_KS]
                    kz_at = base + g[G_KZ]
                ng = 1 if kcvt else q // G
                gs = q if kcvt else G
                for c in range(D):
                    for gi in range(ng):
                        mo = ((h * D + c) * ng + gi) * 2
                        s = _h2f(src, ks_at + mo, tmp)
                        z = _h2f(src, kz_at + mo, tmp)
                        i0 = (h * D + c) * q + gi * gs
                        for j in range(gs):
                            code = _get_code(src, base + g[G_KC], i0 + j, bits)
                            buf[gi * gs + j, c] = z + np.float32(code) * s
            else:
                nvg = D // VG
                for j in range(q):
                    row = buf[j]
                    for gi in range(nvg):
                        mo = ((h * q + j) * nvg + gi) * 2
                        s = _h2f(src, base + g[G_VS] + mo, tmp)
                        z = _h2f(src, base + g[G_VZ] + mo, tmp)
                        i0 = (h * q + j) * D + gi * VG
                        for c in range(VG):
                            code = _get_code(src, base + g[G_VC], i0 + c, bits)
                            row[gi * VG + c] = z + np.float32(code) * s
            rank = g[G_RANK]
            if rank > 0:  # gear: + A B^T, products added in rank order
                bt = np.empty((rank, D), np.float32)  # B^T
                am = np.empty(rank, np.float32)
                lr = np.empty(D, np.float32)
                for c in range(D):
                    for k in range(rank):
                        bt[k, c] = _h2f(src, base + g[G_LB]
                                        + (((kv * H + h) * D + c) * rank + k) * 2, tmp)
                for j in range(q):
                    for k in range(rank):
                        am[k] = _h2f(src, base + g[G_LA]
                                     + (((kv * H + h) * q + j) * rank + k) * 2, tmp)
                    a0 = am[0]
                    b0 = bt[0]
                    for c in range(D):
                        lr[c] = a0 * b0[c]
                    for k in range(1, rank):
                        ak = am[k]
                        bk = bt[k]
                        for c in range(D):
                            lr[c] = lr[c] + ak * bk[c]
                    row = buf[j]
                    for c in range(D):
                        row[c] = row[c] + lr[c]
            if kv == 0 and g[G_KK] > 0:  # gear outliers: per channel, token index in page
                m = 2 * g[G_KK]
                for c in range(D):
                    for i in range(m):
                        oi = base + g[G_KOI] + ((h * D + c) * m + i) * ik
                        t = np.int64(src[oi]) if ik == 1 else _get16(src, oi)
                        buf[t, c] = _h2f(src, base + g[G_KOV] + ((h * D + c) * m + i) * 2, tmp)
            if kv == 1 and g[G_KV] > 0:  # per token, channel index
                m = 2 * g[G_KV]
                for j in range(q):
                    for i in range(m):
                        oi = base + g[G_VOI] + ((h * q + j) * m + i) * iv
                        c = np.int64(src[oi]) if iv == 1 else _get16(src, oi)
                        buf[j, c] = _h2f(src, base + g[G_VOV] + ((h * q + j) * m + i) * 2, tmp)
            nf = g[G_KN] if kv == 0 else g[G_VN]
            if nf >= 0:  # oscar: undo the per-token norm scaling
                for j in range(q):
                    n = _h2f(src, base + nf + (h * q + j) * 2, tmp)
                    row = buf[j]
                    for c in range(D):
                        row[c] = row[c] * n
            if rot_k if kv == 0 else rot_v:
                _fwht_rows(buf, q, D, scale)
            for j in range(q):
                _store_row(buf[j], D, mode, out_f, out_b, o0 + (t0 + j) * D, scr)
        # bf16 window
        ro = base + (g[G_KR] if kv == 0 else g[G_VR])
        row = buf[0]
        ru = row.view(np.uint32)
        for j in range(r):
            o = ro + (h * r + j) * D * 2
            oo = o0 + (t0 + q + j) * D
            if mode == 1:
                for c in range(D):
                    out_b[oo + c] = np.uint16(_get16(src, o + 2 * c))
            else:
                for c in range(D):
                    ru[c] = np.uint32(_get16(src, o + 2 * c) << 16)
                _store_row(row, D, mode, out_f, out_b, oo, scr)


@numba.njit(parallel=True, **_JIT)
def _outlier_kernel(sb, sf, use_bits, sst, geo, layer_bytes, L, H, D, ik, iv, out, filled,
                    peak):
    """gear 'ceil' outliers of every head-page (_page_outliers) written as the ko_* / vo_*
    fields of the chunks in `out`; filled (fp32 [L, 2, H, Tq, D]) = the source with the
    slots filled. For a kcvt backbone, whose key groups span all pages. peak[item]: max |x|
    of the item's source values."""
    P = geo.shape[0]
    for w in numba.prange(L * P * 2 * H):
        h = w % H
        kv = (w // H) % 2
        p = (w // (2 * H)) % P
        l = w // (2 * H * P)
        g = geo[p]
        q = g[G_QK]
        pkl = np.zeros(D, np.float32)  # per-channel peaks |x|
        if q > 0:
            t0 = g[G_T0]
            base = l * layer_bytes + g[G_BASE]
            buf = filled[l, kv, h, t0:t0 + q]
            for j in range(q):
                _load_row(sb, sf, use_bits, l * sst[0] + kv * sst[1] + h * sst[2]
                          + (t0 + j) * sst[3], D, buf[j])
                _lane_peak(pkl, buf[j], D)
            k = g[G_KK] if kv == 0 else g[G_KV]
            if k > 0:
                _page_outliers(buf, q, D, kv, k, h, out,
                               base + (g[G_KOI] if kv == 0 else g[G_VOI]),
                               base + (g[G_KOV] if kv == 0 else g[G_VOV]),
                               ik if kv == 0 else iv)
        peak[w] = pkl.max()


# ---- Python side of the fused path --------------------------------------------------------
class Source:
    """A quantization source for the fused kernels: element (l, kv, h, t, c) of a flat
    bf16-bits (uint16) or fp32 array at l*strides[0] + kv*strides[1] + h*strides[2] +
    t*strides[3] + c."""

    def __init__(self, flat: np.ndarray, strides: tuple[int, int, int, int]) -> None:
        self.use_bits = flat.dtype == np.uint16
        self.sb = flat if self.use_bits else np.zeros(1, np.uint16)
        self.sf = np.zeros(1, np.float32) if self.use_bits else flat
        self.strides = np.asarray(strides, np.int64)

    @classmethod
    def of(cls, t: torch.Tensor) -> Source:
        """A CPU tensor [L, 2, H, T, D] (any strides with the last dim contiguous over a
        contiguous storage, e.g. a permuted contiguous tensor): bf16 as its bits, fp32 as is,
        anything else widened to fp32 first."""
        if t.dtype == torch.bfloat16:
            b = t.view(torch.int16)
            dt = np.uint16
        else:
            b = t if t.dtype == torch.float32 else t.to(torch.float32)
            dt = np.float32
        if b.stride(-1) != 1:
            b = b.contiguous()
        # every element from b's first (its storage offset: a layer sliced from a whole
        # cache starts inside the storage) to the storage's end; the strides count from there
        flat = torch.as_strided(b, (b.untyped_storage().nbytes() // b.element_size()
                                    - b.storage_offset(),), (1,))
        arr = flat.numpy()
        return cls(arr.view(np.uint16) if dt == np.uint16 else arr,
                   tuple(int(s) for s in b.stride()[:4]))


def bf16_bits(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The cache's bf16 bits (flat uint16, strides of a contiguous [L, 2, H, T, D]): a view
    for a contiguous bf16 tensor, else the round-to-nearest-even cast torch .to() makes."""
    b = x.to(torch.bfloat16).contiguous()
    return b.view(torch.int16).numpy().reshape(-1).view(np.uint16), np.asarray(b.stride()[:4],
                                                                              np.int64)


@dataclass
class LowRankOut:
    """gear: the per-page low-rank fits encode_fused makes (fp32, flat): page (l, p) with q
    quantized tokens has A [2, H, q, r] at a[aoff[l, p]:] and B [2, H, D, r] at
    b[boff[l, p]:]; b0 [pages, D, max r]: each page's start matrix; iters: rounds."""

    b0: np.ndarray
    iters: int
    a: np.ndarray
    aoff: np.ndarray
    b: np.ndarray
    boff: np.ndarray

    @classmethod
    def empty(cls, geo: np.ndarray, layers: int, heads: int, head_dim: int, iters: int,
              start: list[np.ndarray]) -> LowRankOut:
        """Buffers for the pages of geo; start[p]: page p's B0 [D, r_p]."""
        r, q = geo[:, G_RANK], geo[:, G_QK]
        per_a, per_b = 2 * heads * q * r, 2 * heads * head_dim * r
        rmax = max(int(r.max()), 1) if r.size else 1
        b0 = np.zeros((geo.shape[0], head_dim, rmax), np.float32)
        for p, m in enumerate(start):
            b0[p, :, :m.shape[1]] = m

        def offsets(per: np.ndarray) -> np.ndarray:
            starts = np.concatenate(([0], np.cumsum(per)[:-1]))
            return (np.arange(layers)[:, None] * int(per.sum()) + starts[None, :]).astype(
                np.int64)

        return cls(b0, iters, np.empty(layers * int(per_a.sum()), np.float32), offsets(per_a),
                   np.empty(layers * int(per_b.sum()), np.float32), offsets(per_b))


_NO_LOWRANK = LowRankOut(np.zeros((1, 1, 1), np.float32), 0, np.zeros(1, np.float32),
                         np.zeros((1, 1), np.int64), np.zeros(1, np.float32),
                         np.zeros((1, 1), np.int64))


def encode_fused(x: torch.Tensor, geo: np.ndarray, layer_bytes: int, key_group: int,
                 value_group: int, bits: int, out: np.ndarray, src_k: Source | None = None,
                 src_v: Source | None = None, norms: tuple[bool, bool] = (False, False),
                 src_peak: tuple[int, int] = (1, 1),
                 rotate: tuple[bool, bool] = (False, False),
                 select_outliers: bool = False, lowrank: LowRankOut | None = None,
                 index_bytes: tuple[int, int] = (1, 1)) -> tuple[float, float]:
    """The backbone fields (and bf16 window) of every chunk of x [L, 2, H, T, D] into `out`
    (uint8 [L * layer_bytes], zeroed; chunk (l, p) at l * layer_bytes + geo[p, G_BASE]).
    key_group 0 = kcvt. src_k / src_v: the K / V values to quantize (default x itself, else
    gear's transformed cache); src_peak: which of them are the cache's own values
    (count in the peak). rotate / norms (oscar, per K / V): rotated on load, then each token
    divided by its norm (the k_norm / v_norm fields written); select_outliers: gear's
    outliers picked in the kernel (a kivi backbone); lowrank: gear's low-rank fits (filled
    in). See _encode_kernel. Returns (peak |value| seen: sources as loaded, and the bf16
    window if x is bf16 (else the caller checks x's range itself: the window is stored
    rounded to bf16); peak |rotated V|)."""
    qmax_of(bits)
    L, _, H, T, D = (int(s) for s in x.shape)
    kcvt = key_group == 0
    if kcvt and select_outliers:
        raise ValueError("encode_fused: kcvt's key groups span pages: split outliers first")
    xr, rst = bf16_bits(x)
    if src_k is None or src_v is None:
        own = Source.of(x)
        src_k, src_v = src_k or own, src_v or own
    tq = int((geo[:, G_QK]).sum())
    kstat = np.zeros((L, H, D, 2) if kcvt else (1, 1, 1, 2), np.uint16)
    if kcvt and tq:
        _kcvt_stats_kernel(src_k.sb, src_k.sf, src_k.use_bits, src_k.strides, L, H, D, tq, bits,
                           kstat)
    per = 8 // bits
    aligned = all(int(v) * D % per == 0 for v in np.concatenate((geo[:, G_QK], geo[:, G_QV])))
    hb = H if aligned else 1
    peak = np.zeros((L * geo.shape[0] * 2 * hb, 2), np.float32)
    lr = lowrank or _NO_LOWRANK
    _encode_kernel(src_k.sb, src_k.sf, src_k.use_bits, src_k.strides, src_v.sb, src_v.sf,
                   src_v.use_bits, src_v.strides, np.asarray(src_peak, np.int64),
                   np.asarray(norms, np.int64), np.asarray(rotate, np.int64),
                   np.float32(1.0 / math.sqrt(D)),
                   kstat, kcvt, select_outliers, xr, rst, x.dtype == torch.bfloat16, geo,
                   layer_bytes, L, H, D, max(key_group, 1), value_group, bits, not aligned,
                   out, peak, lowrank is not None, lr.b0, lr.iters, lr.a, lr.aoff, lr.b,
                   lr.boff, index_bytes[0], index_bytes[1])
    if not peak.size:
        return 0.0, 0.0
    return float(peak[:, 0].max()), float(peak[:, 1].max())


def split_outliers_fused(src: Source, geo: np.ndarray, layer_bytes: int,
                         dims: tuple[int, ...], tq: int, index_bytes: tuple[int, int],
                         out: np.ndarray) -> tuple[torch.Tensor, float]:
    """gear 'ceil' outliers of every page (see _outlier_kernel) -> (filled source fp32
    [L, 2, H, tq, D], peak |x| of the first tq tokens); the ko_* / vo_* fields go to out."""
    L, _, H, _, D = dims
    filled = np.empty((L, 2, H, tq, D), np.float32)
    peak = np.zeros(L * geo.shape[0] * 2 * H, np.float32)
    if tq:
        _outlier_kernel(src.sb, src.sf, src.use_bits, src.strides, geo, layer_bytes, L, H, D,
                        index_bytes[0], index_bytes[1], out, filled, peak)
    return torch.from_numpy(filled), float(peak.max()) if peak.size else 0.0


def decode_fused(src: np.ndarray, geo: np.ndarray, layer_bytes: int, dims: tuple[int, ...],
                 key_group: int, value_group: int, bits: int, dtype: torch.dtype,
                 index_bytes: tuple[int, int] = (1, 1),
                 rotate: tuple[bool, bool] = (False, False)) -> torch.Tensor:
    """Every chunk in src (uint8, laid out as encode_fused's out) -> the cache in `dtype`
    (fp32, or bf16 / fp16 rounded from the fp32 reconstruction as codec.cast_finite)."""
    qmax_of(bits)
    L, _, H, T, D = dims
    mode = {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)
    n = L * 2 * H * T * D
    out_f = np.empty(n if mode == 0 else 1, np.float32)
    out_b = np.empty(n if mode else 1, np.uint16)
    _decode_kernel(np.ascontiguousarray(src, dtype=np.uint8), geo, layer_bytes, L, H, D, T,
                   max(key_group, 1), value_group, bits, key_group == 0, index_bytes[0],
                   index_bytes[1], rotate[0], rotate[1], np.float32(1.0 / math.sqrt(D)), mode,
                   out_f, out_b)
    if mode == 0:
        return torch.from_numpy(out_f).view(dims)
    t = torch.from_numpy(out_b.view(np.int16)).view(dims)
    return t.view(torch.bfloat16 if mode == 1 else torch.float16)
