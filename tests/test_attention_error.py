from __future__ import annotations

import math

import pytest
import torch

from kvsim.core.layout import K, V
from kvsim.kv.attention_error import (
    attention_output,
    attention_vnmse,
    relative_mse,
    vnmse_from_outputs,
)


def _setup(layers=2, kv_heads=2, tokens=40, head_dim=16, q_heads=6, q_tokens=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, kv_heads, tokens, head_dim, generator=gen)
    q = torch.randn(layers, q_heads, q_tokens, head_dim, generator=gen)
    return q, kv


def test_identity_is_zero():
    q, kv = _setup()
    assert attention_vnmse(q, kv, kv.clone()).tolist() == [0.0, 0.0]
    assert relative_mse(kv, kv.clone()) == 0.0


def test_matches_explicit_repeat_reference():
    q, kv = _setup()
    group = q.shape[1] // kv.shape[2]
    k = kv[:, K].repeat_interleave(group, dim=1)  # [L, Hq, T, D]
    v = kv[:, V].repeat_interleave(group, dim=1)
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    expected = probs @ v
    # a tiny budget forces one query token per slice
    for budget in (1, 1 << 26):
        got = attention_output(q, kv, budget_bytes=budget)
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    noisy = kv + 0.05 * torch.randn_like(kv)
    probs_hat = torch.softmax(q @ noisy[:, K].repeat_interleave(group, 1).transpose(-1, -2)
                              / math.sqrt(q.shape[-1]), dim=-1)
    o_hat = probs_hat @ noisy[:, V].repeat_interleave(group, 1)
    per_token = ((expected - o_hat).square().sum(dim=(1, 3))
                 / expected.square().sum(dim=(1, 3)))  # [L, Tq]
    got = attention_vnmse(q, kv, noisy)
    assert got.shape == (2,)
    assert torch.allclose(torch.from_numpy(got), per_token.mean(1).double(), rtol=1e-4)


def test_scale_invariance_and_monotonicity():
    q, kv = _setup(seed=1)
    noise = torch.randn_like(kv)
    base = attention_vnmse(q, kv, kv + 0.01 * noise)
    # scaling V of both caches by c leaves the relative error unchanged
    kv2, hat2 = kv.clone(), (kv + 0.01 * noise).clone()
    kv2[:, V] *= 7.0
    hat2[:, V] *= 7.0
    assert torch.allclose(torch.from_numpy(attention_vnmse(q, kv2, hat2)),
                          torch.from_numpy(base), rtol=1e-4)
    bigger = attention_vnmse(q, kv, kv + 0.1 * noise)
    assert (bigger > base).all() and (base > 0).all()
    assert math.isclose(relative_mse(3 * kv, 3 * (kv + 0.01 * noise)),
                        relative_mse(kv, kv + 0.01 * noise), rel_tol=1e-6)
    assert math.isclose(relative_mse(kv, torch.zeros_like(kv)), 1.0)


def test_dtypes_and_normalization_option():
    q, kv = _setup(seed=2)
    hat = (kv + 0.02 * torch.randn_like(kv)).to(torch.bfloat16)
    ref = attention_vnmse(q, kv.to(torch.bfloat16), hat)
    comp = attention_vnmse(q, kv.to(torch.bfloat16), hat, normalize_by="compressed")
    assert (ref > 0).all() and torch.allclose(torch.from_numpy(ref), torch.from_numpy(comp),
                                              rtol=0.1)


def test_zero_outputs_and_bad_input():
    q, kv = _setup()
    zero = torch.zeros_like(kv)
    assert attention_vnmse(q, zero, zero).tolist() == [0.0, 0.0]
    o = torch.zeros(1, 2, 3, 4)
    assert vnmse_from_outputs(o, o + 1).tolist() == [math.inf]
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        attention_vnmse(q[:, :3], kv, kv)
    with pytest.raises(ValueError, match="differ in shape"):
        attention_vnmse(q, kv, kv[:, :, :, :10])
    with pytest.raises(ValueError, match="do not match"):
        attention_output(q[..., :8], kv)
