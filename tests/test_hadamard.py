"""Triton FWHT kernel vs the torch reference (hadamard.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kvsim.kernels import hadamard as ref
from kvsim.kernels import hadamard_triton as ht


def fp32_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-row bound on |kernel - reference|: each output is a +-sum of d inputs formed by
    log2(d) levels of fp32 additions, each adding <= 2^-24 relative error of partial sums
    bounded by the row's L1 norm, then one scaling by 1/sqrt(d); both sides carry it, so
    twice that, plus one ulp of slack."""
    d = x.shape[-1]
    l1 = x.float().abs().sum(-1, keepdim=True)
    return 2 * (math.log2(d) + 1) * 2.0**-24 * l1 / math.sqrt(d) + 1e-30


@pytest.mark.parametrize("d", [2, 4, 16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference(d, dtype, kernel_device):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(3, 7, d, generator=g) * 5).to(dtype)  # 21 rows: not a block multiple
    want = ref.hadamard(x)
    got = ht.hadamard(x.to(kernel_device)).cpu()
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert ((got - want).abs() <= fp32_bound(x)).all()


def test_kernel_is_orthonormal_involution(kernel_device):
    x = torch.randn(5, 32)
    y = ht.hadamard(ht.hadamard(x.to(kernel_device))).cpu()
    assert torch.allclose(y, x, atol=1e-5)
    assert torch.allclose(ht.hadamard(x.to(kernel_device)).cpu().norm(dim=-1), x.norm(dim=-1),
                          rtol=1e-5)


def test_non_power_of_two_is_a_clear_error():
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        ht.hadamard(torch.zeros(2, 96))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_kernel_matches_reference(d):
    x = torch.randn(4, 8, 1001, d).to(torch.bfloat16)
    got = ht.hadamard(x.cuda()).cpu()
    assert ((got - ref.hadamard(x)).abs() <= fp32_bound(x)).all()
