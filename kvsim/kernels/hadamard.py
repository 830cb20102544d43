"""Orthonormal Walsh-Hadamard transform along the last dim, pure-torch reference.

H_d (d a power of two) with entries +-1/sqrt(d) is symmetric and orthogonal, so it is its
own inverse: hadamard(hadamard(x)) == x. Used by OScaR's rotation of keys/values per head
(x: [..., head_dim]) and as a preconditioner for other codecs. The Triton kernel lives in
hadamard_triton.py and is tested against this reference.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvsim.core.lazy_module import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def check_hadamard_dim(d: int) -> None:
    if not is_power_of_two(d):
        raise ValueError(
            f"Hadamard rotation needs a power-of-two head_dim, got {d}; "
            f"pad head_dim to {1 << (d - 1).bit_length()} or choose a codec without rotation"
        )


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x: [..., d] float -> [..., d] float32, orthonormal fast Walsh-Hadamard transform."""
    d = x.shape[-1]
    check_hadamard_dim(d)
    y = x.to(torch.float32).reshape(-1, d)
    h = 1
    while h < d:
        # butterflies on pairs (i, i+h) within blocks of 2h: y viewed as [n, d/2h, 2, h]
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / math.sqrt(d))).to(torch.float32)
