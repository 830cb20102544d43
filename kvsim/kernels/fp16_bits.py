"""fp32 <-> fp16 bit-pattern conversions for the numba CPU kernels, equal to torch's `.half()`
(round to nearest even, overflow to inf, fp16 subnormals) so the CPU kernels write the same
bytes as the torch references. Scalar functions: numba inlines them into the callers' loops.
"""

from __future__ import annotations

import numba

_JIT = dict(cache=True, nogil=True, error_model="numpy")


@numba.njit(**_JIT)
def f32_bits_to_f16_bits(u):
    """u: bit pattern (int64) of a finite fp32 -> fp16 bits, round to nearest even, as
    torch .half() (|x| >= 65520 -> +-inf, tiny values -> fp16 subnormals or +-0)."""
    sign = (u >> 16) & 0x8000
    exp = (u >> 23) & 0xFF
    man = u & 0x7FFFFF
    if exp >= 143:  # >= 2^16: inf
        h = 0x7C00
    elif exp >= 113:  # normal fp16
        h = ((exp - 112) << 10) | (man >> 13)
        rem = man & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1)):
            h += 1  # a carry into the exponent is still right (up to inf)
    elif exp == 0 or 126 - exp > 25:
        h = 0
    else:  # fp16 subnormal: value in units of 2^-24 is m >> shift
        shift = 126 - exp
        m = man | 0x800000
        h = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (h & 1)):
            h += 1
    return sign | h


@numba.njit(**_JIT)
def f16_bits_to_f32_bits(h):
    """h: fp16 bits (int64) -> the fp32 bit pattern of the same value (exact)."""
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    if exp == 0:
        if man == 0:
            return sign
        e = 113  # subnormal man * 2^-24: normalize so that bit 10 is the implicit one
        while (man & 0x400) == 0:
            man <<= 1
            e -= 1
        return sign | (e << 23) | ((man & 0x3FF) << 13)
    if exp == 31:
        return sign | 0x7F800000 | (man << 13)
    return sign | ((exp + 112) << 23) | (man << 13)
