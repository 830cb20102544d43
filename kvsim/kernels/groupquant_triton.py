"""Triton building blocks of the group quantizer (groupquant.quantize_groups) shared by the
uniform and KIVI kernels: quantize / dequantize a 2-D tile whose groups run along one axis,
and fp16 values read / written as the two little-endian bytes the wire holds.

The arithmetic is the reference's exact op sequence: fp32 min/max, IEEE-rounded divisions
(tl.math.div_rn; plain `/` lowers to an approximate division on the GPU), round-to-nearest-
even fp16 casts and floor(v + 0.5), so codes, scales and zero points match it bit for bit.
Dequantization is exact too: code * scale16 needs <= 19 significant bits, so whether or not
the compiler fuses it into an FMA the fp32 result is the same.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize_tile(x, valid, AXIS: tl.constexpr, QMAX: tl.constexpr):
    """x: 2-D fp32 tile, one group per line along AXIS; valid: the elements that belong to
    their group -> (codes int32 like x, scale16 and zero16 fp16 with AXIS reduced)."""
    mn = tl.min(tl.where(valid, x, float("inf")), axis=AXIS) + 0.0  # -0.0 -> +0.0
    mx = tl.max(tl.where(valid, x, float("-inf")), axis=AXIS) + 0.0
    scale16 = tl.math.div_rn(mx - mn, tl.full(mn.shape, QMAX, tl.float32)).to(tl.float16)
    zero16 = mn.to(tl.float16)
    q = quantize_given(x, scale16.to(tl.float32), zero16.to(tl.float32), AXIS, QMAX)
    return q, scale16, zero16


@triton.jit
def quantize_given(x, s, z, AXIS: tl.constexpr, QMAX: tl.constexpr):
    """x: 2-D fp32 tile, one group per line along AXIS, whose groups' scale and zero point
    (the fp16 values, as fp32; AXIS reduced) are given -> codes int32 like x (0 where the
    scale is 0). quantize_tile's second half: a group that spans tiles (kcvt: a key
    channel over every token) is quantized tile by tile with its stats found first."""
    live = s > 0
    safe = tl.where(live, s, 1.0)
    v = tl.math.div_rn(x - tl.expand_dims(z, AXIS),
                       tl.broadcast_to(tl.expand_dims(safe, AXIS), x.shape))
    q = tl.minimum(tl.maximum(tl.floor(v + 0.5), 0.0), QMAX * 1.0)
    return tl.where(tl.expand_dims(live, AXIS), q, 0.0).to(tl.int32)


@triton.jit
def dequantize_tile(q, s, z, AXIS: tl.constexpr):
    """Codes (int32, 2-D) and their groups' fp32 scale / zero point (AXIS reduced) -> fp32."""
    return tl.expand_dims(z, AXIS) + q.to(tl.float32) * tl.expand_dims(s, AXIS)


@triton.jit
def store_codes(out_ptr, row_at, q, rmask, ROWS: tl.constexpr, GROUP: tl.constexpr,
                BLOCK: tl.constexpr, BITS: tl.constexpr):
    """q: [ROWS, BLOCK] int32 codes, the first GROUP of each row valid -> bit-packed along the
    row (bitpack.pack: little end first, byte = c[2i] | c[2i+1] << 4 for 4 bits) at
    out_ptr + row_at[r] (int64 [ROWS], byte offset of the row's first code)."""
    PER: tl.constexpr = 8 // BITS  # codes per byte
    if PER == 1:
        cols = tl.arange(0, BLOCK)
        tl.store(out_ptr + row_at[:, None] + cols[None, :], q.to(tl.uint8),
                 mask=rmask[:, None] & (cols < GROUP)[None, :])
    else:
        # [ROWS, BLOCK] -> [ROWS, BLOCK / PER, PER]; byte = sum_j code_j << (j * BITS)
        q3 = tl.reshape(q, (ROWS, BLOCK // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        byte = tl.sum(q3 << shifts[None, None, :], axis=2)
        bcols = tl.arange(0, BLOCK // PER)
        tl.store(out_ptr + row_at[:, None] + bcols[None, :], byte.to(tl.uint8),
                 mask=rmask[:, None] & (bcols * PER < GROUP)[None, :])


@triton.jit
def load_codes(src_ptr, row_at, rmask, ROWS: tl.constexpr, GROUP: tl.constexpr,
               BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Mirror of store_codes -> int32 codes [ROWS, BLOCK] (0 where masked)."""
    PER: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    if PER == 1:
        cols = tl.arange(0, BLOCK)
        q = tl.load(src_ptr + row_at[:, None] + cols[None, :],
                    mask=rmask[:, None] & (cols < GROUP)[None, :], other=0).to(tl.int32)
    else:
        bcols = tl.arange(0, BLOCK // PER)
        byte = tl.load(src_ptr + row_at[:, None] + bcols[None, :],
                       mask=rmask[:, None] & (bcols * PER < GROUP)[None, :],
                       other=0).to(tl.int32)
        shifts = tl.arange(0, PER) * BITS
        q3 = (byte[:, :, None] >> shifts[None, None, :]) & QMAX  # [ROWS, BLOCK/PER, PER]
        q = tl.reshape(q3, (ROWS, BLOCK))
    return q


@triton.jit
def store_f16(out_ptr, at, v16, mask):
    """fp16 values -> 2 little-endian bytes each at out_ptr + at."""
    bits = v16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(out_ptr + at, (bits & 255).to(tl.uint8), mask=mask)
    tl.store(out_ptr + at + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def load_f16(src_ptr, at, mask):
    """2 little-endian bytes at src_ptr + at -> fp32 (the fp16 value they hold)."""
    lo = tl.load(src_ptr + at, mask=mask, other=0).to(tl.int32)
    hi = tl.load(src_ptr + at + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

