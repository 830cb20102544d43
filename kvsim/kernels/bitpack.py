"""Pack / unpack unsigned b-bit codes (b in 1, 2, 4, 8) into bytes, torch reference.

Codes are packed along the last dim, little-end first: for b = 4, byte = c[2i] | c[2i+1] << 4.
The last dim must be a multiple of 8 // b (callers pad; see `packed_len`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.core.lazy_module import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

PACKABLE_BITS = (1, 2, 4, 8)


def packed_len(n: int, bits: int) -> int:
    """Bytes needed for n codes of `bits` bits (padded up to a whole byte)."""
    check_bits(bits)
    return -(-n * bits // 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., n] ints in [0, 2**bits), n % (8 // bits) == 0 -> [..., n*bits/8] uint8."""
    check_bits(bits)
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"pack: last dim {codes.shape[-1]} not a multiple of {per} ({bits} bits)")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """packed: [..., m] uint8 -> [..., m * 8/bits] uint8 codes (truncated to n if given)."""
    check_bits(bits)
    if bits == 8:
        out = packed.to(torch.uint8)
    else:
        per = 8 // bits
        shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
        out = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
        out = out.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    return out if n is None else out[..., :n]


def check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bit width {bits} not packable; use one of {PACKABLE_BITS}")
