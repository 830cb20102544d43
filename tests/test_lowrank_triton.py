"""GEAR's low-rank fit as a Triton kernel (kvsim.kernels.kivi.lowrank_triton) against its
reference, lowrank.low_rank, bit for bit (under TRITON_INTERPRET=1 here; compiled for sm_90
by tests/test_triton_build.py)."""

from __future__ import annotations

import pytest
import torch

from kvsim.kernels.codec import CodecError
from kvsim.kernels.kivi.lowrank import low_rank, low_rank_start


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and 0.0 apart


@pytest.mark.parametrize("n,q,d,rank,iters", [
    (5, 16, 8, 3, 2),  # matrices not a multiple of the program's
    (6, 40, 16, 4, 3),  # q not a power of two
    (3, 2, 16, 4, 3),  # q < rank: r = q
    (2, 8, 8, 8, 1),  # r = q = d
])
def test_triton_fit_gives_the_reference_bits(n, q, d, rank, iters, kernel_device):
    from kvsim.kernels.kivi.lowrank_triton import low_rank_device

    g = torch.Generator().manual_seed(n * q + d)
    e = torch.randn(n, q, d, generator=g) * torch.logspace(-3, 3, n).view(n, 1, 1)
    e[0, :, 1] = 0.0  # a zero column
    e[-1] = 0.0  # a zero matrix: its factors stay zero
    e[1, 0, 0] = -0.0
    r = min(rank, q, d)
    a, b = low_rank_device(e.to(kernel_device), rank, iters, low_rank_start(d, r, 7))
    ra, rb = low_rank(e, rank, iters, 7)
    assert a.shape == ra.shape and b.shape == rb.shape
    assert torch.equal(bits(a.cpu()), bits(ra)) and torch.equal(bits(b.cpu()), bits(rb))
    assert not b[-1].any()


def test_triton_fit_refuses_what_it_cannot_fit(kernel_device):
    from kvsim.kernels.kivi.lowrank_triton import low_rank_device

    e = torch.zeros(2, 8, 4, device=kernel_device)
    with pytest.raises(ValueError, match="b0"):
        low_rank_device(e, 4, 1, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="fp32"):
        low_rank_device(e.double(), 4, 1, torch.zeros(4, 4))
    a, b = low_rank_device(e[:0], 4, 1, torch.zeros(4, 4))  # no matrices
    assert a.shape == (0, 8, 4) and b.shape == (0, 4, 4)


def test_triton_fit_needs_a_kernel_device(monkeypatch):
    from kvsim.kernels.kivi import lowrank_triton

    monkeypatch.setattr("kvsim.kernels.triton_support.interpreting", lambda: False)
    with pytest.raises(CodecError, match="CUDA tensor"):
        lowrank_triton.low_rank_device(torch.zeros(1, 4, 4), 2, 1, torch.zeros(4, 2))


@pytest.mark.gpu
def test_compiled_triton_fit_gives_the_reference_bits_at_gears_default_page():
    """Compiled on a GPU: 256-token pages x head_dim 128, rank 4, 3 iterations (and a short
    page), against the reference on the CPU."""
    from kvsim.kernels.kivi.lowrank_triton import low_rank_device

    g = torch.Generator().manual_seed(3)
    for q in (256, 40):
        e = torch.randn(9, q, 128, generator=g)
        a, b = low_rank_device(e.cuda(), 4, 3, low_rank_start(128, 4, 0))
        ra, rb = low_rank(e, 4, 3, 0)
        assert torch.equal(bits(a.cpu()), bits(ra)) and torch.equal(bits(b.cpu()), bits(rb))
