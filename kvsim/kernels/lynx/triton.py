"""Triton kernels of the `lynx` codec: fused encode (page statistics, chunk statistics,
companding, split, bit packing) and decode, with wrappers (check shapes, allocate, launch).

The pure-torch reference is lynx.encode_torch / lynx.decode_torch; the kernels follow it
operation by operation so the codes and metadata are bit-identical:
- every float op is a single IEEE fp32 op (x*0.5 is exact, scales are powers of two built
  from exponent bits, 1/sigma uses div_rn, FMA contraction is disabled at launch on GPU);
- the mean is an integer sum of 14-bit fixed point values (order-independent);
- companding is a lookup over the fp32 bits of u (lynx.LynxTables), no transcendental.
One program = one (layer, K|V, head) x one page x one block of head_dim; it loops over the
page's chunks twice (min/max, then quantize). Tiles are [tokens, head_dim/8, 8] so that 8
consecutive codes of a row pack into `b` bytes with a reduction over the last axis.
Requires head_dim % 8 == 0 (every real model); other shapes use the cpu/torch backends.
Under TRITON_INTERPRET=1 (CPU tests) the input is widened to fp32 first, since the
interpreter has no bf16 arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.kernels.codec import CodecError
from kvsim.kernels.lynx.format import (
    MU_FRAC_BITS,
    LynxArrays,
    LynxLayout,
    LynxTables,
    alloc_buffers,
    signed_values,
    write_metadata,
)
from kvsim.kernels.triton_support import (
    DEFAULT_CUDA_ARCH,
    compile_ptx,
    interpreting,
    require_kernel_device,
)

_MU_SCALE: tl.constexpr = tl.constexpr(float(1 << MU_FRAC_BITS))  # fixed point of the mean
MAX_STREAMS = 3  # kernels are specialized for up to 3 streams (split widths are constexpr)


@triton.jit
def _pack_store(field, out_ptr, row_off, t_loc, g_glob, m2, D: tl.constexpr,
                B: tl.constexpr):
    """field: [BT, BG, 8] int32 codes of B bits -> B bytes per group of 8, stored at
    out_ptr + row_off + (t_loc * D + 8 * g) * B / 8 + i."""
    j = tl.arange(0, 8)
    word = tl.sum(field.to(tl.int64) << (j * B).to(tl.int64)[None, None, :], axis=2)
    base = row_off + (t_loc[:, None] * (D * B // 8) + g_glob[None, :] * B)
    for i in tl.static_range(B):
        tl.store(out_ptr + base + i, ((word >> (8 * i)) & 255).to(tl.uint8), mask=m2)


@triton.jit
def _lynx_encode_kernel(
    x_ptr, lo_ptr, k_ptr, mu_ptr, sig_ptr, thr_ptr, base_ptr,
    out0_ptr, out1_ptr, out2_ptr,
    T, PAGES, NCHUNKS,
    LB0, LB1, LB2, FB0, FB1, FB2,
    CO0_F, CO0_L, RB0_F, RB0_L, RB1_F, RB1_L, RB2_F, RB2_L,
    H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, C: tl.constexpr,
    BT: tl.constexpr, BG: tl.constexpr,
    NS: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
    SH0: tl.constexpr, SH1: tl.constexpr, SH2: tl.constexpr,
    LUT_LO: tl.constexpr, LUT_SHIFT: tl.constexpr, CELLS: tl.constexpr,
):
    row = tl.program_id(0)  # l * 2H + (kv * H + h)
    p = tl.program_id(1)
    db = tl.program_id(2)
    l = row // (2 * H)
    r2 = row % (2 * H)
    t0 = p * P
    n = tl.minimum(P, T - t0)
    is_last = p == PAGES - 1
    g_glob = db * BG + tl.arange(0, BG)  # [BG] group of 8 channels
    d = g_glob[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BG, 8]
    dmask = d < D
    gmask = g_glob * 8 < D
    offs_t = tl.arange(0, BT)
    xrow = x_ptr + row.to(tl.int64) * T * D
    # ---- stage 1: page min / max -> lo, power-of-two scale 2^-k ----
    lo = tl.full((BG, 8), float("inf"), tl.float32)
    hi = tl.full((BG, 8), float("-inf"), tl.float32)
    for c0 in range(0, n, C):
        tmask = (offs_t < C) & (c0 + offs_t < n)
        m3 = tmask[:, None, None] & dmask[None, :, :]
        ptrs = xrow + (t0 + c0 + offs_t).to(tl.int64)[:, None, None] * D + d[None, :, :]
        x = tl.load(ptrs, mask=m3, other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.min(tl.where(m3, x, float("inf")), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(m3, x, float("-inf")), axis=0))
    lo = tl.where(dmask, lo, 0.0) + 0.0  # -0.0 -> +0.0, as the reference
    hi = tl.where(dmask, hi, 0.0)
    r = hi * 0.5 - lo * 0.5
    k = ((r.to(tl.int32, bitcast=True) >> 23) & 255) - 126
    k = tl.minimum(tl.maximum(k, -126), 126)
    fenc = ((127 - k) << 23).to(tl.float32, bitcast=True)
    lh = lo * 0.5
    moff = ((l * PAGES + p) * (2 * H) + r2).to(tl.int64) * D + d
    tl.store(lo_ptr + moff, lo, mask=dmask)
    tl.store(k_ptr + moff, k.to(tl.int8), mask=dmask)
    # ---- per chunk: mean (integer), centre, sigma (fp16), codes, split, pack ----
    co0 = tl.where(is_last, CO0_L, CO0_F)
    rb0 = tl.where(is_last, RB0_L, RB0_F)
    rb1 = tl.where(is_last, RB1_L, RB1_F)
    rb2 = tl.where(is_last, RB2_L, RB2_F)
    off0 = l.to(tl.int64) * LB0 + p * FB0 + co0 + r2 * rb0
    off1 = l.to(tl.int64) * LB1 + p * FB1 + r2 * rb1
    off2 = l.to(tl.int64) * LB2 + p * FB2 + r2 * rb2
    for c0 in range(0, n, C):
        tmask = (offs_t < C) & (c0 + offs_t < n)
        m3 = tmask[:, None, None] & dmask[None, :, :]
        ptrs = xrow + (t0 + c0 + offs_t).to(tl.int64)[:, None, None] * D + d[None, :, :]
        x = tl.load(ptrs, mask=m3, other=0.0).to(tl.float32)
        xn = tl.where(m3, (x * 0.5 - lh[None, :, :]) * fenc[None, :, :], 0.0)  # pad lanes: 0
        q = tl.where(m3, (xn * _MU_SCALE).to(tl.int32), 0)
        nc = tl.minimum(C, n - c0)
        mq = tl.sum(q, axis=0) // nc  # [BG, 8] in [0, 2^16)
        mu = mq.to(tl.float32) * (1.0 / _MU_SCALE)
        cen = xn - mu[None, :, :]
        sig = tl.max(tl.where(m3, tl.abs(cen), 0.0), axis=0)
        s16 = sig.to(tl.float16)
        s = s16.to(tl.float32)
        inv = tl.where(s > 0, tl.div_rn(tl.full((BG, 8), 1.0, tl.float32),
                                        tl.where(s > 0, s, 1.0)), 0.0)
        ci = (t0 + c0) // C
        coff = (row.to(tl.int64) * NCHUNKS + ci) * D + d
        tl.store(mu_ptr + coff, mq.to(tl.int16), mask=dmask)
        tl.store(sig_ptr + coff, s16, mask=dmask)
        u = cen * inv[None, :, :]  # signed: keeps the sign of the centred value
        ub = u.to(tl.int32, bitcast=True)
        cell = tl.minimum(tl.maximum((ub & 0x7FFFFFFF) - LUT_LO, 0) >> LUT_SHIFT, CELLS - 1)
        cell = tl.where(m3, cell, 0)
        thr = tl.load(thr_ptr + cell)
        code = tl.load(base_ptr + cell) + (tl.abs(u) > thr).to(tl.int32)
        neg = (u < 0).to(tl.int32)  # float compare: -0.0 is not negative
        code = tl.where(m3, code, 0)
        neg = tl.where(m3, neg, 0)
        t_loc = c0 + offs_t
        m2 = tmask[:, None] & gmask[None, :]
        f0 = (code >> SH0) | (neg << (B0 - 1))
        _pack_store(f0, out0_ptr, off0, t_loc, g_glob, m2, D, B0)
        if NS > 1:
            f1 = ((code >> SH1) & ((1 << B1) - 1)) ^ (1 << (B1 - 1))
            _pack_store(f1, out1_ptr, off1, t_loc, g_glob, m2, D, B1)
        if NS > 2:
            f2 = ((code >> SH2) & ((1 << B2) - 1)) ^ (1 << (B2 - 1))
            _pack_store(f2, out2_ptr, off2, t_loc, g_glob, m2, D, B2)


@triton.jit
def _unpack_load(src_ptr, row_off, t_loc, g_glob, m2, D: tl.constexpr, B: tl.constexpr):
    """Inverse of _pack_store: [BT, BG, 8] int32 B-bit fields."""
    base = row_off + (t_loc[:, None] * (D * B // 8) + g_glob[None, :] * B)
    word = tl.zeros(m2.shape, tl.int64)
    for i in tl.static_range(B):
        byte = tl.load(src_ptr + base + i, mask=m2, other=0).to(tl.int64)
        word = word | (byte << (8 * i))
    j = tl.arange(0, 8)
    return ((word[:, :, None] >> (j * B).to(tl.int64)[None, None, :]) & ((1 << B) - 1)
            ).to(tl.int32)


@triton.jit
def _lynx_decode_kernel(
    out_ptr, lo_ptr, k_ptr, mu_ptr, sig_ptr, val_ptr,
    in0_ptr, in1_ptr, in2_ptr,
    T, PAGES, NCHUNKS,
    LB0, LB1, LB2, FB0, FB1, FB2,
    CO0_F, CO0_L, RB0_F, RB0_L, RB1_F, RB1_L, RB2_F, RB2_L,
    H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, C: tl.constexpr,
    BT: tl.constexpr, BG: tl.constexpr,
    NS: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
):
    row = tl.program_id(0)
    p = tl.program_id(1)
    db = tl.program_id(2)
    l = row // (2 * H)
    r2 = row % (2 * H)
    t0 = p * P
    n = tl.minimum(P, T - t0)
    is_last = p == PAGES - 1
    g_glob = db * BG + tl.arange(0, BG)
    d = g_glob[:, None] * 8 + tl.arange(0, 8)[None, :]
    dmask = d < D
    gmask = g_glob * 8 < D
    offs_t = tl.arange(0, BT)
    moff = ((l * PAGES + p) * (2 * H) + r2).to(tl.int64) * D + d
    lo = tl.load(lo_ptr + moff, mask=dmask, other=0.0)
    k = tl.load(k_ptr + moff, mask=dmask, other=0).to(tl.int32)
    fdec = ((k + 128) << 23).to(tl.float32, bitcast=True)
    co0 = tl.where(is_last, CO0_L, CO0_F)
    rb0 = tl.where(is_last, RB0_L, RB0_F)
    rb1 = tl.where(is_last, RB1_L, RB1_F)
    rb2 = tl.where(is_last, RB2_L, RB2_F)
    off0 = l.to(tl.int64) * LB0 + p * FB0 + co0 + r2 * rb0
    off1 = l.to(tl.int64) * LB1 + p * FB1 + r2 * rb1
    off2 = l.to(tl.int64) * LB2 + p * FB2 + r2 * rb2
    orow = out_ptr + row.to(tl.int64) * T * D
    for c0 in range(0, n, C):
        tmask = (offs_t < C) & (c0 + offs_t < n)
        m3 = tmask[:, None, None] & dmask[None, :, :]
        m2 = tmask[:, None] & gmask[None, :]
        ci = (t0 + c0) // C
        coff = (row.to(tl.int64) * NCHUNKS + ci) * D + d
        mu = (tl.load(mu_ptr + coff, mask=dmask, other=0).to(tl.int32) & 0xFFFF).to(tl.float32)
        mu = mu * (1.0 / _MU_SCALE)
        s = tl.load(sig_ptr + coff, mask=dmask, other=0.0).to(tl.float32)
        t_loc = c0 + offs_t
        key = _unpack_load(in0_ptr, off0, t_loc, g_glob, m2, D, B0)
        if NS > 1:
            key = (key << B1) | _unpack_load(in1_ptr, off1, t_loc, g_glob, m2, D, B1)
        if NS > 2:
            key = (key << B2) | _unpack_load(in2_ptr, off2, t_loc, g_glob, m2, D, B2)
        key = tl.where(m3, key, 0)
        v = tl.load(val_ptr + key)
        xn = mu[None, :, :] + s[None, :, :] * v
        y = lo[None, :, :] + xn * fdec[None, :, :]
        ptrs = orow + (t0 + t_loc).to(tl.int64)[:, None, None] * D + d[None, :, :]
        tl.store(ptrs, y, mask=m3)


# ---- wrappers ------------------------------------------------------------------------------
def _check(lay: LynxLayout, tab: LynxTables, device: torch.device) -> None:
    require_kernel_device(device, "lynx triton backend", "use backend 'cpu' or 'auto'")
    if lay.shape.head_dim % 8:
        raise CodecError(f"lynx triton backend needs head_dim % 8 == 0, got "
                         f"{lay.shape.head_dim}; use backend 'cpu' or 'torch'")
    if len(tab.split) > MAX_STREAMS:
        raise CodecError(f"lynx triton backend supports up to {MAX_STREAMS} streams, "
                         f"got split {list(tab.split)}")


def _geometry(lay: LynxLayout, ns: int) -> tuple[list[int], dict]:
    """Runtime layout integers (padded to 3 streams) and tile constexprs."""
    full = lay.full or lay.last

    def per(s: int, f) -> int:
        return f(s) if s < ns else 0

    lb = [per(s, lay.layer_bytes) for s in range(MAX_STREAMS)]
    fb = [per(s, lambda s: full.chunk_bytes[s] if lay.full else 0) for s in range(MAX_STREAMS)]
    rows = []
    for s in range(MAX_STREAMS):
        rows += [per(s, lambda s: full.row_bytes[s]), per(s, lambda s: lay.last.row_bytes[s])]
    ints = [*lb, *fb, full.code_off[0], lay.last.code_off[0], *rows]
    d = lay.shape.head_dim
    bd = min(triton.next_power_of_2(d), 128)
    consts = dict(H=lay.shape.kv_heads, D=d, P=lay.page_tokens, C=lay.chunk_tokens,
                  BT=triton.next_power_of_2(lay.chunk_tokens), BG=bd // 8)
    return ints, consts


def _launch_opts(x: torch.Tensor) -> dict:
    # No FMA contraction on GPU: x*0.5 - lo*0.5 and mu + s*v must round like the reference.
    return {} if interpreting() or x.device.type != "cuda" else {"enable_fp_fusion": False}


def encode_triton(x: torch.Tensor, lay: LynxLayout, tab: LynxTables,
                  scales: torch.Tensor | None) -> LynxArrays:
    """x: [L, 2, H, T, D] bf16/fp16/fp32 (preconditioned) on CUDA, or on CPU under
    TRITON_INTERPRET=1 -> LynxArrays (bytes identical to lynx.encode_torch)."""
    _check(lay, tab, x.device)
    L, H, T, D = lay.shape.layers, lay.shape.kv_heads, lay.shape.tokens, lay.shape.head_dim
    if tuple(x.shape) != lay.shape.dims:
        raise CodecError(f"lynx triton: tensor shape {tuple(x.shape)} != layout {lay.shape.dims}")
    dev = x.device
    x = x.contiguous()
    if interpreting() or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.to(torch.float32)
    ns = len(tab.split)
    tt = tab.torch_tables(dev)
    lo = torch.empty(L, lay.pages, 2, H, D, dtype=torch.float32, device=dev)
    k = torch.empty(L, lay.pages, 2, H, D, dtype=torch.int8, device=dev)
    mu = torch.empty(L, 2, H, lay.total_chunks, D, dtype=torch.int16, device=dev)
    sigma = torch.empty(L, 2, H, lay.total_chunks, D, dtype=torch.float16, device=dev)
    buffers = alloc_buffers(lay, dev)
    outs = buffers + [buffers[0]] * (MAX_STREAMS - ns)  # unused pointers never written
    ints, consts = _geometry(lay, ns)
    b = list(tab.split) + [1] * (MAX_STREAMS - ns)
    sh = [tab.field_shift(s) for s in range(ns)] + [0] * (MAX_STREAMS - ns)
    grid = (L * 2 * H, lay.pages, triton.cdiv(D, consts["BG"] * 8))
    _lynx_encode_kernel[grid](
        x, lo, k, mu, sigma, tt["lut_thr"], tt["lut_base"], *outs,
        T, lay.pages, lay.total_chunks, *ints,
        NS=ns, B0=b[0], B1=b[1], B2=b[2], SH0=sh[0], SH1=sh[1], SH2=sh[2],
        LUT_LO=tab.lut_lo, LUT_SHIFT=tab.lut_shift, CELLS=tab.lut_cells, **consts,
        **_launch_opts(x))
    arr = LynxArrays(lo, k, mu, sigma, scales, buffers)
    write_metadata(arr, lay)
    return arr


def decode_triton(arr: LynxArrays, lay: LynxLayout, tab: LynxTables, streams: int
                  ) -> torch.Tensor:
    """LynxArrays (metadata + first `streams` buffers, same device) -> [L, 2, H, T, D] fp32
    (still preconditioned), equal to lynx.decode_torch up to FMA rounding on GPU."""
    _check(lay, tab, arr.lo.device)
    L, H, T, D = lay.shape.layers, lay.shape.kv_heads, lay.shape.tokens, lay.shape.head_dim
    dev = arr.lo.device
    out = torch.empty(L, 2, H, T, D, dtype=torch.float32, device=dev)
    values = torch.from_numpy(signed_values(tab, streams)).to(dev)
    ins = list(arr.buffers[:streams]) + [arr.buffers[0]] * (MAX_STREAMS - streams)
    ints, consts = _geometry(lay, streams)
    b = list(tab.split[:streams]) + [1] * (MAX_STREAMS - streams)
    grid = (L * 2 * H, lay.pages, triton.cdiv(D, consts["BG"] * 8))
    _lynx_decode_kernel[grid](
        out, arr.lo, arr.k, arr.mu, arr.sigma, values, *ins,
        T, lay.pages, lay.total_chunks, *ints,
        NS=streams, B0=b[0], B1=b[1], B2=b[2], **consts, **_launch_opts(out))
    return out


def compile_for_cuda(arch: int = DEFAULT_CUDA_ARCH, split: tuple[int, ...] = (4, 4),
                     head_dim: int = 128, kv_heads: int = 8) -> dict[str, str]:
    """Compile both kernels for a CUDA target without a GPU (Triton's bundled toolchain) and
    return their PTX: a check that the GPU path builds, and that FMA contraction is off and
    1/sigma uses IEEE division. Needs TRITON_INTERPRET unset (interpreted kernels do not
    compile): run it in a fresh process."""
    from kvsim.kernels.lynx.format import lynx_tables

    tab = lynx_tables(4.0, tuple(split))
    ns = len(split)
    b = list(split) + [1] * (MAX_STREAMS - ns)
    sh = [tab.field_shift(s) for s in range(ns)] + [0] * (MAX_STREAMS - ns)
    tiles = dict(H=kv_heads, D=head_dim, P=256, C=32, BT=32,
                 BG=min(triton.next_power_of_2(head_dim), 128) // 8,
                 NS=ns, B0=b[0], B1=b[1], B2=b[2])
    kernels = {
        "encode": (_lynx_encode_kernel,
                   {"x_ptr": "*bf16", "lo_ptr": "*fp32", "k_ptr": "*i8", "mu_ptr": "*i16",
                    "sig_ptr": "*fp16", "thr_ptr": "*fp32", "base_ptr": "*i32",
                    "out0_ptr": "*u8", "out1_ptr": "*u8", "out2_ptr": "*u8"},
                   {**tiles, "SH0": sh[0], "SH1": sh[1], "SH2": sh[2], "LUT_LO": tab.lut_lo,
                    "LUT_SHIFT": tab.lut_shift, "CELLS": tab.lut_cells}),
        "decode": (_lynx_decode_kernel,
                   {"out_ptr": "*fp32", "lo_ptr": "*fp32", "k_ptr": "*i8", "mu_ptr": "*i16",
                    "sig_ptr": "*fp16", "val_ptr": "*fp32", "in0_ptr": "*u8", "in1_ptr": "*u8",
                    "in2_ptr": "*u8"}, tiles),
    }
    return {name: compile_ptx(fn, ptrs, consts, arch, fp_fusion=False)
            for name, (fn, ptrs, consts) in kernels.items()}
