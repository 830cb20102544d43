"""Triton kernels: uniform asymmetric group quantize + bit-pack, and unpack + dequantize.

Rows of x: [rows, n] are split into groups of `group` consecutive elements (per-token
groups along head_dim when rows are tokens). Each program handles ROWS rows x one group.
The arithmetic is the exact op sequence of the torch reference
(groupquant.quantize_groups): fp32 min/max, IEEE-rounded divisions (tl.math.div_rn; plain
`/` lowers to an approximate division on the GPU), round-to-nearest-even fp16 casts and
floor(v + 0.5), so codes, scales and zero points match the reference bit for bit.
Dequantization is exact too: code * scale16 needs <= 19 significant bits, so whether or
not the compiler fuses it into an FMA the fp32 result is the same.

Packing matches bitpack.pack along the last dim (little-end first: for 4 bits,
byte = c[2i] | c[2i+1] << 4); a group never straddles a byte (group % (8 // bits) == 0).
The wrappers take any float input (converted to fp32 first: the interpreter has no bf16
arithmetic) and run on whatever device the tensor lives on; on CPU that requires
TRITON_INTERPRET=1 (set by tests/conftest.py when there is no CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.kernels.bitpack import pack
from kvsim.kernels.groupquant import dequantize_groups, qmax_of, quantize_groups
from kvsim.kernels.triton_support import (
    DEFAULT_CUDA_ARCH,
    compile_ptx,
    require_kernel_device,
)

ROWS_PER_PROGRAM = 16


@triton.jit
def _quantize_pack_kernel(x_ptr, packed_ptr, scale_ptr, zero_ptr, n_rows,
                          N: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                          BITS: tl.constexpr, ROWS: tl.constexpr):
    PER: tl.constexpr = 8 // BITS  # codes per byte
    QMAX: tl.constexpr = (1 << BITS) - 1
    NG: tl.constexpr = N // GROUP  # groups per row
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = tl.arange(0, BLOCK_G)
    rmask = rows < n_rows
    cmask = cols < GROUP
    mask = rmask[:, None] & cmask[None, :]
    # x: [ROWS, BLOCK_G] fp32 (out-of-range rows read as 0, padded columns excluded below)
    x = tl.load(x_ptr + rows[:, None] * N + g * GROUP + cols[None, :], mask=mask, other=0.0)
    mn = tl.min(tl.where(cmask[None, :], x, float("inf")), axis=1) + 0.0  # -0.0 -> +0.0
    mx = tl.max(tl.where(cmask[None, :], x, float("-inf")), axis=1) + 0.0
    qmax = tl.full((ROWS,), QMAX, tl.float32)
    scale16 = tl.math.div_rn(mx - mn, qmax).to(tl.float16)
    zero16 = mn.to(tl.float16)
    s = scale16.to(tl.float32)
    z = zero16.to(tl.float32)
    live = s > 0
    safe = tl.where(live, s, 1.0)
    v = tl.math.div_rn(x - z[:, None], tl.broadcast_to(safe[:, None], (ROWS, BLOCK_G)))
    q = tl.minimum(tl.maximum(tl.floor(v + 0.5), 0.0), QMAX * 1.0)
    q = tl.where(live[:, None], q, 0.0).to(tl.int32)
    tl.store(scale_ptr + rows * NG + g, scale16, mask=rmask)
    tl.store(zero_ptr + rows * NG + g, zero16, mask=rmask)
    if PER == 1:
        tl.store(packed_ptr + rows[:, None] * N + g * GROUP + cols[None, :], q.to(tl.uint8),
                 mask=mask)
    else:
        # [ROWS, BLOCK_G] -> [ROWS, BLOCK_G / PER, PER]; byte = sum_j code_j << (j * BITS)
        q3 = tl.reshape(q, (ROWS, BLOCK_G // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        byte = tl.sum(q3 << shifts[None, None, :], axis=2)
        bcols = tl.arange(0, BLOCK_G // PER)
        bmask = rmask[:, None] & (bcols < GROUP // PER)[None, :]
        tl.store(packed_ptr + rows[:, None] * (N // PER) + g * (GROUP // PER) + bcols[None, :],
                 byte.to(tl.uint8), mask=bmask)


@triton.jit
def _unpack_dequantize_kernel(packed_ptr, scale_ptr, zero_ptr, out_ptr, n_rows,
                              N: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                              BITS: tl.constexpr, ROWS: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    NG: tl.constexpr = N // GROUP
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    rmask = rows < n_rows
    s = tl.load(scale_ptr + rows * NG + g, mask=rmask, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + rows * NG + g, mask=rmask, other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK_G)
    mask = rmask[:, None] & (cols < GROUP)[None, :]
    if PER == 1:
        q = tl.load(packed_ptr + rows[:, None] * N + g * GROUP + cols[None, :], mask=mask,
                    other=0).to(tl.int32)
    else:
        bcols = tl.arange(0, BLOCK_G // PER)
        bmask = rmask[:, None] & (bcols < GROUP // PER)[None, :]
        byte = tl.load(packed_ptr + rows[:, None] * (N // PER) + g * (GROUP // PER)
                       + bcols[None, :], mask=bmask, other=0).to(tl.int32)
        shifts = tl.arange(0, PER) * BITS
        q3 = (byte[:, :, None] >> shifts[None, None, :]) & QMAX  # [ROWS, BLOCK_G/PER, PER]
        q = tl.reshape(q3, (ROWS, BLOCK_G))
    out = z[:, None] + q.to(tl.float32) * s[:, None]
    tl.store(out_ptr + rows[:, None] * N + g * GROUP + cols[None, :], out, mask=mask)


_INSTEAD = "use backend 'cpu', 'torch' or 'auto'"


def _check(n: int, group: int, bits: int) -> None:
    qmax_of(bits)
    if group < 1 or n % group:
        raise ValueError(f"row length {n} is not a multiple of the group size {group}")
    if group % (8 // bits):
        raise ValueError(f"group size {group} must be a multiple of {8 // bits} for "
                         f"{bits}-bit packing")


def quantize_pack(x: torch.Tensor, group: int, bits: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [rows, n] float -> packed uint8 [rows, n*bits/8], scale16, zero16 fp16 [rows, n/group]
    (Triton kernel; same bytes as quantize_pack_reference)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_pack expects [rows, n], got shape {tuple(x.shape)}")
    rows, n = (int(s) for s in x.shape)
    _check(n, group, bits)
    require_kernel_device(x.device, "uniform triton backend", _INSTEAD)
    xf = x.to(torch.float32).contiguous()
    packed = torch.empty((rows, n * bits // 8), dtype=torch.uint8, device=x.device)
    scale16 = torch.empty((rows, n // group), dtype=torch.float16, device=x.device)
    zero16 = torch.empty_like(scale16)
    if rows:
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), n // group)
        _quantize_pack_kernel[grid](xf, packed, scale16, zero16, rows, N=n, GROUP=group,
                                    BLOCK_G=triton.next_power_of_2(group), BITS=bits,
                                    ROWS=ROWS_PER_PROGRAM)
    return packed, scale16, zero16


def unpack_dequantize(packed: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor,
                      group: int, bits: int) -> torch.Tensor:
    """Inverse of quantize_pack: -> fp32 [rows, n] (Triton kernel)."""
    rows = int(packed.shape[0])
    n = int(packed.shape[1]) * 8 // bits
    _check(n, group, bits)
    require_kernel_device(packed.device, "uniform triton backend", _INSTEAD)
    if tuple(scale16.shape) != (rows, n // group) or tuple(zero16.shape) != (rows, n // group):
        raise ValueError(f"scale/zero must be [{rows}, {n // group}], got "
                         f"{tuple(scale16.shape)} / {tuple(zero16.shape)}")
    out = torch.empty((rows, n), dtype=torch.float32, device=packed.device)
    if rows:
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), n // group)
        _unpack_dequantize_kernel[grid](packed.contiguous(), scale16.contiguous(),
                                        zero16.contiguous(), out, rows, N=n, GROUP=group,
                                        BLOCK_G=triton.next_power_of_2(group), BITS=bits,
                                        ROWS=ROWS_PER_PROGRAM)
    return out


def compile_for_cuda(arch: int = DEFAULT_CUDA_ARCH, n: int = 128, group: int = 32
                     ) -> dict[str, str]:
    """Build both kernels (2-, 4- and 8-bit) for CUDA sm_<arch> without a GPU; returns their
    PTX by name. Needs TRITON_INTERPRET unset (triton_support.compile_ptx)."""
    ptx = {}
    for bits in (2, 4, 8):
        consts = dict(N=n, GROUP=group, BLOCK_G=triton.next_power_of_2(group), BITS=bits,
                      ROWS=ROWS_PER_PROGRAM)
        ptx[f"quantize_pack_{bits}bit"] = compile_ptx(
            _quantize_pack_kernel, {"x_ptr": "*fp32", "packed_ptr": "*u8",
                                    "scale_ptr": "*fp16", "zero_ptr": "*fp16"}, consts, arch)
        ptx[f"unpack_dequantize_{bits}bit"] = compile_ptx(
            _unpack_dequantize_kernel, {"packed_ptr": "*u8", "scale_ptr": "*fp16",
                                        "zero_ptr": "*fp16", "out_ptr": "*fp32"}, consts, arch)
    return ptx


# ---- torch reference with the same signature --------------------------------------------
def quantize_pack_reference(x: torch.Tensor, group: int, bits: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(int(x.shape[-1]), group, bits)
    codes, scale16, zero16 = quantize_groups(x, group, bits)
    return pack(codes, bits), scale16, zero16


def unpack_dequantize_reference(packed: torch.Tensor, scale16: torch.Tensor,
                                zero16: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    from kvsim.kernels.bitpack import unpack

    return dequantize_groups(unpack(packed, bits), scale16, zero16, group)
