"""Fast CPU pieces of the KIVI backbone (kivi / kcvt / gear / oscar): numba kernels that are
byte-identical to the torch reference in groupquant.py and bitpack.py.

The profile of the torch path on CPU (8x8x2048x128 bf16) was dominated by bit packing
(int32 widen + shift + sum over a tiny last dim), unpacking, and the fp32 temporaries of
the quantizer / dequantizer, not by the arithmetic. These kernels do each in one pass:

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
- pack_flat / unpack_flat: bitpack.pack / unpack of a flat code vector (little end first).

The whole-cache quantizer runs its rows and the page decoder its (K|V, head) blocks in
parallel (numba prange); pack / unpack (many small calls, each a fraction of a page's work)
run serially, because waking numba's OpenMP pool that often, interleaved with torch's own
pool on few cores, cost more than the work.
tests/test_kivi_cpu.py checks bytes against torch.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvsim.kernels.fp16_bits import f16_bits_to_f32_bits
from kvsim.kernels.groupquant import qmax_of
from kvsim.kernels.uniform_cpu import quantize_group

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


@numba.njit(**_JIT)
def _pack_kernel(codes, bits, out):
    """codes: flat uint8 (length a multiple of 8 // bits) -> out uint8 [len * bits / 8]."""
    per = 8 // bits
    m = out.shape[0]
    for i in range(m):
        acc = 0
        for j in range(per):
            acc |= np.int32(codes[i * per + j]) << (j * bits)
        out[i] = np.uint8(acc)


@numba.njit(**_JIT)
def _unpack_kernel(packed, bits, out):
    """packed uint8 [m] -> out uint8 [m * 8 / bits] (the caller truncates)."""
    per = 8 // bits
    mask = (1 << bits) - 1
    for i in range(packed.shape[0]):
        byte = np.int32(packed[i])
        for j in range(per):
            out[i * per + j] = np.uint8((byte >> (j * bits)) & mask)


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


def pack_flat(codes: torch.Tensor, bits: int) -> np.ndarray:
    """groupquant.pack_codes on CPU: codes (any shape) -> flat uint8 packed bytes, zero-padded
    to a whole byte."""
    qmax_of(bits)
    flat = codes.detach().cpu().to(torch.uint8).contiguous().reshape(-1).numpy()
    if bits == 8:
        return flat.copy()
    per = 8 // bits
    pad = (-flat.size) % per
    if pad:
        flat = np.concatenate((flat, np.zeros(pad, np.uint8)))
    out = np.empty(flat.size // per, np.uint8)
    _pack_kernel(flat, bits, out)
    return out


def unpack_flat(packed: np.ndarray, bits: int, n: int) -> torch.Tensor:
    """groupquant.unpack_codes's flat part: packed uint8 -> the first n codes (uint8)."""
    qmax_of(bits)
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    if bits == 8:
        return torch.from_numpy(packed[:n].copy())
    out = np.empty(packed.size * (8 // bits), np.uint8)
    _unpack_kernel(packed, bits, out)
    return torch.from_numpy(out[:n])


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
