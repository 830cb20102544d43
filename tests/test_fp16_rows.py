"""The branch-free fp16 conversions of the numba kernels (fp16_bits.*_rows) against torch."""

from __future__ import annotations

import numpy as np
import torch

from kvsim.kernels.fp16_bits import (
    f16_bits_to_f32_bits,
    f16_bits_to_f32_rows,
    f32_bits_to_f16_bits,
    f32_to_f16_bits_rows,
)


def _finite_f32_probes() -> np.ndarray:
    """Random fp32 patterns plus every (sign, exponent, top mantissa) with the 13 bits that
    fp16 rounding drops set to each tie / near-tie case, finite values only."""
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    top = np.arange(2**19, dtype=np.uint32) << np.uint32(13)  # sign, exponent, 10 mantissa bits
    low = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF], np.uint32)
    grid = (top[:, None] | low[None, :]).ravel()
    x = np.concatenate([rand, grid]).view(np.float32)
    return np.ascontiguousarray(x[np.isfinite(x)])


def test_f32_to_f16_rows_equals_torch_half_and_the_scalar_function():
    x = _finite_f32_probes()
    got = np.empty(x.size, np.uint16)
    f32_to_f16_bits_rows(x, got, np.empty(x.size, np.float32))
    want = torch.from_numpy(x.copy()).half().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, want)
    sample = x.view(np.uint32)[:: 997]
    scalar = np.array([f32_bits_to_f16_bits(int(u)) for u in sample], np.uint16)
    assert np.array_equal(got[:: 997], scalar)


def test_f16_rows_to_f32_every_pattern():
    h = np.arange(2**16, dtype=np.uint16)
    got = np.empty(h.size, np.float32)
    f16_bits_to_f32_rows(h, got)
    want = torch.from_numpy(h.view(np.int16).copy()).view(torch.float16).float().numpy()
    finite = np.isfinite(want)
    assert np.array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])
    assert np.array_equal(np.isinf(got), np.isinf(want))  # with the sign: checked next
    assert np.array_equal(np.signbit(got[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))
    assert np.isnan(got[np.isnan(want)]).all()
    scalar = np.array([f16_bits_to_f32_bits(int(v)) for v in h[finite][:: 61]], np.uint32)
    assert np.array_equal(got.view(np.uint32)[finite][:: 61], scalar)
