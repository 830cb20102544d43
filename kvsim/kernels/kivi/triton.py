"""Triton kernels of the `kivi` codec's device path: keys quantized per channel in groups of
`group` tokens, values per token in groups of `value_group` channels, each written straight
into its chunk's payload in the wire buffer (chunk (l, p) at l * layer_bytes + geo[p, G_BASE],
fields at the offsets of kivi.geometry, as the fused CPU kernels read them), and the mirror.

- K: one program per (layer x head, key group slot of a page, block of channels); its tile is
  [group tokens, channels], quantized along the tokens; codes k_codes [H, D, qk] are packed
  along the tokens (the field is packed flat, and a group never straddles a byte);
- K of `kcvt` (one group per channel over every quantized token of the layer, across
  pages): the channels' scales and zero points are found first (torch on the device, the
  reference's op sequence) and given to the same kernel (`given`), which quantizes each
  page's tokens slot by slot with them; the codec writes them into page 0's chunk;
- V: one program per (layer x head, block of a page's tokens, value group); tile [tokens,
  value_group channels], quantized along the channels, codes [H, qv, D] packed along them;
- the bf16 window (k_resid / v_resid, or resid [2, H, r, D]) is copied by torch (kivi.codec).
The arithmetic is groupquant_triton's (the reference's op sequence), so the bytes are the
torch reference's. Under TRITON_INTERPRET=1 the input is widened to fp32 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.kernels.groupquant_triton import (
    dequantize_tile,
    load_codes,
    load_f16,
    quantize_given,
    quantize_tile,
    store_codes,
    store_f16,
)
from kvsim.kernels.kivi.geometry import (
    G_BASE,
    G_KC,
    G_KS,
    G_KZ,
    G_QK,
    G_QV,
    G_T0,
    G_VC,
    G_VS,
    G_VZ,
    GEO_COLS,
)
from kvsim.kernels.triton_support import (
    DEFAULT_CUDA_ARCH,
    compile_ptx,
    interpreting,
    require_kernel_device,
)

CHANNELS_PER_K_PROGRAM = 64
TOKENS_PER_V_PROGRAM = 32
# kcvt's keys: tokens per K program (a slot of a page; its stats are given, so the slot
# only bounds the tile: a multiple of every bits' codes per byte)
KCVT_TOKENS_PER_K_PROGRAM = 32

# the geometry's columns, as constants a kernel may read
_NCOL = tl.constexpr(GEO_COLS)
_T0, _QK, _QV, _BASE = (tl.constexpr(c) for c in (G_T0, G_QK, G_QV, G_BASE))
_KC, _KS, _KZ, _VC, _VS, _VZ = (tl.constexpr(c) for c in (G_KC, G_KS, G_KZ, G_VC, G_VS, G_VZ))


@triton.jit
def _page(geo_ptr, p, COL: tl.constexpr):
    """geo[p, COL] (int64) of the page geometry [pages, GEO_COLS]."""
    return tl.load(geo_ptr + p * _NCOL + COL)


@triton.jit
def _k_kernel(x_ptr, buf_ptr, geo_ptr, sz_ptr, T, LAYER_BYTES, LHD, H: tl.constexpr,
              D: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr, BD: tl.constexpr,
              BITS: tl.constexpr, SLOTS: tl.constexpr, DECODE: tl.constexpr,
              GIVEN: tl.constexpr):
    """Encode (DECODE False: x -> buf) or decode (True: buf -> x) the keys of one group;
    GIVEN: the group's scale and zero point are sz[0 / 1, layer, head, channel] (fp32
    [2, LHD]; kcvt), neither computed nor stored here."""
    PER: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    lh = tl.program_id(0)
    p = tl.program_id(1) // SLOTS
    j = tl.program_id(1) % SLOTS
    l = lh // H
    h = lh % H
    t0 = _page(geo_ptr, p, _T0)
    qk = _page(geo_ptr, p, _QK)
    chunk = l.to(tl.int64) * LAYER_BYTES + _page(geo_ptr, p, _BASE)
    ti = tl.arange(0, BLOCK_T)
    tt = j * G + ti  # token in the page
    tvalid = (ti < G) & (tt < qk)
    dd = tl.program_id(2) * BD + tl.arange(0, BD)
    dvalid = dd < D
    mask = tvalid[:, None] & dvalid[None, :]
    at = (((l * 2) * H + h).to(tl.int64) * T + t0 + tt)[:, None] * D + dd[None, :]  # K plane
    gvalid = dvalid & (j * G + 0 * dd < qk)  # [BD] (a scalar term would not broadcast)
    sidx = (h * D + dd).to(tl.int64) * (qk // G) + j  # k_scale / k_zero [H, D, qk / G]
    row = (h * D + dd).to(tl.int64) * qk + j * G  # flat index of the group's first code
    kc = chunk + _page(geo_ptr, p, _KC)
    if GIVEN:
        at_sz = lh.to(tl.int64) * D + dd
        s = tl.load(sz_ptr + at_sz, mask=gvalid, other=0.0)
        z = tl.load(sz_ptr + LHD + at_sz, mask=gvalid, other=0.0)
    if DECODE:
        if not GIVEN:
            s = load_f16(buf_ptr, chunk + _page(geo_ptr, p, _KS) + sidx * 2, gvalid)
            z = load_f16(buf_ptr, chunk + _page(geo_ptr, p, _KZ) + sidx * 2, gvalid)
        if PER == 1:
            q = tl.load(buf_ptr + kc + row[None, :] + ti[:, None], mask=mask, other=0)
            q = q.to(tl.int32)
        else:
            tb = tl.arange(0, BLOCK_T // PER)
            bmask = ((tb * PER < G) & (j * G + tb * PER < qk))[:, None] & dvalid[None, :]
            byte = tl.load(buf_ptr + kc + row[None, :] // PER + tb[:, None], mask=bmask,
                           other=0).to(tl.int32)
            shifts = tl.arange(0, PER) * BITS
            q3 = (byte[:, None, :] >> shifts[None, :, None]) & QMAX  # [BT/PER, PER, BD]
            q = tl.reshape(q3, (BLOCK_T, BD))
        v = dequantize_tile(q, s, z, 0)
        tl.store(x_ptr + at, v.to(x_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if GIVEN:
            q = quantize_given(x, s, z, 0, QMAX)
        else:
            q, s16, z16 = quantize_tile(x, tl.broadcast_to(tvalid[:, None], (BLOCK_T, BD)), 0,
                                        QMAX)
            store_f16(buf_ptr, chunk + _page(geo_ptr, p, _KS) + sidx * 2, s16, gvalid)
            store_f16(buf_ptr, chunk + _page(geo_ptr, p, _KZ) + sidx * 2, z16, gvalid)
        if PER == 1:
            tl.store(buf_ptr + kc + row[None, :] + ti[:, None], q.to(tl.uint8), mask=mask)
        else:
            # [BLOCK_T, BD] -> [BLOCK_T / PER, PER, BD]: PER consecutive tokens per byte
            q3 = tl.reshape(q, (BLOCK_T // PER, PER, BD))
            shifts = tl.arange(0, PER) * BITS
            byte = tl.sum(q3 << shifts[None, :, None], axis=1)
            tb = tl.arange(0, BLOCK_T // PER)
            bmask = ((tb * PER < G) & (j * G + tb * PER < qk))[:, None] & dvalid[None, :]
            tl.store(buf_ptr + kc + row[None, :] // PER + tb[:, None], byte.to(tl.uint8),
                     mask=bmask)


@triton.jit
def _v_kernel(x_ptr, buf_ptr, geo_ptr, T, LAYER_BYTES, H: tl.constexpr, D: tl.constexpr,
              VG: tl.constexpr, BLOCK_VG: tl.constexpr, RT: tl.constexpr, BITS: tl.constexpr,
              SLOTS: tl.constexpr, DECODE: tl.constexpr):
    """Encode / decode the values of RT tokens x one value group."""
    PER: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    NGV: tl.constexpr = D // VG
    lh = tl.program_id(0)
    p = tl.program_id(1) // SLOTS
    blk = tl.program_id(1) % SLOTS
    g = tl.program_id(2)
    l = lh // H
    h = lh % H
    t0 = _page(geo_ptr, p, _T0)
    qv = _page(geo_ptr, p, _QV)
    chunk = l.to(tl.int64) * LAYER_BYTES + _page(geo_ptr, p, _BASE)
    tt = blk * RT + tl.arange(0, RT)
    tvalid = tt < qv
    cols = tl.arange(0, BLOCK_VG)
    cvalid = cols < VG
    mask = tvalid[:, None] & cvalid[None, :]
    at = (((l * 2 + 1) * H + h).to(tl.int64) * T + t0 + tt)[:, None] * D + g * VG + cols[None, :]
    trow = (h * qv + tt).to(tl.int64)  # row of v_codes [H, qv, D] / v_scale [H, qv, D / VG]
    sat = (trow * NGV + g) * 2
    # byte offset of each row's first code of this group (v_codes [H, qv, D], packed flat)
    row_at = chunk + _page(geo_ptr, p, _VC) + (trow * D + g * VG) // PER
    if DECODE:
        s = load_f16(buf_ptr, chunk + _page(geo_ptr, p, _VS) + sat, tvalid)
        z = load_f16(buf_ptr, chunk + _page(geo_ptr, p, _VZ) + sat, tvalid)
        q = load_codes(buf_ptr, row_at, tvalid, RT, VG, BLOCK_VG, BITS)
        v = dequantize_tile(q, s, z, 1)
        tl.store(x_ptr + at, v.to(x_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        q, s16, z16 = quantize_tile(x, tl.broadcast_to(cvalid[None, :], (RT, BLOCK_VG)), 1,
                                    QMAX)
        store_f16(buf_ptr, chunk + _page(geo_ptr, p, _VS) + sat, s16, tvalid)
        store_f16(buf_ptr, chunk + _page(geo_ptr, p, _VZ) + sat, z16, tvalid)
        store_codes(buf_ptr, row_at, q, tvalid, RT, VG, BLOCK_VG, BITS)


def _launch(x: torch.Tensor, buf: torch.Tensor, geo: torch.Tensor, layer_bytes: int,
            page_tokens: int, group: int, value_group: int, bits: int, decode: bool,
            given: torch.Tensor | None = None) -> None:
    layers, _, heads, tokens, dim = (int(s) for s in x.shape)
    if geo.shape[1] != GEO_COLS or geo.dtype != torch.int64:
        raise ValueError(f"geometry must be int64 [pages, {GEO_COLS}], got {tuple(geo.shape)}")
    pages = int(geo.shape[0])
    if not (layers and tokens):
        return
    lhd = layers * heads * dim
    if given is not None and (given.dtype != torch.float32 or given.numel() != 2 * lhd
                              or not given.is_contiguous()):
        raise ValueError(f"given scales / zero points must be contiguous fp32 [2, {layers}, "
                         f"{heads}, {dim}], got {given.dtype} {tuple(given.shape)}")
    k_slots = triton.cdiv(page_tokens, group)
    bd = min(CHANNELS_PER_K_PROGRAM, triton.next_power_of_2(dim))
    _k_kernel[(layers * heads, pages * k_slots, triton.cdiv(dim, bd))](
        x, buf, geo, given if given is not None else x, tokens, layer_bytes, lhd, H=heads,
        D=dim, G=group, BLOCK_T=triton.next_power_of_2(group), BD=bd, BITS=bits,
        SLOTS=k_slots, DECODE=decode, GIVEN=given is not None)
    v_slots = triton.cdiv(page_tokens, TOKENS_PER_V_PROGRAM)
    _v_kernel[(layers * heads, pages * v_slots, dim // value_group)](
        x, buf, geo, tokens, layer_bytes, H=heads, D=dim, VG=value_group,
        BLOCK_VG=triton.next_power_of_2(value_group), RT=TOKENS_PER_V_PROGRAM, BITS=bits,
        SLOTS=v_slots, DECODE=decode)


_INSTEAD = "use backend 'cpu', 'torch' or 'auto'"


def encode_quantized(kv: torch.Tensor, buf: torch.Tensor, geo: torch.Tensor, layer_bytes: int,
                     page_tokens: int, group: int, value_group: int, bits: int,
                     given: torch.Tensor | None = None) -> None:
    """Write the quantized fields (K and V codes, scales, zero points) of every chunk of
    kv [layers, 2, kv_heads, tokens, head_dim] into the wire buffer `buf` (uint8
    [layers * layer_bytes], same device); geo: kivi's page geometry on that device. Two
    launches; the bf16 window is the caller's. given (kcvt): the keys' scales and zero
    points, fp32 [2, layers, kv_heads, head_dim] (their fp16 values), used and not stored;
    `group` is then the tokens per K program (KCVT_TOKENS_PER_K_PROGRAM)."""
    require_kernel_device(kv.device, "kivi triton backend", _INSTEAD)
    x = kv.contiguous()
    if interpreting() or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.to(torch.float32)
    _launch(x, buf, geo, layer_bytes, page_tokens, group, value_group, bits, decode=False,
            given=given)


def decode_quantized(buf: torch.Tensor, out: torch.Tensor, geo: torch.Tensor, layer_bytes: int,
                     page_tokens: int, group: int, value_group: int, bits: int,
                     given: torch.Tensor | None = None) -> None:
    """Mirror of encode_quantized: dequantize every chunk's quantized tokens into `out`
    [layers, 2, kv_heads, tokens, head_dim] (contiguous; fp32 under the interpreter)."""
    require_kernel_device(buf.device, "kivi triton backend", _INSTEAD)
    _launch(out, buf, geo, layer_bytes, page_tokens, group, value_group, bits, decode=True,
            given=given)


def compile_for_cuda(arch: int = DEFAULT_CUDA_ARCH) -> dict[str, str]:
    """Build the K and V kernels (2- and 4-bit, encode and decode, bf16) for CUDA sm_<arch>
    without a GPU; returns their PTX by name (triton_support.compile_ptx)."""
    ptx = {}
    ptrs = {"x_ptr": "*bf16", "buf_ptr": "*u8", "geo_ptr": "*i64", "LAYER_BYTES": "i64"}
    k_ptrs = {**ptrs, "sz_ptr": "*fp32", "LHD": "i64"}
    for bits in (2, 4):
        for decode in (False, True):
            name = f"{'decode' if decode else 'encode'}_{bits}bit"
            for given in (False, True):  # kivi's keys; kcvt's (scales given)
                ptx[f"k_{'kcvt_' if given else ''}{name}"] = compile_ptx(_k_kernel, k_ptrs, dict(
                    H=8, D=128, G=32, BLOCK_T=32, BD=CHANNELS_PER_K_PROGRAM, BITS=bits,
                    SLOTS=8, DECODE=decode, GIVEN=given), arch)
            ptx[f"v_{name}"] = compile_ptx(_v_kernel, ptrs, dict(
                H=8, D=128, VG=32, BLOCK_VG=32, RT=TOKENS_PER_V_PROGRAM, BITS=bits, SLOTS=8,
                DECODE=decode), arch)
    return ptx
