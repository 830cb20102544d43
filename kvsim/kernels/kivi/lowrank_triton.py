"""Triton kernel of GEAR's low-rank fit on the device: lowrank.low_rank, op for op, for many
matrices at once (its reference; the CPU path's twin is kivi_cpu._low_rank).

Each matrix E [q, d] (one layer, K|V, head and page) gets A [q, r], B [d, r]: B = B0, then
`iters` times B = orth(B); A = orth(E B); B = E^T A, with orth = modified Gram-Schmidt. Every
dot product is summed term by term in index order, each product and sum rounded to fp32
(FMA contraction off at launch), the norms' square roots and the divisions correctly rounded
(sqrt_rn, div_rn): the reference's bits. One program fits ROWS_PER_PROGRAM matrices side by
side, which makes the sequential sums vectors across those matrices:

- a product (E B, or E^T A) walks its summed index c in order and adds the outer product of
  E^T's row c (contiguous: the caller passes E and E^T) and B^T's column c to an
  accumulator [matrices, r, q] held in registers;
- a Gram-Schmidt dot product or norm is summed through a scratch row per matrix: the
  elementwise products are stored, then added one term after the other.

A and B are kept transposed (A^T [r, q], B^T [r, d]) in their output buffers, which double as
the working copies; the programs' threads meet at a barrier wherever one reads what another
wrote.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.kernels.triton_support import (
    DEFAULT_CUDA_ARCH,
    compile_ptx,
    interpreting,
    require_kernel_device,
)

ROWS_PER_PROGRAM = 4  # matrices fitted side by side by one program


@triton.jit
def _seq_sum(p, s_ptr, srow, rmask, N, BN: tl.constexpr):
    """p [BR, BN] -> [BR]: each matrix's first N terms summed in index order (lowrank.seq_sum),
    through its scratch row at s_ptr + srow."""
    ni = tl.arange(0, BN)
    tl.store(s_ptr + srow[:, None] + ni[None, :], p, mask=rmask[:, None] & (ni < N)[None, :])
    tl.debug_barrier()
    acc = tl.load(s_ptr + srow, mask=rmask, other=0.0)
    for t in range(1, N):
        acc = acc + tl.load(s_ptr + srow + t, mask=rmask, other=0.0)
    tl.debug_barrier()  # the scratch row is rewritten by the next sum
    return acc


@triton.jit
def _orthonormalize(m_ptr, mrow, s_ptr, srow, rmask, N, R: tl.constexpr, BN: tl.constexpr):
    """In place: the R columns of each matrix's [N, R] factor, held as its rows m[j, 0:N] at
    m_ptr + mrow (lowrank.orthonormalize's op order; a zero column stays zero)."""
    ni = tl.arange(0, BN)
    m2 = rmask[:, None] & (ni < N)[None, :]
    for j in tl.static_range(R):
        v = tl.load(m_ptr + mrow[:, None] + j * N + ni[None, :], mask=m2, other=0.0)
        for i in tl.static_range(j):
            qi = tl.load(m_ptr + mrow[:, None] + i * N + ni[None, :], mask=m2, other=0.0)
            dot = _seq_sum(qi * v, s_ptr, srow, rmask, N, BN)
            v = v - dot[:, None] * qi
        nrm = tl.sqrt_rn(_seq_sum(v * v, s_ptr, srow, rmask, N, BN))
        live = nrm > 0.0
        den = tl.where(live, nrm, 1.0)
        v = tl.where(live[:, None], tl.div_rn(v, den[:, None]), 0.0)
        tl.store(m_ptr + mrow[:, None] + j * N + ni[None, :], v, mask=m2)
        tl.debug_barrier()  # column j is read by the columns after it


@triton.jit
def _product(xt_ptr, xrow, yt_ptr, yrow, out_ptr, orow, rmask, K, M, R: tl.constexpr,
             RP: tl.constexpr, BM: tl.constexpr):
    """out[j, i] = sum_c xt[c, i] * yt[j, c], c = 0 .. K-1 in order, per matrix: xt [K, M],
    yt [R, K], out [R, M] at their row offsets (lowrank.matmul_seq's order)."""
    mi = tl.arange(0, BM)
    ji = tl.arange(0, RP)
    xmask = rmask[:, None] & (mi < M)[None, :]  # [BR, BM]
    ymask = rmask[:, None] & (ji < R)[None, :]  # [BR, RP]
    x = tl.load(xt_ptr + xrow[:, None] + mi[None, :], mask=xmask, other=0.0)
    y = tl.load(yt_ptr + yrow[:, None] + ji[None, :] * K, mask=ymask, other=0.0)
    acc = x[:, None, :] * y[:, :, None]  # [BR, RP, BM]
    for c in range(1, K):
        x = tl.load(xt_ptr + xrow[:, None] + c * M + mi[None, :], mask=xmask, other=0.0)
        y = tl.load(yt_ptr + yrow[:, None] + ji[None, :] * K + c, mask=ymask, other=0.0)
        acc = acc + x[:, None, :] * y[:, :, None]
    omask = ymask[:, :, None] & (mi < M)[None, None, :]
    tl.store(out_ptr + orow[:, None, None] + ji[None, :, None] * M + mi[None, None, :], acc,
             mask=omask)
    tl.debug_barrier()  # the next step reads what every thread stored


@triton.jit
def _low_rank_kernel(e_ptr, et_ptr, b0_ptr, at_ptr, bt_ptr, s_ptr, ROWS, Q, D, ITERS,
                     R: tl.constexpr, RP: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr,
                     BN: tl.constexpr, BR: tl.constexpr):
    """e [ROWS, Q, D], et [ROWS, D, Q] (fp32) -> at [ROWS, R, Q] = A^T, bt [ROWS, R, D] = B^T;
    b0 [D, R]: the start; s [ROWS, BN]: scratch."""
    rr = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    rmask = rr < ROWS
    erow = rr * Q * D
    arow = rr * R * Q
    brow = rr * R * D
    srow = rr * BN
    di = tl.arange(0, BD)
    dmask = di < D
    for j in tl.static_range(R):  # B^T = B0^T for every matrix
        col = tl.load(b0_ptr + di * R + j, mask=dmask, other=0.0)
        tl.store(bt_ptr + brow[:, None] + j * D + di[None, :],
                 tl.broadcast_to(col[None, :], (BR, BD)), mask=rmask[:, None] & dmask[None, :])
    tl.debug_barrier()
    for _ in range(ITERS):
        _orthonormalize(bt_ptr, brow, s_ptr, srow, rmask, D, R, BN)
        _product(et_ptr, erow, bt_ptr, brow, at_ptr, arow, rmask, D, Q, R, RP, BQ)  # E B
        _orthonormalize(at_ptr, arow, s_ptr, srow, rmask, Q, R, BN)
        _product(e_ptr, erow, at_ptr, arow, bt_ptr, brow, rmask, Q, D, R, RP, BD)  # E^T A


def _shape_consts(q: int, d: int, r: int) -> dict[str, int]:
    bq, bd = triton.next_power_of_2(q), triton.next_power_of_2(d)
    return dict(R=r, RP=triton.next_power_of_2(r), BQ=bq, BD=bd, BN=max(bq, bd),
                BR=ROWS_PER_PROGRAM)


def low_rank_device(e: torch.Tensor, rank: int, iters: int, b0: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """lowrank.low_rank on a CUDA tensor (or under TRITON_INTERPRET=1): e [batch, q, d] fp32,
    b0 [d, r] the start (lowrank.low_rank_start, r = min(rank, q, d)) -> A [batch, q, r],
    B [batch, d, r], the reference's bits."""
    require_kernel_device(e.device, "gear's triton fit", "use backend 'cpu' or 'auto'")
    n, q, d = (int(s) for s in e.shape)
    r = min(rank, q, d)
    if e.dtype != torch.float32 or tuple(b0.shape) != (d, r):
        raise ValueError(f"e must be fp32 [batch, q, d] and b0 [{d}, {r}], got {e.dtype} and "
                         f"{tuple(b0.shape)}")
    e = e.contiguous()
    at = torch.empty(n, r, q, dtype=torch.float32, device=e.device)
    bt = torch.empty(n, r, d, dtype=torch.float32, device=e.device)
    if n:
        consts = _shape_consts(q, d, r)
        scratch = torch.empty(n, consts["BN"], dtype=torch.float32, device=e.device)
        opts = {} if interpreting() else {"enable_fp_fusion": False}  # products rounded
        _low_rank_kernel[(triton.cdiv(n, ROWS_PER_PROGRAM),)](
            e, e.transpose(-1, -2).contiguous(), b0.to(e.device, torch.float32).contiguous(),
            at, bt, scratch, n, q, d, iters, **consts, **opts)
    return at.transpose(-1, -2), bt.transpose(-1, -2)


def compile_for_cuda(arch: int = DEFAULT_CUDA_ARCH) -> dict[str, str]:
    """Build the fit for CUDA sm_<arch> without a GPU, at GEAR's default page (256 tokens x
    head_dim 128, rank 4) and a short last page; returns the PTX by name."""
    ptrs = {name: "*fp32" for name in ("e_ptr", "et_ptr", "b0_ptr", "at_ptr", "bt_ptr",
                                       "s_ptr")}
    return {f"low_rank_q{q}": compile_ptx(_low_rank_kernel, ptrs, _shape_consts(q, 128, 4),
                                          arch, fp_fusion=False)
            for q in (256, 40)}
