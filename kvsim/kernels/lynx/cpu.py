"""Fast CPU path of the `lynx` codec: numba kernels, byte-identical to the torch reference.

One work item = one (layer, K|V, kv_head, page): the page block [n, D] is copied once into
a thread-local fp32 scratch (bf16 input is widened from its bits there, no fp32 copy of the
cache), then statistics, companding (lookup table over the fp32 bits of u, see
lynx.LynxTables), the split into stream fields and the bit packing run on that L2-resident
block, writing packed codes straight into the stream buffers. Items run in parallel
(numba prange). Decode mirrors it and writes bf16 (or fp32) directly. The oscar
preconditioning and its inverse are numba kernels too (rows of head_dim in parallel).

Speed rules the kernels follow (on a 2-core AVX2 host, breaking one costs 2-5x):
loops index arrays or slices from 0 (x[i] with i in range(a, b) and a runtime a pays
numba's negative-index wraparound on every access and does not vectorize); min / max run on
integer keys of the float bits (integer reductions vectorize, fp32 compare-selects do not),
which for bf16 also checks the input for Inf / NaN (Codec.encode then skips its own pass);
no allocation per row inside the parallel loops; big outputs come from np.empty (torch's
CPU allocator costs ~4x more per fresh 100 MB block there).
numba computes int16 / int32 arithmetic at 64 bits: integer min / max are written as
compare-selects on explicitly cast values (2.6x on the page min / max), and a shift by a
runtime count is masked with `& 31` (every count here is < 32) so that LLVM may narrow it back
to 32 bits (an unmasked one stays a 64-bit shift, which AVX2 lacks for arithmetic shifts:
3x on the cell index); no integer division in per-channel loops (the chunk mean divides in
fp64, exact there); fp16 rounding of the chunk scales runs in the branch-free vector loops of
fp16_bits.

All arithmetic follows lynx.encode_torch operation by operation (IEEE fp32, no fast-math, no
FMA contraction), so codes and metadata are identical; tests/test_lynx.py checks bytes.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch

from kvsim.core.layout import check_finite
from kvsim.kernels.device_wire import concat_payloads
from kvsim.kernels.fp16_bits import (
    f16_bits_to_f32_bits,
    f16_bits_to_f32_rows,
    f32_bits_to_f16_bits,
    f32_to_f16_bits_rows,
)
from kvsim.kernels.hadamard import check_hadamard_dim
from kvsim.kernels.lynx.format import (
    MU_FRAC_BITS,
    LynxArrays,
    LynxLayout,
    LynxTables,
    signed_values,
    write_scales,
)

_JIT = dict(cache=True, nogil=True, error_model="numpy")

# bf16 bits v (int16) -> key v ^ ((v >> 15) & 0x7FFF), ordered like the values; keys of
# finite values lie strictly between these two (exponent all ones: Inf, NaN beyond)
KEY16_POS_INF = 0x7F80  # key of +Inf (bits 0x7F80)
KEY16_NEG_INF = -32641  # key of -Inf (bits 0xFF80)


@numba.njit(**_JIT)
def _pack(fields, n, bits, out, pos):
    """fields[0:n] b-bit codes -> bytes out[pos:pos + ceil(n*b/8)], little-end first. Loops
    index a slice from 0 (out[pos + i] costs numba's negative-index wraparound per access and
    blocks vectorization)."""
    out = out[pos: pos + (n * bits + 7) // 8]
    pos = 0
    if bits == 8:
        for i in range(n):
            out[pos + i] = fields[i]
    elif bits == 4:
        m = n // 2
        for i in range(m):
            out[pos + i] = fields[2 * i] | (fields[2 * i + 1] << 4)
        if n % 2:
            out[pos + m] = fields[n - 1]
    elif bits == 2:
        m = n // 4
        for i in range(m):
            out[pos + i] = (fields[4 * i] | (fields[4 * i + 1] << 2) | (fields[4 * i + 2] << 4)
                            | (fields[4 * i + 3] << 6))
        if n % 4:
            acc = 0
            for j in range(n - 4 * m):
                acc |= np.int64(fields[4 * m + j]) << (2 * j)
            out[pos + m] = acc
    elif bits == 6 and n % 4 == 0:  # 4 codes in 3 bytes, little-end first
        for i in range(n // 4):
            w = (np.int32(fields[4 * i]) | (np.int32(fields[4 * i + 1]) << 6)
                 | (np.int32(fields[4 * i + 2]) << 12) | (np.int32(fields[4 * i + 3]) << 18))
            out[3 * i] = w & 255
            out[3 * i + 1] = (w >> 8) & 255
            out[3 * i + 2] = w >> 16
    else:
        acc = np.int64(0)
        nb = 0
        p = pos
        for i in range(n):
            acc |= np.int64(fields[i]) << nb
            nb += bits
            while nb >= 8:
                out[p] = acc & 0xFF
                acc >>= 8
                nb -= 8
                p += 1
        if nb > 0:
            out[p] = acc & 0xFF


@numba.njit(**_JIT)
def _nibble_streams(cb, codes, sh0, nstreams, f0, f1, o0, o1):
    """Nibble fields of one chunk (split [4] or [4, 4], even count m): cb [m] fp32 bits of u,
    codes [m] magnitude codes -> o0 [m / 2] anchor bytes (sign, u < 0 but not -0.0, over the
    top bits code >> sh0), o1 [m / 2] residual bytes (the low 4 bits as a signed digit,
    nstreams == 2), first field in the low nibble. Fields go one per byte in contiguous
    loops, then pairs of bytes (a uint16 view, little-endian) -> one byte: strided pair
    loops do not vectorize (3x slower). f0 / f1: uint8 [m] scratch (may be the same)."""
    izero = np.int32(0)
    imin = np.int32(-2147483648)  # bits of -0.0
    sh = sh0 & np.int32(31)  # masked shift count (module doc)
    for j in range(codes.shape[0]):
        b = cb[j]
        sg = np.int32(np.int32(b < izero) & np.int32(b != imin))
        f0[j] = np.uint8(np.int32(codes[j] >> sh) | np.int32(sg << np.int32(3)))
    _pack_nibble_pairs(f0, o0)
    if nstreams == 2:
        for j in range(codes.shape[0]):
            f1[j] = np.uint8(np.int32(codes[j] & np.int32(15)) ^ np.int32(8))
        _pack_nibble_pairs(f1, o1)


@numba.njit(**_JIT)
def _pack_nibble_pairs(f, o):
    """f [2n] uint8 fields < 16 -> o [n]: o[i] = f[2i] | f[2i + 1] << 4."""
    fw = f.view(np.uint16)
    for i in range(o.shape[0]):
        w = fw[i]
        o[i] = np.uint8((w & np.uint16(0x0F)) | ((w >> np.uint16(4)) & np.uint16(0xF0)))


@numba.njit(**_JIT)
def _unpack(src, pos, n, bits, fields):
    """Inverse of _pack: bytes src[pos:] -> fields[0:n] (indexing a slice from 0, as _pack)."""
    src = src[pos: pos + (n * bits + 7) // 8]
    pos = 0
    if bits == 8:
        for i in range(n):
            fields[i] = src[pos + i]
    elif bits == 4:
        for i in range(n // 2):
            b = src[pos + i]
            fields[2 * i] = b & 15
            fields[2 * i + 1] = b >> 4
        if n % 2:
            fields[n - 1] = src[pos + n // 2] & 15
    elif bits == 2:
        for i in range(n // 4):
            b = src[i]
            fields[4 * i] = b & 3
            fields[4 * i + 1] = (b >> 2) & 3
            fields[4 * i + 2] = (b >> 4) & 3
            fields[4 * i + 3] = b >> 6
        for i in range(n - n % 4, n):
            fields[i] = (src[i // 4] >> (2 * (i % 4))) & 3
    elif bits == 6 and n % 4 == 0:  # 4 codes in 3 bytes, little-end first
        for i in range(n // 4):
            w = (np.int32(src[3 * i]) | (np.int32(src[3 * i + 1]) << 8)
                 | (np.int32(src[3 * i + 2]) << 16))
            fields[4 * i] = w & 63
            fields[4 * i + 1] = (w >> 6) & 63
            fields[4 * i + 2] = (w >> 12) & 63
            fields[4 * i + 3] = w >> 18
    else:
        mask = (1 << bits) - 1
        acc = np.int64(0)
        nb = 0
        p = pos
        for i in range(n):
            while nb < bits:
                acc |= np.int64(src[p]) << nb
                p += 1
                nb += 8
            fields[i] = acc & mask
            acc >>= bits
            nb -= bits


@numba.njit(parallel=True, **_JIT)
def _encode_kernel(xf, xb, use_bits, P, C, split, shifts, lut_lo, lut_shift, lut,
                   stream_base, layer_bytes, full_bytes, code_off, row_bytes, meta_off,
                   lo_out, k_out, mu_out, sig_out, out, bad):
    """xf: [L, 2, H, T, D] fp32, or xb: same shape uint16 bf16 bits (use_bits).
    bad[w]: 1 when a bf16 input of work item w is Inf / NaN (Codec.encode's finite check,
    done in the page min / max; not set for fp32 input).
    Per stream s (buffer at out[stream_base[s]:]): layer_bytes, full_bytes (chunk bytes of a
    full page); code_off / row_bytes: [2 (full page, last page), streams]; meta_off:
    [2, 4] offsets of lo, mu, sigma, k in an anchor chunk. Writes the metadata arrays, the
    anchor metadata bytes and every stream's packed codes."""
    if use_bits:
        L, _, H, T, D = xb.shape
    else:
        L, _, H, T, D = xf.shape
    pages = (T + P - 1) // P
    nstreams = split.shape[0]
    cells = lut.shape[0]
    qscale = np.float32(1 << MU_FRAC_BITS)
    mscale = np.float32(2.0 ** -MU_FRAC_BITS)
    half = np.float32(0.5)
    m15 = np.int16(0x7FFF)
    m31 = np.int32(0x7FFFFFFF)
    for w in numba.prange(L * 2 * H * pages):
        p = w % pages
        row = (w // pages) % (2 * H)
        l = w // (pages * 2 * H)
        kv = row // H
        h = row % H
        t0 = p * P
        n = min(P, T - t0)
        last = 1 if p == pages - 1 else 0
        cpp = (n + C - 1) // C
        abase = stream_base[0] + l * layer_bytes[0] + p * full_bytes[0]
        buf = np.empty(n * D, np.float32)
        bu = buf.view(np.uint32)
        # ---- stage 1: load the page (widening bf16 bits) + page min / max, one pass ----
        # min / max run on integer keys ordered like the values (int16 lanes for bf16 bits,
        # int32 for fp32; -0.0 sorts below +0.0, normalized below): integer min / max
        # vectorize where the fp32 compare-select does not. bf16 keys also check the input:
        # finite keys lie strictly inside (KEY16_NEG_INF, KEY16_POS_INF).
        lo = np.empty(D, np.float32)
        hi = np.empty(D, np.float32)
        lou = lo.view(np.uint32)
        hiu = hi.view(np.uint32)
        if use_bits:
            lk = np.empty(D, np.int16)
            hk = np.empty(D, np.int16)
            lk[:] = 32767
            hk[:] = -32768
            for t in range(n):
                sr = xb[l, kv, h, t0 + t]
                si = sr.view(np.int16)
                ru = bu[t * D: (t + 1) * D]
                for d in range(D):
                    ru[d] = np.uint32(sr[d]) << np.uint32(16)
                for d in range(D):
                    v = si[d]
                    key = np.int16(v ^ np.int16(np.int16(v >> np.int16(15)) & m15))
                    a = lk[d]
                    b = hk[d]
                    lk[d] = key if key < a else a
                    hk[d] = key if key > b else b
            nonfinite = False
            for d in range(D):
                nonfinite |= (hk[d] >= KEY16_POS_INF) | (lk[d] <= KEY16_NEG_INF)
                a = lk[d] ^ ((lk[d] >> np.int16(15)) & m15)  # back to bf16 bits
                b = hk[d] ^ ((hk[d] >> np.int16(15)) & m15)
                lou[d] = np.uint32(np.uint16(a)) << np.uint32(16)
                hiu[d] = np.uint32(np.uint16(b)) << np.uint32(16)
            bad[w] = nonfinite
        else:
            bi0 = buf.view(np.int32)
            lk32 = np.empty(D, np.int32)
            hk32 = np.empty(D, np.int32)
            lk32[:] = 2147483647
            hk32[:] = -2147483648
            for t in range(n):
                buf[t * D: (t + 1) * D] = xf[l, kv, h, t0 + t]
                rk = bi0[t * D: (t + 1) * D]
                for d in range(D):
                    v = rk[d]
                    key = np.int32(v ^ np.int32(np.int32(v >> np.int32(31)) & m31))
                    a = lk32[d]
                    b = hk32[d]
                    lk32[d] = key if key < a else a
                    hk32[d] = key if key > b else b
            for d in range(D):
                lou[d] = np.uint32(lk32[d] ^ ((lk32[d] >> np.int32(31)) & m31))
                hiu[d] = np.uint32(hk32[d] ^ ((hk32[d] >> np.int32(31)) & m31))
        r = np.empty(D, np.float32)
        for d in range(D):
            lo[d] = lo[d] + np.float32(0.0)  # -0.0 -> +0.0, as the reference
            r[d] = hi[d] * half - lo[d] * half
        rb = r.view(np.int32)
        kk = np.empty(D, np.int8)
        fenc = np.empty(D, np.int32)
        lh = np.empty(D, np.float32)
        for d in range(D):
            k = ((rb[d] >> 23) & 0xFF) - 126
            k = max(-126, min(126, k))
            kk[d] = k
            fenc[d] = (127 - k) << 23
            lh[d] = lo[d] * half
        lo_out[l, p, kv, h] = lo
        k_out[l, p, kv, h] = kk
        o = abase + meta_off[last, 0] + row * D * 4
        out[o: o + D * 4] = lo.view(np.uint8)
        o = abase + meta_off[last, 3] + row * D
        out[o: o + D] = kk.view(np.uint8)
        fe = fenc.view(np.float32)
        # ---- stages 2-4 per chunk ----
        qsum = np.empty(D, np.int32)  # < 2^16 * 4096 tokens
        cmin = np.empty(D, np.float32)
        cmax_x = np.empty(D, np.float32)
        cmin_b = cmin.view(np.int32)
        cmax_b = cmax_x.view(np.int32)
        mu = np.empty(D, np.float32)
        mu16 = np.empty(D, np.uint16)
        sig16 = np.empty(D, np.uint16)
        scr16 = np.empty(D, np.float32)
        inv = np.empty(D, np.float32)
        bi = buf.view(np.int32)
        codes = np.empty(C * D, np.int32)  # magnitude code | sign << 8
        cellidx = np.empty(C * D, np.int32)
        ents = np.empty(C * D, np.int64)
        fields = np.empty((nstreams, C * D), np.uint8)
        shift = np.int32(lut_shift) & np.int32(31)  # masked (module doc)
        izero = np.int32(0)
        cmax = np.int32(cells - 1)
        nib = split[0] == 4 and (nstreams == 1 or (nstreams == 2 and split[1] == 4))
        for c0 in range(0, n, C):
            nc = min(C, n - c0)
            ci = (t0 + c0) // C
            m = nc * D
            qsum[:] = 0
            cmin_b[:] = 2147483647
            cmax_b[:] = -2147483648
            for t in range(c0, c0 + nc):  # normalize (stage 1) + fixed-point sum
                rw = buf[t * D: (t + 1) * D]
                for d in range(D):
                    xn = (rw[d] * half - lh[d]) * fe[d]
                    rw[d] = xn
                    qsum[d] += np.int32(xn * qscale)
            # chunk min / max of x' on its bits as int32: x' >= +0.0 (x >= the page min) or
            # -0.0 (x = -0.0 with a +0.0 minimum), and for such values the signed bit patterns
            # order like the values (-0.0 is the smallest, and equals 0): integer min / max
            for t in range(c0, c0 + nc):
                rk = bi[t * D: (t + 1) * D]
                for d in range(D):
                    v = rk[d]
                    a = cmin_b[d]
                    b = cmax_b[d]
                    cmin_b[d] = v if v < a else a
                    cmax_b[d] = v if v > b else b
            # qsum >= 0 (x' >= 0) and < 2^28: floor division = truncation of the fp64
            # quotient, which is exact here (a non-integer q / nc is at least 1 / nc below
            # the next integer, far above fp64's rounding) and vectorizes where integer
            # division does not (20 ns per channel)
            dn = np.float64(nc)
            for d in range(D):
                mq = np.int32(np.float64(qsum[d]) / dn)
                mu16[d] = mq
                mu[d] = np.float32(mq) * mscale
                # max_t |fl(x'_t - mu)| == max(fl(max x' - mu), fl(mu - min x')): rounding is
                # monotone and fl(a - b) = -fl(b - a), so no extra pass is needed for sigma
                a = cmax_x[d] - mu[d]
                b = mu[d] - cmin[d]
                inv[d] = a if a > b else b
            f32_to_f16_bits_rows(inv, sig16, scr16)  # branch-free: vectorizes
            f16_bits_to_f32_rows(sig16, inv)
            mu_out[l, kv, h, ci] = mu16
            sig_out[l, kv, h, ci] = sig16
            o = (row * cpp + c0 // C) * D * 2
            out[abase + meta_off[last, 1] + o: abase + meta_off[last, 1] + o + 2 * D] = \
                mu16.view(np.uint8)
            out[abase + meta_off[last, 2] + o: abase + meta_off[last, 2] + o + 2 * D] = \
                sig16.view(np.uint8)
            for d in range(D):
                sv = inv[d]
                inv[d] = np.float32(1.0) / sv if sv > 0 else np.float32(0.0)
            # u = (x' - mu) * (1/sigma), signed; code = LUT over the bits of |u|
            for t in range(c0, c0 + nc):
                rw = buf[t * D: (t + 1) * D]
                for d in range(D):
                    rw[d] = (rw[d] - mu[d]) * inv[d]
            cb = bi[c0 * D: c0 * D + m]
            # code = LUT over the bits of |u|, in simple loops so that only the table load
            # stays scalar (cell index, compare, fields and packing vectorize)
            for j in range(m):
                v = np.int32(np.int32(cb[j] & m31) - lut_lo)
                v = v if v > izero else izero
                v = np.int32(v >> shift)
                cellidx[j] = v if v < cmax else cmax
            for j in range(m):
                ents[j] = lut[cellidx[j]]
            for j in range(m):
                ent = ents[j]
                codes[j] = np.int32(ent >> 32) + np.int32((cb[j] & m31) > (ent & 0xFFFFFFFF))
            if nib and m % 2 == 0:  # 4+4 or 4: both nibble streams from pairs of codes
                pos0 = (stream_base[0] + l * layer_bytes[0] + p * full_bytes[0]
                        + code_off[last, 0] + row * row_bytes[last, 0] + (c0 * D) // 2)
                pos1 = (stream_base[nstreams - 1] + l * layer_bytes[nstreams - 1]
                        + p * full_bytes[nstreams - 1] + code_off[last, nstreams - 1]
                        + row * row_bytes[last, nstreams - 1] + (c0 * D) // 2)
                sh0 = np.int32(shifts[0]) & np.int32(31)
                _nibble_streams(cb, codes[:m], sh0, nstreams, fields[0][:m],
                                fields[nstreams - 1][:m], out[pos0: pos0 + m // 2],
                                out[pos1: pos1 + m // 2])
                continue
            for j in range(m):  # magnitude code | sign << 8 for the general split below
                b = cb[j]
                codes[j] |= np.int32((b < 0) & ((b & m31) != 0)) << np.int32(8)
            for s in range(nstreams):
                pos = (stream_base[s] + l * layer_bytes[s] + p * full_bytes[s]
                       + code_off[last, s] + row * row_bytes[last, s] + (c0 * D * split[s]) // 8)
                # field = (((mag >> sh) & msk) ^ top) | sign bit (anchor only): one formula
                bs = split[s]
                sh = np.int32(shifts[s]) & np.int32(31)
                if s == 0:
                    msk, top = np.int32((1 << (bs - 1)) - 1), np.int32(0)
                    sgn, smask = np.int32(8 - (bs - 1)), np.int32(1 << (bs - 1))
                else:
                    msk, top = np.int32((1 << bs) - 1), np.int32(1 << (bs - 1))
                    sgn, smask = np.int32(8), np.int32(0)
                sgn = sgn & np.int32(31)
                if bs == 4:
                    ob = out[pos: pos + (m + 1) // 2]
                    for i in range(m // 2):
                        c = codes[2 * i]
                        e = codes[2 * i + 1]
                        fc = ((((c & 255) >> sh) & msk) ^ top) | (((c & 256) >> sgn) & smask)
                        fe2 = ((((e & 255) >> sh) & msk) ^ top) | (((e & 256) >> sgn) & smask)
                        ob[i] = np.uint8(fc | (fe2 << 4))
                    if m % 2:
                        c = codes[m - 1]
                        ob[m // 2] = np.uint8(
                            ((((c & 255) >> sh) & msk) ^ top) | (((c & 256) >> sgn) & smask))
                else:
                    fs = fields[s]
                    for j in range(m):
                        c = codes[j]
                        fs[j] = ((((c & 255) >> sh) & msk) ^ top) | (((c & 256) >> sgn) & smask)
                    _pack(fs, m, bs, out, pos)


@numba.njit(parallel=True, **_JIT)
def _decode_kernel(src, nstreams, P, C, split, values, stream_base, layer_bytes, full_bytes,
                   code_off, row_bytes, meta_off, out_f, out_b, to_bits):
    """Inverse of _encode_kernel on the first `nstreams` streams, reading the metadata from
    the anchor bytes. values: lynx.signed_values for that many streams. Writes out_f
    [L, 2, H, T, D] fp32, or out_b bf16 bits (to_bits: clamped to finite bf16, RNE)."""
    if to_bits:
        L, _, H, T, D = out_b.shape
    else:
        L, _, H, T, D = out_f.shape
    pages = (T + P - 1) // P
    mscale = np.float32(2.0 ** -MU_FRAC_BITS)
    big = np.float32(3.3895313892515355e38)  # largest finite bf16
    for w in numba.prange(L * 2 * H * pages):
        p = w % pages
        row = (w // pages) % (2 * H)
        l = w // (pages * 2 * H)
        kv = row // H
        h = row % H
        t0 = p * P
        n = min(P, T - t0)
        last = 1 if p == pages - 1 else 0
        cpp = (n + C - 1) // C
        abase = stream_base[0] + l * layer_bytes[0] + p * full_bytes[0]
        lo8 = np.empty(4 * D, np.uint8)
        o = abase + meta_off[last, 0] + row * D * 4
        lo8[:] = src[o: o + 4 * D]
        lo = lo8.view(np.float32)
        fdec = np.empty(D, np.int32)
        o = abase + meta_off[last, 3] + row * D
        for d in range(D):
            fdec[d] = (np.int32(np.int8(src[o + d])) + 128) << 23
        fd = fdec.view(np.float32)
        fields = np.empty((nstreams, C * D), np.uint8)
        keys = np.empty(C * D, np.int32)
        key8 = np.empty(C * D + (C * D) % 2, np.uint8)  # 4+4 keys (even: a uint16 view)
        vals = np.empty(C * D, np.float32)
        res = np.empty(C * D, np.float32)
        rbits = res.view(np.uint32)
        m8 = np.empty(2 * D, np.uint8)
        s8 = np.empty(2 * D, np.uint8)
        mu = np.empty(D, np.float32)
        sg = np.empty(D, np.float32)
        for c0 in range(0, n, C):
            nc = min(C, n - c0)
            m = nc * D
            o = (row * cpp + c0 // C) * D * 2
            m8[:] = src[abase + meta_off[last, 1] + o: abase + meta_off[last, 1] + o + 2 * D]
            s8[:] = src[abase + meta_off[last, 2] + o: abase + meta_off[last, 2] + o + 2 * D]
            m16 = m8.view(np.uint16)
            for d in range(D):
                mu[d] = np.float32(m16[d]) * mscale
            f16_bits_to_f32_rows(s8.view(np.uint16), sg)
            pos0 = (stream_base[0] + l * layer_bytes[0] + p * full_bytes[0]
                    + code_off[last, 0] + row * row_bytes[last, 0] + (c0 * D * split[0]) // 8)
            if nstreams == 2 and split[0] == 4 and split[1] == 4:  # 4+4: keys from 2 bytes
                pos1 = (stream_base[1] + l * layer_bytes[1] + p * full_bytes[1]
                        + code_off[last, 1] + row * row_bytes[last, 1] + (c0 * D * 4) // 8)
                s0 = src[pos0: pos0 + (m + 1) // 2]  # slices: index from 0 (see _pack)
                s1 = src[pos1: pos1 + (m + 1) // 2]
                # two keys (one byte each) per uint16 word of key8, little-endian: a
                # contiguous loop where strided int32 stores do not vectorize
                kw = key8.view(np.uint16)
                for i in range(m // 2):
                    a = np.uint16(s0[i])
                    b = np.uint16(s1[i])
                    kw[i] = np.uint16(np.uint16(np.uint16(a & np.uint16(15)) << np.uint16(4))
                                      | np.uint16(b & np.uint16(15))
                                      | np.uint16(np.uint16(a & np.uint16(0xF0)) << np.uint16(8))
                                      | np.uint16(np.uint16(b >> np.uint16(4)) << np.uint16(8)))
                if m % 2:
                    key8[m - 1] = np.uint8(((np.int32(s0[m // 2]) & 15) << 4)
                                           | (np.int32(s1[m // 2]) & 15))
                for j in range(m):  # the only scalar loop: table load (signed value / sigma)
                    vals[j] = values[key8[j]]
            else:
                for s in range(nstreams):
                    pos = (stream_base[s] + l * layer_bytes[s] + p * full_bytes[s]
                           + code_off[last, s] + row * row_bytes[last, s]
                           + (c0 * D * split[s]) // 8)
                    _unpack(src, pos, m, split[s], fields[s])
                f0 = fields[0]
                for j in range(m):
                    keys[j] = f0[j]
                for s in range(1, nstreams):
                    bs = np.int32(split[s]) & np.int32(31)  # masked (module doc)
                    fs = fields[s]
                    for j in range(m):
                        keys[j] = np.int32(np.int32(keys[j] << bs) | np.int32(fs[j]))
                for j in range(m):  # the only scalar loop: table load (signed value / sigma)
                    vals[j] = values[keys[j]]
            for t in range(nc):
                rv = vals[t * D: (t + 1) * D]
                rr = res[t * D: (t + 1) * D]
                for d in range(D):
                    rr[d] = lo[d] + (mu[d] + sg[d] * rv[d]) * fd[d]
            if to_bits:  # clamp to finite bf16, round to nearest even, from the fp32 bits
                ob = out_b[l, kv, h]
                for t in range(nc):
                    rr = res[t * D: (t + 1) * D]
                    for d in range(D):
                        rr[d] = max(-big, min(big, rr[d]))
                    rb = rbits[t * D: (t + 1) * D]
                    orow = ob[t0 + c0 + t]
                    for d in range(D):
                        ub = rb[d]
                        ub = ub + np.uint32(0x7FFF) + ((ub >> np.uint32(16)) & np.uint32(1))
                        orow[d] = np.uint16(ub >> np.uint32(16))
            else:
                of = out_f[l, kv, h]
                for t in range(nc):
                    of[t0 + c0 + t] = res[t * D: (t + 1) * D]


@numba.njit(**_JIT)
def _fwht_row(y):
    """In place on one row y [d] fp32 (d a power of two): the butterflies of
    kvsim.kernels.hadamard.hadamard, level h pairing (j, j + h) in blocks of 2h (a + b,
    a - b), without the final scale. Levels 1, 2, 4 run per group of 8 (written out, the
    same pairs in the same levels), levels >= 8 on contiguous slices (vectorized); pairs of
    one level are independent, so the result is the reference's bit for bit."""
    d = y.shape[0]
    if d < 8:
        h = 1
        while h < d:
            for i in range(0, d, 2 * h):
                for j in range(i, i + h):
                    a = y[j]
                    b = y[j + h]
                    y[j] = a + b
                    y[j + h] = a - b
            h *= 2
        return
    for g in range(d // 8):
        v = y[8 * g: 8 * g + 8]
        a0 = v[0] + v[1]
        a1 = v[0] - v[1]
        a2 = v[2] + v[3]
        a3 = v[2] - v[3]
        a4 = v[4] + v[5]
        a5 = v[4] - v[5]
        a6 = v[6] + v[7]
        a7 = v[6] - v[7]
        b0 = a0 + a2
        b2 = a0 - a2
        b1 = a1 + a3
        b3 = a1 - a3
        b4 = a4 + a6
        b6 = a4 - a6
        b5 = a5 + a7
        b7 = a5 - a7
        v[0] = b0 + b4
        v[4] = b0 - b4
        v[1] = b1 + b5
        v[5] = b1 - b5
        v[2] = b2 + b6
        v[6] = b2 - b6
        v[3] = b3 + b7
        v[7] = b3 - b7
    h = 8
    while h < d:
        for i in range(0, d, 2 * h):
            ya = y[i: i + h]
            yb = y[i + h: i + 2 * h]
            for j in range(h):
                a = ya[j]
                b = yb[j]
                ya[j] = a + b
                yb[j] = a - b
        h *= 2


@numba.njit(parallel=True, **_JIT)
def _fwht_kernel(x, out, scale):
    """x, out: [n, d] fp32, d a power of two -> out = hadamard(x) (butterflies, then * scale),
    bit-identical to kvsim.kernels.hadamard.hadamard. Rows in parallel."""
    n, d = x.shape
    for r in numba.prange(n):
        y = out[r]
        y[:] = x[r]
        _fwht_row(y)
        for j in range(d):
            y[j] = y[j] * scale


@numba.njit(**_JIT)
def _abs_max_bits(y):
    """fp32 bits (int32) of max |y| over a finite fp32 row: |y| as int32 orders like the
    value, and the integer reduction vectorizes where the fp32 max does not (int32
    compare-selects: see the module doc)."""
    yb = y.view(np.int32)
    m = np.int32(0)
    m31 = np.int32(0x7FFFFFFF)
    for j in range(y.shape[0]):
        v = np.int32(yb[j] & m31)
        m = v if v > m else m
    return m


@numba.njit(**_JIT)
def _norm_sq(y, den, lanes, acc):
    """sum of (y_j / den)^2 (mul, then add: no FMA) in `lanes` interleaved fp32 partial sums
    (element j into lane j % lanes), the lanes added in order, then the tail (d % lanes
    elements) in order: torch's CPU reduction over the last dim (see _torch_norm_lanes).
    acc: scratch fp32 of at least lanes + d (numba does not check bounds: every caller
    allocates exactly that): the squares go to acc[lanes:] first, in a loop that
    vectorizes (the divisions in the lane loop did not: 3x)."""
    d = y.shape[0]
    vec = d - d % lanes
    sq = acc[lanes: lanes + d]
    for j in range(d):
        q = y[j] / den
        sq[j] = q * q
    if lanes == 8:  # literal width: eight partial sums in registers
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for j0 in range(0, vec, 8):
            s8 = sq[j0: j0 + 8]
            a0 = a0 + s8[0]
            a1 = a1 + s8[1]
            a2 = a2 + s8[2]
            a3 = a3 + s8[3]
            a4 = a4 + s8[4]
            a5 = a5 + s8[5]
            a6 = a6 + s8[6]
            a7 = a7 + s8[7]
        tot = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    else:
        for k in range(lanes):
            acc[k] = 0.0
        for j in range(vec):
            acc[j % lanes] = acc[j % lanes] + sq[j]
        tot = acc[0]
        for k in range(1, lanes):
            tot = tot + acc[k]
    for j in range(vec, d):
        tot = tot + sq[j]
    return tot


@numba.njit(parallel=True, **_JIT)
def _oscar_forward_kernel(xf, xb, use_bits, nkv, scale, lanes, out, s16, amax):
    """OScaR preconditioning of rows kv < nkv of xf (fp32) or xb (bf16 bits, use_bits), both
    [L, 2, H, T, D] -> out (same shape, fp32) and s16 [L, nkv, H, T] (fp16 bits), op for op
    as lynx.oscar_forward with the reference rotation:
        y = hadamard(x); peak = max |y|; norm = peak * ||y / (peak or 1)||_2;
        s16 = fp16(min(norm, 65504)); out = y * (1 / fp32(s16), 0 when s16 is 0),
    the norm as torch computes it (_norm_sq with `lanes` from _torch_norm_lanes, then
    sqrt). amax[w]: max |x| of work item w (the reference refuses >= 2^100 first)."""
    if use_bits:
        L, _, H, T, D = xb.shape
    else:
        L, _, H, T, D = xf.shape
    fp16_max = np.float32(65504.0)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for w in numba.prange(L * nkv * H):
        h = w % H
        kv = (w // H) % nkv
        l = w // (H * nkv)
        acc = np.empty(lanes + D, np.float32)  # _norm_sq scratch
        tmp = np.empty(1, np.float32)
        tmpb = tmp.view(np.uint32)
        tmpi = tmp.view(np.int32)
        ami = np.int32(0)
        for t in range(T):
            y = out[l, kv, h, t]
            if use_bits:
                yb = y.view(np.uint32)
                src = xb[l, kv, h, t]
                for j in range(D):
                    yb[j] = np.uint32(src[j]) << np.uint32(16)
            else:
                y[:] = xf[l, kv, h, t]
            am = _abs_max_bits(y)
            ami = am if am > ami else ami
            _fwht_row(y)
            for j in range(D):
                y[j] = y[j] * scale
            tmpi[0] = _abs_max_bits(y)
            peak = tmp[0]
            tot = _norm_sq(y, peak if peak > zero else one, lanes, acc)
            tmp[0] = min(peak * np.sqrt(tot), fp16_max)
            hs = f32_bits_to_f16_bits(np.int64(tmpb[0]))
            s16[l, kv, h, t] = hs
            tmpb[0] = np.uint32(f16_bits_to_f32_bits(hs))
            sv = tmp[0]
            inv = one / sv if sv > zero else zero
            for j in range(D):
                y[j] = y[j] * inv
        tmpi[0] = ami
        amax[w] = tmp[0]


@numba.njit(parallel=True, **_JIT)
def _oscar_inverse_kernel(x, s16, nkv, scale, pre_max, post_max, to_bits, out_b):
    """Undo _oscar_forward_kernel on rows kv < nkv of x [L, 2, H, T, D] fp32, op for op as
    the decode path of lynx.LynxCodec: clamp to +-pre_max, * fp32(s16) (s16: fp16 bits
    [L, nkv, H, T]), hadamard (butterflies, then * scale), clamp to +-post_max. Writes x in
    place, or (to_bits) the bf16 bits of the result into out_b (same shape as x, uint16;
    round to nearest even as torch .to(torch.bfloat16))."""
    L, _, H, T, D = x.shape
    for w in numba.prange(L * nkv * H):
        h = w % H
        kv = (w // H) % nkv
        l = w // (H * nkv)
        tmp = np.empty(1, np.float32)
        tmpb = tmp.view(np.uint32)
        for t in range(T):
            y = x[l, kv, h, t]
            tmpb[0] = np.uint32(f16_bits_to_f32_bits(np.int64(s16[l, kv, h, t])))
            sr = tmp[0]
            for j in range(D):
                y[j] = max(-pre_max, min(pre_max, y[j])) * sr
            _fwht_row(y)
            for j in range(D):
                y[j] = max(-post_max, min(post_max, y[j] * scale))
            if to_bits:
                yb = y.view(np.uint32)
                ob = out_b[l, kv, h, t]
                for j in range(D):
                    ub = yb[j]
                    ub = ub + np.uint32(0x7FFF) + ((ub >> np.uint32(16)) & np.uint32(1))
                    ob[j] = np.uint16(ub >> np.uint32(16))


def fwht_cpu(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim of a CPU tensor, fp32 out,
    bit-identical to kvsim.kernels.hadamard.hadamard (checked by tests/test_lynx.py)."""
    d = x.shape[-1]
    check_hadamard_dim(d)
    src = x.to(torch.float32).contiguous().reshape(-1, d)
    out = torch.empty_like(src)
    _fwht_kernel(src.numpy(), out.numpy(), np.float32(1.0 / math.sqrt(d)))
    return out.reshape(x.shape)


@functools.lru_cache(maxsize=16)
def _torch_norm_lanes(d: int) -> int:
    """The lane count with which _oscar_forward_kernel's L2 norm equals torch's
    .norm(dim=-1) bit for bit on rows of d fp32 values (torch's vectorized reduction: 8 lanes
    with AVX2, 16 with AVX-512), found on a probe batch; 0 when no lane count matches (the
    caller then keeps the torch reference)."""
    g = torch.Generator().manual_seed(1234)
    y = torch.randn(512, d, generator=g) * torch.rand(512, 1, generator=g) * 7
    y[0] = 0.0  # a zero row (peak 0)
    want = y.abs().amax(-1, keepdim=True)
    want = want * (y / torch.where(want > 0, want, 1.0)).norm(dim=-1, keepdim=True)
    want16 = want.clamp(max=torch.finfo(torch.float16).max).to(torch.float16)
    want16 = want16.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    for lanes in (8, 16, 4, 32, 1):
        if np.array_equal(_norm16(y.numpy(), lanes), want16):
            return lanes
    return 0


@numba.njit(**_JIT)
def _norm16_kernel(y, lanes, out):
    """fp16 bits of min(peak * ||y / peak||, 65504) per row of y [n, d], computed as in
    _oscar_forward_kernel (the probe of _torch_norm_lanes)."""
    acc = np.empty(lanes + y.shape[1], np.float32)  # _norm_sq scratch
    tmp = np.empty(1, np.float32)
    tmpb = tmp.view(np.uint32)
    tmpi = tmp.view(np.int32)
    for i in range(y.shape[0]):
        tmpi[0] = _abs_max_bits(y[i])
        peak = tmp[0]
        tot = _norm_sq(y[i], peak if peak > np.float32(0.0) else np.float32(1.0), lanes, acc)
        tmp[0] = min(peak * np.sqrt(tot), np.float32(65504.0))
        out[i] = f32_bits_to_f16_bits(np.int64(tmpb[0]))


def _norm16(y: np.ndarray, lanes: int) -> np.ndarray:
    out = np.empty(y.shape[0], np.uint16)
    _norm16_kernel(np.ascontiguousarray(y, np.float32), lanes, out)
    return out


def oscar_forward_cpu(kv: torch.Tensor, targets: str) -> tuple[torch.Tensor, torch.Tensor]:
    """lynx.oscar_forward with the reference rotation, fused in one numba pass per block of
    rows (bf16 read from its bits: no fp32 copy of the cache; no temporaries): same
    (preconditioned fp32 x, fp16 scales [L, T_kv, H, T]), bit for bit. Falls back to the
    torch path where torch's norm reduction order is not reproduced (_torch_norm_lanes)."""
    from kvsim.kernels.lynx.format import OSCAR_MAX_ABS
    from kvsim.kernels.lynx.reference import oscar_forward

    L, _, H, T, D = (int(v) for v in kv.shape)
    check_hadamard_dim(D)
    lanes = _torch_norm_lanes(D)
    if not lanes:
        return oscar_forward(kv.to(torch.float32), targets, fwht_cpu)
    nkv = 2 if targets == "kv" else 1
    x = kv.detach().contiguous()
    if x.dtype == torch.bfloat16:
        xb, xf, use_bits = x.view(torch.int16).numpy().view(np.uint16), _F32_1, True
    else:
        x = x.to(torch.float32)
        xb, xf, use_bits = _U16_1, x.numpy(), False
    # np.empty, not torch.empty: torch's allocator takes ~4x longer for a fresh 100 MB
    # block on some CPU hosts (page faulting), numpy's is what clone costs elsewhere
    out = torch.from_numpy(np.empty((L, 2, H, T, D), np.float32))
    s16 = np.empty((L, nkv, H, T), np.uint16)
    amax = np.zeros(L * nkv * H, np.float32)
    _oscar_forward_kernel(xf, xb, use_bits, nkv, np.float32(1.0 / math.sqrt(D)), lanes,
                          out.numpy(), s16, amax)
    peaks = [float(amax.max()) if amax.size else 0.0]  # NaN / Inf propagate (from the bits)
    if nkv == 1:  # V passes through (fp32), its max |x| counts for the checks as well
        out[:, 1] = x[:, 1]
        if x.numel():
            peaks.append(float(x[:, 1].abs().max()))
    peak = max(peaks)
    if not all(math.isfinite(v) for v in peaks):  # (max() would drop a NaN)
        check_finite(kv)  # raises the error Codec.encode would have (it left the check here)
    if peak >= OSCAR_MAX_ABS:
        oscar_forward(kv.to(torch.float32), targets, fwht_cpu)  # raises the reference's error
    return out, torch.from_numpy(s16.view(np.int16)).view(torch.float16)


def oscar_inverse_cpu(x: torch.Tensor, scales: torch.Tensor, targets: str, pre_max: float,
                      post_max: float, bf16: bool = False) -> torch.Tensor:
    """x [L, 2, H, T, D] fp32 (CPU, overwritten): clamp to +-pre_max, lynx.oscar_inverse
    with the reference rotation, clamp to +-post_max, in one numba pass per block of rows; bit
    for bit the torch sequence in LynxCodec._decode. Returns x, or (bf16) the result rounded
    to bf16 as torch .to(torch.bfloat16), written by the same pass."""
    D = int(x.shape[-1])
    check_hadamard_dim(D)
    nkv = 2 if targets == "kv" else 1
    s16 = scales.contiguous().view(torch.int16).numpy().view(np.uint16)
    out_b = np.empty(tuple(x.shape), np.uint16) if bf16 else _U16_1
    _oscar_inverse_kernel(x.numpy(), s16, nkv, np.float32(1.0 / math.sqrt(D)),
                          np.float32(pre_max), np.float32(post_max), bf16, out_b)
    if nkv == 1:
        x[:, 1].clamp_(-pre_max, pre_max).clamp_(-post_max, post_max)
    if not bf16:
        return x
    out = torch.from_numpy(out_b.view(np.int16)).view(torch.bfloat16)
    if nkv == 1:
        out[:, 1] = x[:, 1]
    return out


_F32_1 = np.empty((1, 1, 1, 1, 1), np.float32)  # placeholder for the unused input
_U16_1 = np.empty((1, 1, 1, 1, 1), np.uint16)


def _layout_arrays(lay: LynxLayout, streams: int) -> tuple[np.ndarray, ...]:
    n = streams
    base = np.zeros(n, np.int64)
    layer_b = np.array([lay.layer_bytes(s) for s in range(n)], np.int64)
    base[1:] = np.cumsum(layer_b * lay.shape.layers)[:-1]
    full = lay.full or lay.last
    full_b = np.array([full.chunk_bytes[s] if lay.full else 0 for s in range(n)], np.int64)
    code_off = np.array([[full.code_off[s] for s in range(n)],
                         [lay.last.code_off[s] for s in range(n)]], np.int64)
    rows = np.array([[full.row_bytes[s] for s in range(n)],
                     [lay.last.row_bytes[s] for s in range(n)]], np.int64)
    meta = np.array([[pl.lo_off, pl.mu_off, pl.sigma_off, pl.k_off] for pl in (full, lay.last)],
                    np.int64)
    return base, layer_b, full_b, code_off, rows, meta


def encode_cpu(x: torch.Tensor, lay: LynxLayout, tab: LynxTables,
               scales: torch.Tensor | None) -> LynxArrays:
    """x: [L, 2, H, T, D] bf16/fp16/fp32 CPU tensor (preconditioned) -> LynxArrays."""
    L, H, D = lay.shape.layers, lay.shape.kv_heads, lay.shape.head_dim
    split = np.asarray(tab.split, np.int64)
    n = len(tab.split)
    base, layer_b, full_b, code_off, rows, meta = _layout_arrays(lay, n)
    out = np.empty(int(base[-1] + layer_b[-1] * L), np.uint8)
    bad = np.zeros(L * 2 * H * lay.pages, np.bool_)
    lo = np.empty((L, lay.pages, 2, H, D), np.float32)
    k = np.empty((L, lay.pages, 2, H, D), np.int8)
    mu = np.empty((L, 2, H, lay.total_chunks, D), np.uint16)
    sig = np.empty((L, 2, H, lay.total_chunks, D), np.uint16)
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        xb = x.view(torch.int16).numpy().view(np.uint16)
        xf = np.empty((1, 1, 1, 1, 1), np.float32)
        use_bits = True
    else:
        xf = x.to(torch.float32).numpy()
        xb = np.empty((1, 1, 1, 1, 1), np.uint16)
        use_bits = False
    shifts = np.array([tab.field_shift(s) for s in range(n)], np.int64)
    _encode_kernel(xf, xb, use_bits, lay.page_tokens, lay.chunk_tokens, split, shifts,
                   np.int32(tab.lut_lo), tab.lut_shift, _lut64(tab), base,
                   layer_b, full_b,
                   code_off, rows, meta, lo, k, mu, sig, out, bad)
    if bad.any():
        check_finite(x)  # raises the error Codec.encode would have
    buffers = [torch.from_numpy(out[base[s]: base[s] + layer_b[s] * L]) for s in range(n)]
    if scales is not None:
        write_scales(buffers[0], scales, lay)
    return LynxArrays(torch.from_numpy(lo), torch.from_numpy(k),
                      torch.from_numpy(mu.view(np.int16)),
                      torch.from_numpy(sig.view(np.float16)), scales, buffers)


def decode_cpu(buffers: list[torch.Tensor], lay: LynxLayout, tab: LynxTables, streams: int,
               bf16: bool = False) -> torch.Tensor:
    """Stream buffers (CPU uint8, chunks in (layer, page) order; first `streams`) ->
    [L, 2, H, T, D] fp32, or bf16 if asked (clamped to finite bf16, round to nearest even)."""
    L, H, T, D = lay.shape.layers, lay.shape.kv_heads, lay.shape.tokens, lay.shape.head_dim
    split = np.asarray(tab.split, np.int64)
    base, layer_b, full_b, code_off, rows, meta = _layout_arrays(lay, streams)
    # the streams of a local encode lie end to end in one buffer: read in place
    src = concat_payloads([b.numpy() for b in buffers[:streams]])
    if bf16:
        out_b = np.empty((L, 2, H, T, D), np.uint16)
        out_f = np.empty((1, 1, 1, 1, 1), np.float32)
    else:
        out_f = np.empty((L, 2, H, T, D), np.float32)
        out_b = np.empty((1, 1, 1, 1, 1), np.uint16)
    _decode_kernel(src, streams, lay.page_tokens, lay.chunk_tokens, split,
                   signed_values(tab, streams), base, layer_b, full_b, code_off, rows, meta,
                   out_f, out_b, bf16)
    if bf16:
        return torch.from_numpy(out_b.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(out_f)


@functools.lru_cache(maxsize=64)
def _lut64(tab: LynxTables) -> np.ndarray:
    """One int64 per LUT cell: base code << 32 | fp32 bits of the cell's threshold (inf when
    none). For non-negative floats, comparing bit patterns as integers orders like the floats,
    so code = base + (bits(|u|) > thr_bits) with a single table load."""
    return (tab.lut_base.astype(np.int64) << 32) | tab.lut_thr.view(np.uint32).astype(np.int64)
