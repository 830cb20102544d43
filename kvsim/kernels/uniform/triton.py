"""Triton kernels of the `uniform` codec: group quantize + bit-pack straight into the wire
buffer, and its mirror (wire buffer -> dequantized tensor).

The cache [layers, 2, kv_heads, tokens, head_dim] is read as rows [layers*2*kv_heads*tokens,
head_dim] (one row per (layer, K|V, head, token)); each row is split into groups of `group`
consecutive channels. Each program handles ROWS rows x one group and writes its codes, fp16
scales and fp16 zero points where the chunk's payload holds them: the buffer is every chunk's
payload end to end in (layer, page) order (chunk (l, p) at l * layer_bytes + p * full_bytes),
each payload laid out as uniform.codec's ChunkLayout (codes [2, H, t, D*bits/8], then scale
and zero [2, H, t, D/group], little-endian). So one launch produces the bytes the wire sends,
on the device, with no host copy and no per-page copies.

The arithmetic is groupquant_triton's, the torch reference's exact op sequence, so the bytes
match the reference (groupquant.quantize_groups) bit for bit. The encode kernel also flags
non-finite inputs and |x| beyond fp16's range in a two-int status (read once by the caller:
the refusal costs no extra pass over the cache).

Packing matches bitpack.pack along the last dim (little-end first: for 4 bits,
byte = c[2i] | c[2i+1] << 4); a group never straddles a byte (group % (8 // bits) == 0).
On CUDA the kernels read bf16 / fp16 / fp32 directly; under TRITON_INTERPRET=1 (the CPU
tests, set by tests/conftest.py when there is no CUDA) the input is widened to fp32 first,
since the interpreter has no bf16 arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.kernels.bitpack import pack
from kvsim.kernels.groupquant import FP16_MAX, dequantize_groups, qmax_of, quantize_groups
from kvsim.kernels.groupquant_triton import (
    dequantize_tile,
    load_codes,
    load_f16,
    quantize_tile,
    store_codes,
    store_f16,
)
from kvsim.kernels.triton_support import (
    DEFAULT_CUDA_ARCH,
    compile_ptx,
    interpreting,
    require_kernel_device,
)

# rows per program: 64 keeps a GPU program's tile at 4-8 KB of input (memory-bound kernel);
# the interpreter runs one program at a time in numpy, where smaller tiles test more edges
ROWS_PER_PROGRAM_GPU = 64
ROWS_PER_PROGRAM_INTERPRETED = 16
STATUS_NONFINITE, STATUS_BEYOND_FP16 = 0, 1  # the encode kernel's status counters


@triton.jit
def _wire_addresses(rows, g, T, LAYER_BYTES, FULL_BYTES, P: tl.constexpr, H2: tl.constexpr,
                    CB: tl.constexpr, NG: tl.constexpr, GB: tl.constexpr):
    """Byte offsets (int64 [ROWS]) of a group's codes, scale and zero point in the wire
    buffer, for rows = l * H2 * T + (kv * H + h) * T + token."""
    r = rows.to(tl.int64)
    l = r // (H2 * T)
    rem = r % (H2 * T)
    kh = rem // T
    tok = rem % T
    p = tok // P
    t = tl.minimum(T - p * P, P)  # tokens of this row's page
    crow = kh * t + tok % P  # row inside the chunk's [2H, t] rows
    base = l * LAYER_BYTES + p * FULL_BYTES
    codes_at = base + crow * CB + g * GB
    scale_at = base + H2 * t * CB + (crow * NG + g) * 2
    zero_at = scale_at + H2 * t * NG * 2
    return codes_at, scale_at, zero_at


@triton.jit
def _encode_wire_kernel(x_ptr, out_ptr, status_ptr, n_rows, T, LAYER_BYTES, FULL_BYTES,
                        N: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                        BITS: tl.constexpr, ROWS: tl.constexpr, P: tl.constexpr,
                        H2: tl.constexpr, BIG: tl.constexpr):
    QMAX: tl.constexpr = (1 << BITS) - 1
    NG: tl.constexpr = N // GROUP  # groups per row
    CB: tl.constexpr = N * BITS // 8  # code bytes per row
    GB: tl.constexpr = GROUP * BITS // 8  # code bytes per group
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = tl.arange(0, BLOCK_G)
    rmask = rows < n_rows
    cmask = cols < GROUP
    mask = rmask[:, None] & cmask[None, :]
    # x: [ROWS, BLOCK_G] fp32 (out-of-range rows read as 0, padded columns excluded below)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * N + g * GROUP + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    ax = tl.abs(x)
    nonfinite = tl.sum(tl.where(mask & ((x != x) | (ax == float("inf"))), 1, 0))
    beyond = tl.sum(tl.where(mask & (ax > BIG), 1, 0))
    # flags, not counts: a count could wrap int32 on a large all-NaN cache
    tl.atomic_max(status_ptr + 0, 1, mask=nonfinite > 0)
    tl.atomic_max(status_ptr + 1, 1, mask=beyond > 0)
    q, scale16, zero16 = quantize_tile(x, tl.broadcast_to(cmask[None, :], (ROWS, BLOCK_G)),
                                       1, QMAX)
    codes_at, scale_at, zero_at = _wire_addresses(rows, g, T, LAYER_BYTES, FULL_BYTES, P, H2,
                                                  CB, NG, GB)
    store_f16(out_ptr, scale_at, scale16, rmask)
    store_f16(out_ptr, zero_at, zero16, rmask)
    store_codes(out_ptr, codes_at, q, rmask, ROWS, GROUP, BLOCK_G, BITS)


@triton.jit
def _decode_wire_kernel(src_ptr, out_ptr, n_rows, T, LAYER_BYTES, FULL_BYTES,
                        N: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                        BITS: tl.constexpr, ROWS: tl.constexpr, P: tl.constexpr,
                        H2: tl.constexpr):
    NG: tl.constexpr = N // GROUP
    CB: tl.constexpr = N * BITS // 8
    GB: tl.constexpr = GROUP * BITS // 8
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    rmask = rows < n_rows
    codes_at, scale_at, zero_at = _wire_addresses(rows, g, T, LAYER_BYTES, FULL_BYTES, P, H2,
                                                  CB, NG, GB)
    s = load_f16(src_ptr, scale_at, rmask)
    z = load_f16(src_ptr, zero_at, rmask)
    cols = tl.arange(0, BLOCK_G)
    mask = rmask[:, None] & (cols < GROUP)[None, :]
    q = load_codes(src_ptr, codes_at, rmask, ROWS, GROUP, BLOCK_G, BITS)
    out = dequantize_tile(q, s, z, 1)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + g * GROUP + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


_INSTEAD = "use backend 'cpu', 'torch' or 'auto'"


def _check(n: int, group: int, bits: int) -> None:
    qmax_of(bits)
    if group < 1 or n % group:
        raise ValueError(f"row length {n} is not a multiple of the group size {group}")
    if group % (8 // bits):
        raise ValueError(f"group size {group} must be a multiple of {8 // bits} for "
                         f"{bits}-bit packing")


def _rows_per_program() -> int:
    return ROWS_PER_PROGRAM_INTERPRETED if interpreting() else ROWS_PER_PROGRAM_GPU


def _constexprs(dims: tuple[int, ...], group: int, bits: int, page_tokens: int) -> dict:
    return dict(N=dims[-1], GROUP=group, BLOCK_G=triton.next_power_of_2(group), BITS=bits,
                ROWS=_rows_per_program(), P=page_tokens, H2=2 * dims[2])


def encode_wire(kv: torch.Tensor, group: int, bits: int, page_tokens: int, layer_bytes: int,
                full_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv: [layers, 2, kv_heads, tokens, head_dim] float on CUDA (or CPU under the
    interpreter) -> (wire buffer uint8 [layers * layer_bytes] on kv's device, status int32
    [2]: 1 where some input is non-finite, resp. beyond fp16's range, else 0). One launch;
    nothing is synchronized: read the status after the stream has run (Codec.encode_device
    does, through DeviceWire.verify)."""
    if kv.dim() != 5:
        raise ValueError(f"encode_wire expects [layers, 2, kv_heads, tokens, head_dim], got "
                         f"shape {tuple(kv.shape)}")
    dims = tuple(int(s) for s in kv.shape)
    _check(dims[-1], group, bits)
    require_kernel_device(kv.device, "uniform triton backend", _INSTEAD)
    x = kv.contiguous()
    if interpreting() or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.to(torch.float32)
    out = torch.empty(dims[0] * layer_bytes, dtype=torch.uint8, device=kv.device)
    status = torch.zeros(2, dtype=torch.int32, device=kv.device)
    n_rows = dims[0] * 2 * dims[2] * dims[3]
    if n_rows:
        consts = _constexprs(dims, group, bits, page_tokens)
        grid = (triton.cdiv(n_rows, consts["ROWS"]), dims[-1] // group)
        _encode_wire_kernel[grid](x, out, status, n_rows, dims[3], layer_bytes, full_bytes,
                                  BIG=FP16_MAX, **consts)
    return out, status


def decode_wire(wire: torch.Tensor, dims: tuple[int, ...], group: int, bits: int,
                page_tokens: int, layer_bytes: int, full_bytes: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Mirror of encode_wire: wire buffer (uint8 [layers * layer_bytes], on CUDA or CPU under
    the interpreter) -> [layers, 2, kv_heads, tokens, head_dim] in `dtype` (fp32 under the
    interpreter) on the buffer's device. One launch."""
    _check(dims[-1], group, bits)
    require_kernel_device(wire.device, "uniform triton backend", _INSTEAD)
    if wire.dtype != torch.uint8 or wire.numel() != dims[0] * layer_bytes:
        raise ValueError(f"wire buffer must be uint8 of {dims[0] * layer_bytes} bytes, got "
                         f"{wire.dtype} of {wire.numel()}")
    if interpreting():
        dtype = torch.float32
    out = torch.empty(dims, dtype=dtype, device=wire.device)
    n_rows = dims[0] * 2 * dims[2] * dims[3]
    if n_rows:
        consts = _constexprs(dims, group, bits, page_tokens)
        grid = (triton.cdiv(n_rows, consts["ROWS"]), dims[-1] // group)
        _decode_wire_kernel[grid](wire.contiguous(), out, n_rows, dims[3], layer_bytes,
                                  full_bytes, **consts)
    return out


def compile_for_cuda(arch: int = DEFAULT_CUDA_ARCH, n: int = 128, group: int = 64
                     ) -> dict[str, str]:
    """Build both kernels (2-, 4- and 8-bit, bf16 in and out) for CUDA sm_<arch> without a
    GPU; returns their PTX by name. Needs TRITON_INTERPRET unset (triton_support.compile_ptx)."""
    ptx = {}
    for bits in (2, 4, 8):
        consts = dict(N=n, GROUP=group, BLOCK_G=triton.next_power_of_2(group), BITS=bits,
                      ROWS=ROWS_PER_PROGRAM_GPU, P=256, H2=16)
        ptx[f"encode_wire_{bits}bit"] = compile_ptx(
            _encode_wire_kernel, {"x_ptr": "*bf16", "out_ptr": "*u8", "status_ptr": "*i32",
                                  "LAYER_BYTES": "i64", "FULL_BYTES": "i64"},
            {**consts, "BIG": FP16_MAX}, arch)
        ptx[f"decode_wire_{bits}bit"] = compile_ptx(
            _decode_wire_kernel, {"src_ptr": "*u8", "out_ptr": "*bf16",
                                  "LAYER_BYTES": "i64", "FULL_BYTES": "i64"}, consts, arch)
    return ptx


# ---- torch reference of the quantizer (the specification the kernels match) ---------------
def quantize_pack_reference(x: torch.Tensor, group: int, bits: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [rows, n] float -> packed uint8 [rows, n*bits/8], scale16, zero16 fp16
    [rows, n/group]."""
    _check(int(x.shape[-1]), group, bits)
    codes, scale16, zero16 = quantize_groups(x, group, bits)
    return pack(codes, bits), scale16, zero16


def unpack_dequantize_reference(packed: torch.Tensor, scale16: torch.Tensor,
                                zero16: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    from kvsim.kernels.bitpack import unpack

    return dequantize_groups(unpack(packed, bits), scale16, zero16, group)
