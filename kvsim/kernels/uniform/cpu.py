"""Fast CPU path of the `uniform` codec: numba kernels, byte-identical to the torch reference.

One work item = one (layer, K|V, kv_head, page) block of `n` token rows of head_dim values,
in three passes: every row is widened once into a thread-local fp32 page buffer (bf16 input
straight from its bits, no fp32 copy of the cache) and the min / max of each group of `group`
channels taken; the scales and zero points of all the page's groups are rounded to fp16 at
once (branch-free vector loops of fp16_bits); then every group is quantized and the codes
bit-packed straight into the chunk payload buffer (all chunks of the stream laid end to end
in (layer, page) order, each chunk in uniform.py's payload layout: codes, then fp16 scales,
then fp16 zero points). Work items run in parallel (numba prange). Decode
mirrors it and writes fp32, bf16 or fp16 directly. bf16 input takes its group min / max on
int16 keys of the bits (16 lanes; the same pass checks for Inf / NaN, so Codec.encode skips
its own), and every inner loop indexes a slice from 0 (see lynx/cpu.py: numba's
negative-index wraparound on range(a, b) blocked vectorization).

The arithmetic is the exact op sequence of groupquant.quantize_groups / dequantize_groups
(IEEE fp32, no fast-math except in the order-free min/max, no FMA contraction):

    mn, mx  = group min, max (+ 0.0: -0.0 -> +0.0, as the reference)
    scale16 = fp16((mx - mn) / qmax)      zero16 = fp16(mn)     (round to nearest even)
    code    = clamp(floor((x - zero16) / scale16 + 0.5), 0, qmax), 0 when scale16 == 0
    x_hat   = zero16 + code * scale16

floor(clamp(w, 0, qmax)) == clamp(floor(w), 0, qmax) because 0 and qmax are integers, and
on [0, qmax] floor is the integer truncation, so the kernel clamps then truncates.
tests/test_uniform_cpu.py checks bytes and decoded tensors against the torch reference.
"""

from __future__ import annotations

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

_JIT = dict(cache=True, nogil=True, error_model="numpy")

OUT_F32, OUT_BF16, OUT_F16 = 0, 1, 2  # decode output modes
_OUT_MODE = {torch.float32: OUT_F32, torch.bfloat16: OUT_BF16, torch.float16: OUT_F16}


@numba.njit(fastmath={"nnan", "ninf", "nsz", "reassoc"}, **_JIT)
def group_minmax(x, a, b):
    """min, max of x[a:b] (fp32, finite). Min / max are exact whatever the order, so the
    reduction may be reordered (vectorized); the sign of a zero result is normalized by the
    caller. Loops index a slice from 0: numba's negative-index wraparound on a runtime
    start (x[i], i in range(a, b)) blocks vectorization (5x slower)."""
    xs = x[a:b]
    lo = xs[0]
    hi = xs[0]
    for i in range(1, b - a):
        v = xs[i]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    return lo, hi


@numba.njit(**_JIT)
def _quantize_slice(xs, qs, s, z, qmax):
    """qs[i] = clamp(floor((xs[i] - z) / s + 0.5), 0, qmax) for s > 0 (see module doc)."""
    zero = np.float32(0.0)
    half = np.float32(0.5)
    for i in range(xs.shape[0]):
        v = (xs[i] - z) / s + half
        v = v if v > zero else zero
        v = v if v < qmax else qmax
        qs[i] = np.int32(v)


@numba.njit(**_JIT)
def quantize_group(x, a, b, qmax, tmp, q):
    """One min/max group x[a:b] (fp32) -> codes q[a:b] and (scale16 bits, zero16 bits, lo,
    hi, scale, zero as fp32 after the fp16 round trip), op for op as the torch reference
    groupquant.quantize_groups: scale = fp16((hi - lo) / qmax), zero = fp16(lo), code =
    clamp(floor((x - zero) / scale + 0.5)); a constant group (scale 0) gets code 0. The
    sign of a zero min / max is normalized to +0.0. tmp: scratch fp32[2] (bit round trips)."""
    lo, hi = group_minmax(x, a, b)
    hs, hz, lo, hi, s, z = _scale_zero(lo, hi, qmax, tmp, tmp.view(np.uint32))
    if s > np.float32(0.0):
        _quantize_slice(x[a:b], q[a:b], s, z, qmax)
    else:
        q[a:b] = 0
    return hs, hz, lo, hi, s, z


@numba.njit(**_JIT)
def _scale_zero(lo, hi, qmax, tmp, tmpu):
    """Group min / max (fp32) -> (scale16 bits, zero16 bits, lo, hi with -0.0 -> +0.0,
    scale, zero as fp32 after the fp16 round trip). tmp / tmpu: fp32[2] scratch and its
    uint32 view (bit round trips), made once by the caller."""
    zero = np.float32(0.0)
    lo = lo + zero  # -0.0 -> +0.0
    hi = hi + zero
    tmp[0] = (hi - lo) / qmax
    tmp[1] = lo
    hs = f32_bits_to_f16_bits(np.int64(tmpu[0]))
    hz = f32_bits_to_f16_bits(np.int64(tmpu[1]))
    tmpu[0] = np.uint32(f16_bits_to_f32_bits(hs))
    tmpu[1] = np.uint32(f16_bits_to_f32_bits(hz))
    return hs, hz, lo, hi, tmp[0], tmp[1]


# bf16 bits b (as int16) -> an int16 key ordered like the values (b ^ 0x7FFF for negative b;
# -0.0 sorts below +0.0, normalized later): min / max of a group run on 16 int16 lanes
# (about 5x faster than the fp32 reduction). Keys of finite bf16 lie strictly between
# KEY_NONFINITE_NEG and KEY_NONFINITE_POS (exponent all ones = Inf / NaN), so the same
# reduction checks the input.
KEY_NONFINITE_POS = 0x7F80  # +Inf; NaNs above
KEY_NONFINITE_NEG = -32641  # key of -Inf (bits 0xFF80); negative NaNs below


@numba.njit(parallel=True, **_JIT)
def _encode_kernel(xf, xb, use_bits, P, G, bits, layer_bytes, full_bytes, out, peak, bad):
    """xf: [L, 2, H, T, D] fp32, or xb: same shape uint16 bf16 bits (use_bits).
    P: page tokens; G: group; layer_bytes / full_bytes: bytes of one layer / of a full-page
    chunk in `out` (uint8, every chunk in (layer, page) order). peak[w]: max |x| of work item
    w (for the fp16-range check); bad[w]: 1 when a bf16 input of item w is Inf / NaN (the
    finite check of Codec.encode, done here; not set for fp32 input)."""
    if use_bits:
        L, _, H, T, D = xb.shape
    else:
        L, _, H, T, D = xf.shape
    pages = (T + P - 1) // P
    ng = D // G
    per = 8 // bits
    rb = D // per  # packed bytes per row
    qmax = np.float32((1 << bits) - 1)
    zero = np.float32(0.0)
    kpos = np.int16(KEY_NONFINITE_POS)
    kneg = np.int16(KEY_NONFINITE_NEG)
    m15 = np.int16(0x7FFF)
    for w in numba.prange(L * 2 * H * pages):
        p = w % pages
        row = (w // pages) % (2 * H)
        l = w // (pages * 2 * H)
        kv = row // H
        h = row % H
        t0 = p * P
        n = min(P, T - t0)
        cbase = l * layer_bytes + p * full_bytes
        codes_at = cbase + row * n * rb
        scale_at = cbase + 2 * H * n * rb + row * n * ng * 2
        zero_at = scale_at + 2 * H * n * ng * 2
        codes = out[codes_at: codes_at + n * rb]  # slices: loops index them from 0
        sb = out[scale_at: scale_at + 2 * n * ng]
        zb = out[zero_at: zero_at + 2 * n * ng]
        # three passes over the page: (1) widen every row into a page buffer and take the
        # group min / max; (2) scales and zero points of all the page's groups at once, in
        # branch-free vector loops (as scalar code, fp16 rounding per group takes a third of
        # the time); (3) quantize and pack
        ngp = n * ng
        pbuf = np.empty(n * D, np.float32)
        pbu = pbuf.view(np.uint32)
        glo = np.empty(ngp, np.float32)
        ghi = np.empty(ngp, np.float32)
        glu = glo.view(np.uint32)
        ghu = ghi.view(np.uint32)
        key = np.empty(D, np.int16)
        q = np.empty(D, np.int32)
        nonfinite = False
        for t in range(n):
            buf = pbuf[t * D: (t + 1) * D]
            if use_bits:
                src = xb[l, kv, h, t0 + t]
                si = src.view(np.int16)
                bu = pbu[t * D: (t + 1) * D]
                for d in range(D):
                    bu[d] = np.uint32(src[d]) << np.uint32(16)
                for d in range(D):  # explicit int16: numba widens small ints to int64
                    v = si[d]
                    key[d] = np.int16(v ^ np.int16(np.int16(v >> np.int16(15)) & m15))
                for g in range(ng):
                    ks = key[g * G: (g + 1) * G]
                    kl = ks[0]
                    kh = ks[0]
                    for i in range(G):  # compare-selects on int16 lanes
                        v = ks[i]
                        kl = v if v < kl else kl
                        kh = v if v > kh else kh
                    nonfinite |= (kh >= kpos) | (kl <= kneg)
                    kl = np.int16(kl ^ np.int16(np.int16(kl >> np.int16(15)) & m15))  # bits
                    kh = np.int16(kh ^ np.int16(np.int16(kh >> np.int16(15)) & m15))
                    glu[t * ng + g] = np.uint32(np.uint16(kl)) << np.uint32(16)
                    ghu[t * ng + g] = np.uint32(np.uint16(kh)) << np.uint32(16)
            else:
                buf[:] = xf[l, kv, h, t0 + t]
                for g in range(ng):
                    lo, hi = group_minmax(buf, g * G, (g + 1) * G)
                    glo[t * ng + g] = lo
                    ghi[t * ng + g] = hi
        gsc = np.empty(ngp, np.float32)
        pk = zero
        for i in range(ngp):
            lo = glo[i] + zero  # -0.0 -> +0.0
            hi = ghi[i] + zero
            glo[i] = lo
            gsc[i] = (hi - lo) / qmax
            m = hi if hi > -lo else -lo
            pk = m if m > pk else pk
        hs16 = np.empty(ngp, np.uint16)
        hz16 = np.empty(ngp, np.uint16)
        scratch = np.empty(ngp, np.float32)
        f32_to_f16_bits_rows(gsc, hs16, scratch)
        f32_to_f16_bits_rows(glo, hz16, scratch)
        f16_bits_to_f32_rows(hs16, gsc)  # the scale and zero point as stored
        f16_bits_to_f32_rows(hz16, glo)
        sb[:] = hs16.view(np.uint8)
        zb[:] = hz16.view(np.uint8)
        for t in range(n):
            buf = pbuf[t * D: (t + 1) * D]
            for g in range(ng):
                a = g * G
                s = gsc[t * ng + g]
                if s > zero:
                    _quantize_slice(buf[a: a + G], q[a: a + G], s, glo[t * ng + g], qmax)
                else:
                    q[a: a + G] = 0
            ob = codes[t * rb: (t + 1) * rb]
            if bits == 8:
                for i in range(D):
                    ob[i] = np.uint8(q[i])
            elif bits == 4:
                for i in range(rb):
                    ob[i] = np.uint8(q[2 * i] | (q[2 * i + 1] << 4))
            else:
                for i in range(rb):
                    ob[i] = np.uint8(q[4 * i] | (q[4 * i + 1] << 2) | (q[4 * i + 2] << 4)
                                     | (q[4 * i + 3] << 6))
        peak[w] = pk
        bad[w] = nonfinite


@numba.njit(parallel=True, **_JIT)
def _decode_kernel(src, P, G, bits, layer_bytes, full_bytes, mode, out_f, out_b):
    """Inverse of _encode_kernel: src (uint8, chunks in (layer, page) order) -> out_f
    [L, 2, H, T, D] fp32 (mode OUT_F32) or out_b same shape uint16 bits of bf16 / fp16
    (mode OUT_BF16 / OUT_F16, round to nearest even as torch .to(); fp16 clamped to
    +-65504 first, as codec.cast_finite)."""
    if mode == 0:
        L, _, H, T, D = out_f.shape
    else:
        L, _, H, T, D = out_b.shape
    pages = (T + P - 1) // P
    ng = D // G
    per = 8 // bits
    rb = D // per
    mask = (1 << bits) - 1
    fp16_max = np.float32(65504.0)
    for w in numba.prange(L * 2 * H * pages):
        p = w % pages
        row = (w // pages) % (2 * H)
        l = w // (pages * 2 * H)
        kv = row // H
        h = row % H
        t0 = p * P
        n = min(P, T - t0)
        cbase = l * layer_bytes + p * full_bytes
        codes_at = cbase + row * n * rb
        scale_at = cbase + 2 * H * n * rb + row * n * ng * 2
        zero_at = scale_at + 2 * H * n * ng * 2
        codes = src[codes_at: codes_at + n * rb]  # slices: loops index them from 0
        sb = src[scale_at: scale_at + 2 * n * ng]
        zb = src[zero_at: zero_at + 2 * n * ng]
        res = np.empty(D, np.float32)
        rbits = res.view(np.uint32)
        c = np.empty(D, np.float32)
        sz = np.empty(2 * ng, np.float32)  # scale16, zero16 of the row's groups, as fp32
        szu = sz.view(np.uint32)
        for t in range(n):
            mo = (t * ng) * 2
            for g in range(ng):
                hs = np.int64(sb[mo + 2 * g]) | (np.int64(sb[mo + 2 * g + 1]) << 8)
                hz = np.int64(zb[mo + 2 * g]) | (np.int64(zb[mo + 2 * g + 1]) << 8)
                szu[2 * g] = np.uint32(f16_bits_to_f32_bits(hs))
                szu[2 * g + 1] = np.uint32(f16_bits_to_f32_bits(hz))
            cr = codes[t * rb: (t + 1) * rb]
            if bits == 8:
                for i in range(D):
                    c[i] = np.float32(cr[i])
            elif bits == 4:
                for i in range(rb):
                    byte = np.int32(cr[i])
                    c[2 * i] = np.float32(byte & mask)
                    c[2 * i + 1] = np.float32(byte >> 4)
            else:
                for i in range(rb):
                    byte = np.int32(cr[i])
                    c[4 * i] = np.float32(byte & mask)
                    c[4 * i + 1] = np.float32((byte >> 2) & mask)
                    c[4 * i + 2] = np.float32((byte >> 4) & mask)
                    c[4 * i + 3] = np.float32(byte >> 6)
            for g in range(ng):
                s = sz[2 * g]
                z = sz[2 * g + 1]
                cs = c[g * G: (g + 1) * G]
                rs = res[g * G: (g + 1) * G]
                for i in range(G):
                    rs[i] = z + cs[i] * s
            if mode == 0:
                out_f[l, kv, h, t0 + t] = res
            elif mode == 1:
                ob = out_b[l, kv, h, t0 + t]
                for d in range(D):
                    ub = rbits[d]
                    ub = ub + np.uint32(0x7FFF) + ((ub >> np.uint32(16)) & np.uint32(1))
                    ob[d] = np.uint16(ub >> np.uint32(16))
            else:  # clamped to finite fp16 first (the top code can land past 65504)
                ob = out_b[l, kv, h, t0 + t]
                for d in range(D):
                    res[d] = max(-fp16_max, min(fp16_max, res[d]))
                    ob[d] = np.uint16(f32_bits_to_f16_bits(np.int64(rbits[d])))


def _check(head_dim: int, group: int, bits: int, page_tokens: int) -> None:
    qmax_of(bits)
    if group < 1 or head_dim % group:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the group size {group}")
    if group % (8 // bits):
        raise ValueError(f"group size {group} must be a multiple of {8 // bits} for "
                         f"{bits}-bit packing")
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")


def encode_cpu(kv: torch.Tensor, page_tokens: int, group: int, bits: int, layer_bytes: int,
               full_bytes: int) -> tuple[np.ndarray, float, bool]:
    """kv: [L, 2, H, T, D] bf16/fp16/fp32 CPU tensor -> (payload bytes of every chunk laid end
    to end in (layer, page) order: uint8 [L * layer_bytes], peak |x| in fp32, finite). The
    caller refuses a peak above the fp16 range (the stored scales would be inf). finite:
    False when bf16 input holds Inf / NaN (checked in the kernel's min / max pass; fp16 /
    fp32 input is not checked here and reports True)."""
    if kv.dim() != 5:
        raise ValueError(f"encode_cpu expects [L, 2, H, T, D], got shape {tuple(kv.shape)}")
    L, _, H, T, D = (int(s) for s in kv.shape)
    _check(D, group, bits, page_tokens)
    x = kv.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        xb = x.view(torch.int16).numpy().view(np.uint16)
        xf = np.empty((1, 1, 1, 1, 1), np.float32)
        use_bits = True
    else:
        xf = x.to(torch.float32).numpy()
        xb = np.empty((1, 1, 1, 1, 1), np.uint16)
        use_bits = False
    out = np.empty(L * layer_bytes, np.uint8)
    pages = -(-T // page_tokens)
    peak = np.zeros(L * 2 * H * pages, np.float32)
    bad = np.zeros(L * 2 * H * pages, np.bool_)
    _encode_kernel(xf, xb, use_bits, page_tokens, group, bits, layer_bytes, full_bytes, out,
                   peak, bad)
    return out, float(peak.max()) if peak.size else 0.0, not bad.any()


def decode_cpu(src: np.ndarray, dims: tuple[int, ...], page_tokens: int, group: int, bits: int,
               layer_bytes: int, full_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of encode_cpu: src uint8 [L * layer_bytes] -> [L, 2, H, T, D] in `dtype`
    (fp32, or bf16 / fp16 rounded from the fp32 reconstruction exactly as torch .to())."""
    L, _, H, T, D = dims
    _check(D, group, bits, page_tokens)
    if src.nbytes != L * layer_bytes:
        raise ValueError(f"decode_cpu: {src.nbytes} payload bytes, expected {L * layer_bytes}")
    mode = _OUT_MODE.get(dtype, OUT_F32)
    src = np.ascontiguousarray(src, dtype=np.uint8)
    if mode == OUT_F32:
        out_f = np.empty(dims, np.float32)
        out_b = np.empty((1, 1, 1, 1, 1), np.uint16)
    else:
        out_f = np.empty((1, 1, 1, 1, 1), np.float32)
        out_b = np.empty(dims, np.uint16)
    _decode_kernel(src, page_tokens, group, bits, layer_bytes, full_bytes, mode, out_f, out_b)
    if mode == OUT_F32:
        return torch.from_numpy(out_f)
    t = torch.from_numpy(out_b.view(np.int16))
    return t.view(torch.bfloat16 if mode == OUT_BF16 else torch.float16)
