"""GEAR's low-rank fit of the quantization error (kivi/gear.py): subspace iteration with
modified Gram-Schmidt, every dot product summed term by term in index order with fp32
elementwise ops, so that the torch reference, the numba kernel of the CPU path
(kivi_cpu._low_rank) and the device path give the same bits; and the fp16 balancing of
factors that would overflow."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvsim.core.lazy_module import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


FP16_ROUNDS_TO_INF = 65520.0  # fp32 values >= this become inf in fp16
BALANCED_B_MAX = 32768.0  # where fit_fp16 brings an overflowing column of B


def fit_fp16(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [batch, q, r] (orthonormal columns, |a| <= 1), b [batch, d, r]: where a column of
    b would overflow fp16, move a power of two 2^k from b to a (a 2^k, b 2^-k: exact, same
    product) so that |b| <= 32768 and |a| <= 2^k; columns that fit are left as they are, so
    the bytes of every cache whose factors fit fp16 are unchanged. |b| <= sqrt(q) max|E|,
    i.e. <= 2^8 * 2^17 for pages up to 65536 tokens: 2^k <= 2^10, a stays inside fp16.
    k = ceil(log2(peak / 32768)) is found from the exponent bits (frexp) and 2^k built from
    them, so that every device gives the same k (a log2 may be an ulp off); no branch on the
    data, so nothing waits for a device."""
    peak = b.abs().amax(dim=1, keepdim=True)  # [batch, 1, r]
    over = peak >= FP16_ROUNDS_TO_INF
    # peak / 32768 = m 2^e, m in [0.5, 1): the smallest k with 2^k >= it is e, or e - 1
    # when m is 0.5 (a power of two)
    m, e = torch.frexp(peak / BALANCED_B_MAX)
    k = (e - (m == 0.5).to(e.dtype)).clamp(-126, 127)
    c = ((k + 127) << 23).to(torch.int32).view(torch.float32)  # 2^k, exactly
    c = torch.where(over, c, torch.ones_like(peak))
    return a * c, b / c


def seq_sum(p: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim`, one term at a time in index order (every partial sum rounded to fp32):
    a defined order that kivi_cpu's numba kernels repeat bit for bit (torch.sum's and a
    BLAS matmul's orders are their own)."""
    acc = p.select(dim, 0)
    for i in range(1, p.shape[dim]):
        acc = acc + p.select(dim, i)
    return acc


def matmul_seq(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [..., m, k] @ y [..., k, n] with every dot product summed in k order (seq_sum)."""
    acc = x[..., :, 0:1] * y[..., 0:1, :]
    for c in range(1, x.shape[-1]):
        acc = acc + x[..., :, c:c + 1] * y[..., c:c + 1, :]
    return acc


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 sqrt rounded to nearest, as IEEE (and numba's sqrtf) define it: torch.sqrt on CPU
    may be an ulp off (a vectorized approximation). Of torch.sqrt's result and its two fp32
    neighbours, the one whose square is nearest x (squares and differences exact in fp64)."""
    s = torch.sqrt(x)
    c = torch.stack((torch.nextafter(s, torch.full_like(s, -math.inf)), s,
                     torch.nextafter(s, torch.full_like(s, math.inf))))
    miss = (c.double() * c.double() - x.double()).abs()
    return c.gather(0, miss.argmin(dim=0, keepdim=True)).squeeze(0)


def orthonormalize(m: torch.Tensor) -> torch.Tensor:
    """m [..., n, r] -> Q [..., n, r] with orthonormal columns spanning m's: modified
    Gram-Schmidt, column by column, dot products by seq_sum (a zero column stays zero)."""
    cols: list[torch.Tensor] = []
    for j in range(m.shape[-1]):
        v = m[..., j]
        for qi in cols:
            v = v - seq_sum(qi * v, -1).unsqueeze(-1) * qi
        nrm = sqrt_rn(seq_sum(v * v, -1)).unsqueeze(-1)
        live = nrm > 0
        cols.append(torch.where(live, v / torch.where(live, nrm, torch.ones_like(nrm)),
                                torch.zeros_like(v)))
    return torch.stack(cols, dim=-1)


def low_rank_start(d: int, r: int, seed: int) -> torch.Tensor:
    """B0 [d, r] ~ N(0, 1) from a generator seeded with `seed`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(d, r, generator=gen, dtype=torch.float32)


def low_rank(e: torch.Tensor, rank: int, iters: int, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """e: [batch, q, d] fp32 -> A [batch, q, r], B [batch, d, r] with e ~ A B^T: subspace
    iteration, `iters` times B = orth(B); A = orth(E B); B = E^T A, with orthonormalize and
    matmul_seq: elementwise fp32 ops in one defined order, so that the numba kernel
    (kivi_cpu._low_rank) gives the same bits."""
    n, q, d = e.shape
    r = min(rank, q, d)
    b = low_rank_start(d, r, seed).to(e.device).expand(n, d, r)
    a = e.new_zeros(n, q, r)
    et = e.transpose(-1, -2)
    for _ in range(iters):
        b = orthonormalize(b)
        a = orthonormalize(matmul_seq(e, b))
        b = matmul_seq(et, a)
    return a, b


def low_rank_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., q, r], b [..., d, r] (fp32) -> A B^T [..., q, d] as a sum of rank-one terms in
    rank order (elementwise products and sums, each rounded to fp32): one defined order of
    operations, which the fused CPU decode (kivi_cpu._decode_kernel) repeats bit for bit; a
    matmul's order is the BLAS's own."""
    bt = b.transpose(-1, -2)  # [..., r, d]
    out = a[..., 0:1] * bt[..., 0:1, :]
    for j in range(1, a.shape[-1]):
        out = out + a[..., j:j + 1] * bt[..., j:j + 1, :]
    return out
