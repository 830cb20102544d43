"""Triton kernel: orthonormal fast Walsh-Hadamard transform along the last dim (head_dim).

Each program loads ROWS rows x D (a power of two) into registers and runs the log2(D)
butterfly stages of the torch reference (hadamard.py) in the same order: at stage h the
row is viewed as [D / 2h, 2, h] and (a, b) -> (a + b, a - b); then one multiply by
1/sqrt(D). All arithmetic is fp32 (inputs are converted in the wrapper: the interpreter has
no bf16 arithmetic). Since the operation order matches the reference, results normally
agree bit for bit; tests allow the fp32 rounding bound of a log2(D)-deep sum.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvsim.kernels.hadamard import check_hadamard_dim
from kvsim.kernels.triton_support import (
    DEFAULT_CUDA_ARCH,
    compile_ptx,
    require_kernel_device,
)

ROWS_PER_PROGRAM = 16


@triton.jit
def _fwht_kernel(x_ptr, out_ptr, n_rows, scale, D: tl.constexpr, LOG2D: tl.constexpr,
                 ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    mask = (rows < n_rows)[:, None]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)  # [ROWS, D]
    for i in tl.static_range(LOG2D):
        # stage h = 2^i: [ROWS, D] -> [ROWS, D/2h, 2, h] -> pair axis last -> butterflies
        # -> back. h is written out, not named: a constexpr name cannot be rebound in the
        # unrolled loop (the compiler refuses it; the interpreter does not check).
        t = tl.permute(tl.reshape(x, (ROWS, D // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
        a, b = tl.split(t)
        t = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(t, (ROWS, D))
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], x * scale, mask=mask)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x: [..., d] float, d a power of two -> [..., d] fp32 = H_d x (orthonormal, its own
    inverse). Runs on x's device (CPU needs TRITON_INTERPRET=1)."""
    d = int(x.shape[-1])
    check_hadamard_dim(d)
    require_kernel_device(x.device, "the Triton Hadamard kernel",
                          "use kvsim.kernels.hadamard (torch) on a CPU tensor")
    xf = x.to(torch.float32).contiguous().reshape(-1, d)
    out = torch.empty_like(xf)
    rows = xf.shape[0]
    if rows:
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
        _fwht_kernel[grid](xf, out, rows, 1.0 / math.sqrt(d), D=d, LOG2D=d.bit_length() - 1,
                           ROWS=ROWS_PER_PROGRAM)
    return out.reshape(x.shape)


def compile_for_cuda(arch: int = DEFAULT_CUDA_ARCH, head_dims: tuple[int, ...] = (64, 128, 256)
                     ) -> dict[str, str]:
    """Build the kernel for CUDA sm_<arch> at each head_dim without a GPU; returns the PTX by
    name. Needs TRITON_INTERPRET unset (triton_support.compile_ptx)."""
    return {f"fwht_{d}": compile_ptx(_fwht_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32",
                                                     "scale": "fp32"},
                                     dict(D=d, LOG2D=d.bit_length() - 1,
                                          ROWS=ROWS_PER_PROGRAM), arch)
            for d in head_dims}
