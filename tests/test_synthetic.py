from __future__ import annotations

import math

import pytest
import torch

from kvsim.core.layout import K, KVShape, V
from kvsim.kv.synthetic import SyntheticKVParams, _ar1, generate_kv, generate_queries

SHAPE = KVShape(layers=3, kv_heads=2, tokens=96, head_dim=32, dtype="float32")


def test_shape_dtype_and_determinism():
    a = generate_kv(SHAPE, seed=7)
    b = generate_kv(SHAPE, seed=7)
    c = generate_kv(SHAPE, seed=8)
    assert a.shape == SHAPE.dims and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.isfinite(a).all()
    for dtype in ("bfloat16", "float16"):
        kv = generate_kv(KVShape(2, 1, 5, 8, dtype), seed=0)
        assert kv.dtype == getattr(torch, dtype) and kv.shape == (2, 2, 1, 5, 8)


def test_outlier_channels_visible_in_keys_not_values():
    params = SyntheticKVParams(rope=False, k_outlier_channel_fraction=0.125,
                               k_outlier_magnitude=10.0, sink_tokens=0)
    kv = generate_kv(SHAPE, params, seed=1)
    for layer in range(SHAPE.layers):
        for head in range(SHAPE.kv_heads):
            k_absmax = kv[layer, K, head].abs().amax(dim=0)  # [head_dim]
            top = k_absmax.sort(descending=True).values
            n_out = round(0.125 * SHAPE.head_dim)  # 4 outlier channels
            # outliers are ~10x the ordinary channels
            assert top[:n_out].min() > 3 * top[n_out:].median()
            v_absmax = kv[layer, V, head].abs().amax(dim=0)
            assert v_absmax.max() < 3 * v_absmax.median()


def test_sink_keys_have_small_norms():
    params = SyntheticKVParams(sink_tokens=3, sink_key_norm_ratio=0.05)
    kv = generate_kv(SHAPE, params, seed=2)
    norms = kv[:, K].norm(dim=-1)  # [layers, heads, tokens]
    sink = norms[..., :3]
    median_rest = norms[..., 3:].median(dim=-1).values
    ratio = sink / median_rest[..., None]
    assert torch.allclose(ratio, torch.full_like(ratio, 0.05), rtol=1e-4)


def test_layer_scale_profile():
    params = SyntheticKVParams(layer_scale_first=0.25, layer_scale_last=4.0, sink_tokens=0)
    kv = generate_kv(KVShape(5, 2, 256, 32, "float32"), params, seed=3)
    v_std = kv[:, V].std(dim=(1, 2, 3))  # [layers]
    assert torch.all(v_std[1:] > v_std[:-1])
    assert 8 < float(v_std[-1] / v_std[0]) < 32  # 16x by construction


def test_ar1_is_stationary_with_requested_lag1_correlation():
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(64, 2000, 4, generator=gen, dtype=torch.float64)
    for rho in (0.0, 0.5, 0.95):
        x = _ar1(noise, rho)
        assert abs(float(x.var()) - 1.0) < 0.08
        lag1 = float((x[:, 1:] * x[:, :-1]).mean() / x.var())
        assert abs(lag1 - rho) < 0.03
        # no drift across block boundaries: first and last quarter have the same variance
        assert abs(float(x[:, :500].var() - x[:, -500:].var())) < 0.15


def test_params_json_round_trip(tmp_path):
    params = SyntheticKVParams(k_outlier_magnitude=20.0, sink_tokens=2, rope=False)
    assert SyntheticKVParams.from_dict(params.to_dict()) == params
    path = params.save(tmp_path / "p.json")
    assert SyntheticKVParams.load(path) == params
    with pytest.raises(ValueError, match="unknown field"):
        SyntheticKVParams.from_dict({"k_scales": 1.0})
    with pytest.raises(ValueError, match="sink_key_norm_ratio"):
        SyntheticKVParams(sink_key_norm_ratio=0.0)
    with pytest.raises(ValueError, match="k_token_correlation"):
        SyntheticKVParams(k_token_correlation=1.0)


def test_queries_shape_determinism_and_peaked_attention():
    kv = generate_kv(SHAPE, seed=4)
    q = generate_queries(kv, q_heads=4, q_tokens=6, seed=5)
    assert q.shape == (SHAPE.layers, 4, 6, SHAPE.head_dim) and q.dtype == torch.float32
    assert torch.equal(q, generate_queries(kv, q_heads=4, q_tokens=6, seed=5))
    group = 4 // SHAPE.kv_heads
    keys = kv[:, K].float().repeat_interleave(group, dim=1)  # [L, Hq, T, D]
    logits = torch.einsum("lhqd,lhtd->lhqt", q, keys) / math.sqrt(SHAPE.head_dim)
    probs = logits.softmax(dim=-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    # far from uniform (log 96 = 4.56 nats), but not a one-hot either
    assert float(entropy.mean()) < 0.75 * math.log(SHAPE.tokens)
    assert float(probs.amax(-1).mean()) < 0.99
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        generate_queries(kv, q_heads=3, q_tokens=1)
