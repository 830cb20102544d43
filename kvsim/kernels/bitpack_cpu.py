"""Pack / unpack b-bit codes of a flat vector on the CPU: numba kernels, byte-identical to
bitpack.pack / unpack (little end first). Serial on purpose: they run as many small calls, each
a fraction of a page's work, where waking numba's thread pool costs more than the work."""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvsim.kernels.bitpack import check_bits

_JIT = dict(cache=True, nogil=True, error_model="numpy")


@numba.njit(**_JIT)
def _pack_kernel(codes, bits, out):
    """codes: flat uint8 (length a multiple of 8 // bits) -> out uint8 [len * bits / 8]."""
    per = 8 // bits
    m = out.shape[0]
    for i in range(m):
        acc = 0
        for j in range(per):
            acc |= np.int32(codes[i * per + j]) << (j * bits)
        out[i] = np.uint8(acc)


@numba.njit(**_JIT)
def _unpack_kernel(packed, bits, out):
    """packed uint8 [m] -> out uint8 [m * 8 / bits] (the caller truncates)."""
    per = 8 // bits
    mask = (1 << bits) - 1
    for i in range(packed.shape[0]):
        byte = np.int32(packed[i])
        for j in range(per):
            out[i * per + j] = np.uint8((byte >> (j * bits)) & mask)


def pack_flat(codes: torch.Tensor, bits: int) -> np.ndarray:
    """bitpack.pack of a flat code vector: codes (any shape) -> flat uint8 packed bytes, zero-padded
    to a whole byte."""
    check_bits(bits)
    flat = codes.detach().cpu().to(torch.uint8).contiguous().reshape(-1).numpy()
    if bits == 8:
        return flat.copy()
    per = 8 // bits
    pad = (-flat.size) % per
    if pad:
        flat = np.concatenate((flat, np.zeros(pad, np.uint8)))
    out = np.empty(flat.size // per, np.uint8)
    _pack_kernel(flat, bits, out)
    return out


def unpack_flat(packed: np.ndarray, bits: int, n: int) -> torch.Tensor:
    """bitpack.unpack of a flat code vector: packed uint8 -> the first n codes (uint8)."""
    check_bits(bits)
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    if bits == 8:
        return torch.from_numpy(packed[:n].copy())
    out = np.empty(packed.size * (8 // bits), np.uint8)
    _unpack_kernel(packed, bits, out)
    return torch.from_numpy(out[:n])
