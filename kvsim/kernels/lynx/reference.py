"""Torch reference of the `lynx` codec (kvsim.kernels.lynx.format describes the format):
bit packing of code rows, the three quantization stages and their inverse, and the OScaR
preconditioning. The numba (cpu.py) and Triton (triton.py) backends match it byte for byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.codec import (
    CodecError,
)
from kvsim.kernels.hadamard import hadamard
from kvsim.kernels.lynx.format import (
    K_MAX,
    K_MIN,
    MU_FRAC_BITS,
    OSCAR_MAX_ABS,
    LynxArrays,
    LynxLayout,
    LynxTables,
    alloc_buffers,
    code_regions,
    join_fields,
    split_fields,
    write_metadata,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

# ---- generic b-bit packing (rows, any b in 1..8) ------------------------------------------
def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., n] ints in [0, 2^bits) -> [..., ceil(n*bits/8)] uint8, little-end first."""
    n = codes.shape[-1]
    if bits == 8:
        return codes.to(torch.uint8)
    nbytes = -(-n * bits // 8)
    pad = (-n) % 8
    c = codes.to(torch.int64)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.unflatten(-1, (-1, 8))  # groups of 8 codes = `bits` bytes
    word = (c << (torch.arange(8, device=c.device) * bits)).sum(-1)
    out = (word.unsqueeze(-1) >> (torch.arange(bits, device=c.device) * 8)) & 0xFF
    return out.flatten(-2)[..., :nbytes].to(torch.uint8)


def unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """packed: [..., m] uint8 -> [..., n] uint8 codes (inverse of pack_rows)."""
    if bits == 8:
        return packed[..., :n]
    m = packed.shape[-1]
    groups = -(-n // 8)
    pad = groups * bits - m
    b = packed.to(torch.int64)
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    b = b.unflatten(-1, (groups, bits))
    word = (b << (torch.arange(bits, device=b.device) * 8)).sum(-1)
    codes = (word.unsqueeze(-1) >> (torch.arange(8, device=b.device) * bits)) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :n].to(torch.uint8)


# ---- bit-level helpers shared by the torch reference -------------------------------------
def page_scale(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Exponent k (int32) of the page scale: smallest k with hi/2 - lo/2 < 2^k, in [-126, 126]."""
    r = hi * 0.5 - lo * 0.5
    e = (r.view(torch.int32) >> 23) & 0xFF
    return (e - 126).clamp(K_MIN, K_MAX)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for int32 e in [-126, 127] (exact, built from the exponent bits)."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


# ---- torch reference: quantize / dequantize -----------------------------------------------
@dataclass
class ReferenceCodes:
    """Output of the reference quantizer before splitting: metadata + sign and magnitude."""

    lo: torch.Tensor  # [L, pages, 2, H, D] fp32
    k: torch.Tensor  # [L, pages, 2, H, D] int8
    mu: torch.Tensor  # [L, 2, H, chunks, D] int16 (uint16 bits)
    sigma: torch.Tensor  # [L, 2, H, chunks, D] fp16
    neg: torch.Tensor  # [L, 2, H, T, D] bool
    code: torch.Tensor  # [L, 2, H, T, D] int32 in [0, 2^M)


def reference_codes(x: torch.Tensor, lay: LynxLayout, tab: LynxTables) -> ReferenceCodes:
    """Stages 1-3 (Algorithm 1 lines 1-12, as specified in the module doc), pure torch.
    x: [L, 2, H, T, D] fp32, already preconditioned."""
    L, _, H, T, D = x.shape
    dev = x.device
    tt = tab.torch_tables(dev)
    P, C = lay.page_tokens, lay.chunk_tokens
    lo = torch.empty(L, lay.pages, 2, H, D, dtype=torch.float32, device=dev)
    kexp = torch.empty(L, lay.pages, 2, H, D, dtype=torch.int8, device=dev)
    mu = torch.empty(L, 2, H, lay.total_chunks, D, dtype=torch.int16, device=dev)
    sigma = torch.empty(L, 2, H, lay.total_chunks, D, dtype=torch.float16, device=dev)
    neg = torch.empty(L, 2, H, T, D, dtype=torch.bool, device=dev)
    codes = torch.empty(L, 2, H, T, D, dtype=torch.int32, device=dev)
    for p in range(lay.pages):
        t0, t1 = p * P, min((p + 1) * P, T)
        xp = x[:, :, :, t0:t1]  # [L, 2, H, n, D]
        plo, phi = xp.amin(3) + 0.0, xp.amax(3)  # + 0.0: -0.0 -> +0.0, canonical bytes
        k = page_scale(plo, phi)
        lo[:, p], kexp[:, p] = plo, k.to(torch.int8)
        xn = (xp * 0.5 - (plo * 0.5).unsqueeze(3)) * pow2(-k).unsqueeze(3)  # x' in [0, 4)
        for c0 in range(t0, t1, C):
            c1 = min(c0 + C, t1)
            ci = c0 // C
            xc = xn[:, :, :, c0 - t0: c1 - t0]
            q = (xc * float(1 << MU_FRAC_BITS)).to(torch.int32).sum(3, dtype=torch.int64)
            mq = torch.div(q, c1 - c0, rounding_mode="floor")  # [L, 2, H, D] in [0, 2^16)
            mu[:, :, :, ci] = mq.to(torch.int32).to(torch.int16)  # bits of the uint16
            cen = xc - (mq.to(torch.float32) * 2.0 ** -MU_FRAC_BITS).unsqueeze(3)
            s16 = cen.abs().amax(3).to(torch.float16)
            sigma[:, :, :, ci] = s16
            s = s16.to(torch.float32)
            inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0).unsqueeze(3)
            us = cen * inv  # signed u; the sign bit is u < 0 (so -0.0 and sigma = 0 are +)
            codes[:, :, :, c0:c1] = torch.bucketize(us.abs(), tt["thresholds"], right=False)
            neg[:, :, :, c0:c1] = us < 0
    return ReferenceCodes(lo, kexp, mu, sigma, neg, codes)


def encode_torch(x: torch.Tensor, lay: LynxLayout, tab: LynxTables,
                 scales: torch.Tensor | None) -> LynxArrays:
    """x: [L, 2, H, T, D] fp32 (already preconditioned) -> LynxArrays (reference)."""
    L, _, H, T, D = x.shape
    P = lay.page_tokens
    rc = reference_codes(x, lay, tab)
    fields = split_fields(rc.neg, rc.code, tab)  # stage 4: one uint8 field per stream
    lo, kexp, mu, sigma, dev = rc.lo, rc.k, rc.mu, rc.sigma, x.device
    buffers = alloc_buffers(lay, dev)
    arr = LynxArrays(lo, kexp, mu, sigma, scales, buffers)
    for s, b in enumerate(tab.split):
        for pl, first, view in code_regions(buffers[s], lay, s):
            npg = view.shape[1]
            t0 = first * P
            f = fields[s][:, :, :, t0: t0 + npg * pl.tokens]  # [L, 2, H, npg*n, D]
            f = f.reshape(L, 2 * H, npg, pl.tokens * D).transpose(1, 2)
            view.copy_(pack_rows(f, b))
    write_metadata(arr, lay)
    return arr


def decode_torch(arr: LynxArrays, lay: LynxLayout, tab: LynxTables, streams: int) -> torch.Tensor:
    """LynxArrays (first `streams` buffers) -> [L, 2, H, T, D] fp32 (still preconditioned)."""
    L, H, T, D = lay.shape.layers, lay.shape.kv_heads, lay.shape.tokens, lay.shape.head_dim
    dev = arr.lo.device
    tt = tab.torch_tables(dev)
    fields = []
    for s in range(streams):
        f = torch.empty(L, 2, H, T, D, dtype=torch.uint8, device=dev)
        for pl, first, view in code_regions(arr.buffers[s], lay, s):
            npg = view.shape[1]
            codes = unpack_rows(view, tab.split[s], pl.tokens * D)  # [L, npg, 2H, n*D]
            codes = codes.transpose(1, 2).reshape(L, 2, H, npg * pl.tokens, D)
            f[:, :, :, first * lay.page_tokens: first * lay.page_tokens + npg * pl.tokens] = codes
        fields.append(f)
    neg, prefix = join_fields(fields, tab)
    mag = tt["recon"][streams - 1][prefix.long()]
    v = torch.where(neg, -mag, mag)
    C = lay.chunk_tokens
    mu = (arr.mu.to(torch.int32) & 0xFFFF).to(torch.float32) * 2.0 ** -MU_FRAC_BITS
    mu = mu.repeat_interleave(C, dim=3)[:, :, :, :T]  # [L, 2, H, T, D]
    sg = arr.sigma.to(torch.float32).repeat_interleave(C, dim=3)[:, :, :, :T]
    xn = mu + sg * v
    P = lay.page_tokens
    lo = arr.lo.permute(0, 2, 3, 1, 4).repeat_interleave(P, dim=3)[:, :, :, :T]
    f = pow2(arr.k.to(torch.int32) + 1).permute(0, 2, 3, 1, 4)
    f = f.repeat_interleave(P, dim=3)[:, :, :, :T]
    return lo + xn * f


# ---- OScaR preconditioning (torch, any device) --------------------------------------------
def oscar_forward(x: torch.Tensor, targets: str, rotate=hadamard
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [L, 2, H, T, D] fp32 -> (preconditioned x, scales fp16 [L, T_kv, H, T]).
    Rotation (Hadamard over head_dim) first, then per-token L2-norm scaling. `rotate`: the
    torch reference `hadamard` or a bit-identical fast version (lynx_cpu.fwht_cpu)."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    if amax >= OSCAR_MAX_ABS:
        raise CodecError(f"lynx: oscar preconditioning needs |x| < 2^100 (fp32 Hadamard sums "
                         f"would overflow), got max |x| = {amax:.3g}")
    nkv = 2 if targets == "kv" else 1
    y = rotate(x[:, :nkv])  # [L, nkv, H, T, D]
    peak = y.abs().amax(-1, keepdim=True)
    norm = peak * (y / torch.where(peak > 0, peak, 1.0)).norm(dim=-1, keepdim=True)
    s16 = norm.clamp(max=torch.finfo(torch.float16).max).to(torch.float16)
    s = s16.to(torch.float32)
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    out = x.clone() if nkv == 1 else torch.empty_like(x)
    out[:, :nkv] = y * inv
    return out, s16.squeeze(-1)


def oscar_inverse(x: torch.Tensor, scales: torch.Tensor, targets: str, rotate=hadamard
                  ) -> torch.Tensor:
    """Undo oscar_forward: scaling, then rotation (returns unrotated K/V)."""
    nkv = 2 if targets == "kv" else 1
    x[:, :nkv] = rotate(x[:, :nkv] * scales.to(torch.float32).unsqueeze(-1))
    return x
