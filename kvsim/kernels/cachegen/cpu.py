"""CacheGen's quantizer and reconstruction as numba CPU kernels, op for op the torch reference
(cachegen.quantize_layer / cachegen._reconstruct), so both give the same bytes.

One layer at a time, work split over the 2 x kv_heads rows (prange). The kernels keep codes
as *symbols* in token order: sym[t, h, i, d] = code + qmax of token i's segment (anchor bits
for group anchors, the layer's K / V delta bits otherwise), uint8 in 0..2 qmax, and fp16
scales as their bit patterns [2, H, T]. Per (K/V, head) row, tokens in order:
  anchor token:  scale = fp16_up(max|x| / qmax_a); code = clamp(rint(x / scale)); the
                 reconstructed anchor a = code * scale is kept for the group
  other tokens:  the same on x - a with the delta bits
fp16_up(s): round to nearest even, then one fp16 step up if that fell below s (so
|x / scale| <= qmax); a scale that is inf in fp16 is reported in `overflow` (the caller
raises). All arithmetic in fp32, in the reference's order.

Decode (per chunk, nogil, on the decoder threads): scatter_chunk puts one chunk's decoded
segments back into the token-order symbols, reconstruct_chunk rebuilds its page straight in
the output dtype (bf16 / fp16 rounded from the fp32 reconstruction as codec.cast_finite).
"""

from __future__ import annotations

import numba
import numpy as np

from kvsim.kernels.fp16_bits import f16_bits_to_f32_bits, f32_bits_to_f16_bits
from kvsim.kernels.kivi.cpu import _store_row

_JIT = dict(cache=True, nogil=True, error_model="numpy")
FP16_INF_BITS = 0x7C00


@numba.njit(parallel=True, **_JIT)
def quantize_layer_kernel(x, is_anchor, qmax_a, qmax_k, qmax_v, sym, scales, overflow,
                          xb=None):
    """x fp32 [2, H, T, D] (finite) -> sym uint8 [2, H, T, D], scales uint16 [2, H, T]
    (fp16 bits); overflow int64 [2 H] set to 1 for a row whose scale overflows fp16.
    xb: the layer as bf16 bits (uint16 [2, H, T, D]) read instead of x (then any fp32
    array: its values are those bits widened, as torch's bf16 -> fp32 cast)."""
    heads, tokens, dim = sym.shape[1], sym.shape[2], sym.shape[3]
    for w in numba.prange(2 * heads):
        kv = w // heads
        h = w % heads
        q_delta = qmax_k if kv == 0 else qmax_v
        tmp = np.empty(1, np.float32)  # fp32 <-> bits round trips
        tmpu = tmp.view(np.uint32)
        anchor = np.zeros(dim, np.float32)  # reconstructed anchor of the current group
        row = np.empty(dim, np.float32)
        zero = np.float32(0.0)
        for t in range(tokens):
            if xb is not None:
                ru = row.view(np.uint32)
                src = xb[kv, h, t]
                for d in range(dim):
                    ru[d] = np.uint32(src[d]) << np.uint32(16)
            else:
                src32 = x[kv, h, t]
                for d in range(dim):
                    row[d] = src32[d]
            if is_anchor[t]:
                q = qmax_a
            else:
                q = q_delta
                for d in range(dim):
                    row[d] = row[d] - anchor[d]
            m = zero
            for d in range(dim):
                a = abs(row[d])
                if a > m:
                    m = a
            qf = np.float32(q)
            s = m / qf
            tmp[0] = s
            hb = f32_bits_to_f16_bits(np.int64(tmpu[0]))
            tmpu[0] = np.uint32(f16_bits_to_f32_bits(hb))
            if hb < FP16_INF_BITS and tmp[0] < s:
                hb += 1  # the next larger fp16 (bit pattern + 1 for positive values)
                tmpu[0] = np.uint32(f16_bits_to_f32_bits(hb))
            if hb >= FP16_INF_BITS:
                overflow[w] = 1
                hb = 0
                tmp[0] = zero
            s16 = tmp[0]
            safe = s16 if s16 > zero else np.float32(1.0)
            scales[kv, h, t] = np.uint16(hb)
            for d in range(dim):
                v = np.rint(row[d] / safe)
                v = v if v > -qf else -qf
                v = v if v < qf else qf
                sym[kv, h, t, d] = np.uint8(np.int32(v) + q)
            if is_anchor[t]:
                for d in range(dim):
                    anchor[d] = np.float32(np.int32(sym[kv, h, t, d]) - q) * s16


@numba.njit(parallel=True, **_JIT)
def reconstruct_layer_kernel(sym, scales, is_anchor, qmax_a, qmax_k, qmax_v, out):
    """Inverse: sym uint8 [2, H, T, D], scales uint16 [2, H, T] (finite fp16 bits) -> out
    fp32 [2, H, T, D]: anchors code x scale, other tokens anchor + code x scale."""
    _, heads, tokens, dim = sym.shape
    for w in numba.prange(2 * heads):
        kv = w // heads
        h = w % heads
        q_delta = qmax_k if kv == 0 else qmax_v
        tmp = np.empty(1, np.float32)
        tmpu = tmp.view(np.uint32)
        anchor = np.zeros(dim, np.float32)
        for t in range(tokens):
            tmpu[0] = np.uint32(f16_bits_to_f32_bits(np.int64(scales[kv, h, t])))
            s = tmp[0]
            if is_anchor[t]:
                for d in range(dim):
                    v = np.float32(np.int32(sym[kv, h, t, d]) - qmax_a) * s
                    anchor[d] = v
                    out[kv, h, t, d] = v
            else:
                for d in range(dim):
                    out[kv, h, t, d] = anchor[d] + np.float32(
                        np.int32(sym[kv, h, t, d]) - q_delta) * s


@numba.njit(**_JIT)
def scatter_chunk(flat, seg_counts, lo, coded, page_anchor, t0, sym):
    """One chunk's 4 segments (K-anchor, K-delta, V-anchor, V-delta; each [H, tokens of its
    kind in the page, D] in C order) -> sym uint8 [2, H, T, D] at tokens t0 .. t0 + n:
    symbol = decoded + lo[i] for a coded segment (coded[i], its symbols back to back in
    flat, seg_counts[i] of them), lo[i] for every code of an uncoded one. The caller has
    checked the counts against the page (H x rows x D per segment)."""
    _, heads, _, dim = sym.shape
    n = page_anchor.size
    k = 0
    for i in range(4):
        kv = i // 2
        want = i % 2 == 0  # anchor segments first
        add = np.uint8(lo[i])
        live = coded[i] != 0
        if seg_counts[i] == 0:
            continue
        for h in range(heads):
            block = sym[kv, h]  # [T, D]
            for j in range(n):
                if page_anchor[j] != want:
                    continue
                t = t0 + j
                if live:
                    # a view indexed by the loop counter: flat[k + d] would be tested for
                    # wraparound byte by byte (14x slower)
                    src = flat[k : k + dim]
                    for d in range(dim):
                        block[t, d] = src[d] + add
                    k += dim
                else:
                    for d in range(dim):
                        block[t, d] = add


@numba.njit(**_JIT)
def _reconstruct_rows(sym, scales, is_anchor, qmaxes, mode, out_f, out_b, layer, kv, h, t0,
                      t1, tmp, anchor, row, scr):
    """Tokens t0..t1 of row block (layer, kv, h) into the flat output (reconstruct_chunk's
    layout and modes); t0 starts a page (an anchor token: groups never cross pages)."""
    _, _, heads, tokens, dim = sym.shape
    tmpu = tmp.view(np.uint32)
    qa = qmaxes[layer, 0]
    qd = qmaxes[layer, 1 + kv]
    o = ((layer * 2 + kv) * heads + h) * tokens * dim
    block = sym[layer, kv, h]  # [T, D]
    for t in range(t0, t1):
        tmpu[0] = np.uint32(f16_bits_to_f32_bits(np.int64(scales[layer, kv, h, t])))
        s = tmp[0]
        if is_anchor[t]:
            for d in range(dim):
                v = np.float32(np.int32(block[t, d]) - qa) * s
                anchor[d] = v
                row[d] = v
        else:
            for d in range(dim):
                row[d] = anchor[d] + np.float32(np.int32(block[t, d]) - qd) * s
        _store_row(row, dim, mode, out_f, out_b, o + t * dim, scr)


@numba.njit(**_JIT)
def reconstruct_chunk(sym, scales, is_anchor, qmaxes, mode, out_f, out_b, layer, t0, t1):
    """sym uint8 [L, 2, H, T, D], scales uint16 [L, 2, H, T] (finite fp16 bits), qmaxes int64
    [L, 3] (anchor, K delta, V delta) -> tokens t0..t1 (one page) of one layer of the cache
    [L, 2, H, T, D], flat: fp32 in out_f (mode 0), bf16 bits (1) or fp16 bits (2, clamped to
    +-65504) in out_b, as reconstruct_layer_kernel's fp32 values cast by codec.cast_finite.
    Serial: run on a decoder thread right after the page's symbols are in place, while they
    are still in its cache."""
    heads, dim = sym.shape[2], sym.shape[4]
    if t1 > t0 and not is_anchor[t0]:  # each row block's anchor is set by its first token
        raise ValueError("reconstruct_chunk: t0 must start a page (an anchor token)")
    tmp = np.empty(2, np.float32)
    anchor = np.zeros(dim, np.float32)
    row = np.empty(dim, np.float32)
    scr = np.empty((2, dim), np.float32)  # _store_row's fp16 scratch
    for kv in range(2):
        for h in range(heads):
            _reconstruct_rows(sym, scales, is_anchor, qmaxes, mode, out_f, out_b, layer, kv, h,
                              t0, t1, tmp, anchor, row, scr)
