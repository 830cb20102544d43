"""kivi (per-channel K in token groups, per-token V, bf16 recent window) and kcvt."""

from __future__ import annotations

import pytest
import torch
from codec_checks import wire_round_trip
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import CodecError, make_codec
from kvsim.kernels.encoded import Encoded
from kvsim.kernels.kivi.codec import Backbone


def outlier_kv(shape: KVShape, seed: int = 0) -> torch.Tensor:
    """Keys with two large-magnitude channels (per-channel structure), plain values."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape.dims, generator=g)
    kv[:, 0, :, :, 1] = kv[:, 0, :, :, 1] * 2 + 15.0
    kv[:, 0, :, :, 5] *= 10
    return kv.to(getattr(torch, shape.dtype))


def rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b) ** 2).sum() / (a**2).sum())


@pytest.mark.parametrize("tokens,expect", [(1, 0), (128, 0), (159, 0), (160, 32), (1000, 864),
                                           (1030, 896)])
def test_window_rule(tokens, expect):
    bb = Backbone(2, 32, 32, 128)
    assert bb.quantized_tokens(tokens) == expect
    # = the last R + (T - R) mod G tokens stay bf16 when T >= R
    if tokens >= 128:
        assert tokens - expect == 128 + (tokens - 128) % 32
    assert Backbone(4, 0, 0, 20).quantized_tokens(tokens) == max(0, tokens - 20)


@pytest.mark.parametrize("name,params", [("kivi", {"group": 8, "residual": 16, "page_tokens": 24}),
                                         ("kivi", {"bits": 4, "group": 4, "residual": 0,
                                                   "value_group": 0, "page_tokens": 8}),
                                         ("kcvt", {"residual": 5, "page_tokens": 16}),
                                         ("kcvt", {"bits": 2, "page_tokens": 7})])
@pytest.mark.parametrize("tokens", [1, 7, 29, 61])
def test_sizes_exact_and_window_lossless(name, params, tokens):
    shape = KVShape(2, 2, tokens, 16, "bfloat16")
    kv = outlier_kv(shape, tokens)
    codec = make_codec(name, params)
    _, out = wire_round_trip(codec, kv)
    assert torch.isfinite(out).all()
    tq = codec.backbone().quantized_tokens(tokens)
    assert torch.equal(out[:, :, :, tq:], kv[:, :, :, tq:])  # bf16 window is exact


def test_kivi_4_beats_2_and_per_channel_beats_per_token_on_keys():
    shape = KVShape(2, 2, 320, 64)
    kv = outlier_kv(shape)
    k2 = make_codec("kivi", {"bits": 2, "residual": 0})
    k4 = make_codec("kivi", {"bits": 4, "residual": 0})
    e2 = rel_mse(kv, k2.decode(k2.encode(kv)))
    e4 = rel_mse(kv, k4.decode(k4.encode(kv)))
    assert e4 < e2 / 8
    u2 = make_codec("uniform", {"bits": 2, "group": 32})
    uk = rel_mse(kv[:, 0], u2.decode(u2.encode(kv))[:, 0])
    kk = rel_mse(kv[:, 0], k2.decode(k2.encode(kv))[:, 0])
    assert kk < uk / 2  # per-channel key groups absorb the outlier channels


def test_kcvt_one_key_scale_per_channel_in_page_zero():
    shape = KVShape(1, 2, 600, 32)
    codec = make_codec("kcvt", {"residual": 20})
    for page in range(codec.num_pages(shape)):
        f = {x.name: x for x in codec.layout(shape, page).fields}
        assert f["k_scale"].shape == ((2, 32, 1) if page == 0 else (2, 32, 0))
        assert f["v_scale"].shape[-1] == 1  # per-token, whole head_dim
    kv = outlier_kv(shape)
    out = codec.decode(codec.encode(kv))
    assert rel_mse(kv, out) < 0.01


@pytest.mark.parametrize("fill", [0.0, 3.5])
def test_constant_input_no_nan(fill):
    kv = torch.full((1, 2, 2, 70, 32), fill, dtype=torch.float16)
    for name in ("kivi", "kcvt"):
        codec = make_codec(name, {"residual": 0} if name == "kcvt" else {"residual": 0})
        out = codec.decode(codec.encode(kv))
        assert torch.equal(out, kv)


def test_bad_params_and_shapes():
    with pytest.raises(CodecError, match="multiples of group"):
        make_codec("kivi", {"residual": 100})
    with pytest.raises(ValueError, match="value_group"):
        make_codec("kivi", {"value_group": 48}).encode(torch.zeros(1, 2, 1, 4, 64))

SMALL_PAGE = {"uniform": {"bits": 4, "group": 8, "page_tokens": 13},
              "kivi": {"group": 4, "residual": 8, "page_tokens": 12},
              "kcvt": {"residual": 3, "page_tokens": 10},
              "gear": {"group": 4, "residual": 4, "page_tokens": 8, "rank": 3},
              "gear-l": {"backbone": "kcvt", "residual": 2, "page_tokens": 9},
              "oscar": {"group": 4, "residual": 4, "page_tokens": 16}}


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(SMALL_PAGE)), layers=st.integers(1, 2),
       heads=st.integers(1, 3), tokens=st.integers(1, 50), head_dim=st.sampled_from([8, 16, 32]),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]), seed=st.integers(0, 99))
def test_property_sizes_exact_from_shape(name, layers, heads, tokens, head_dim, dtype, seed):
    shape = KVShape(layers, heads, tokens, head_dim, dtype)
    codec = make_codec(name, SMALL_PAGE[name])
    kv = outlier_kv(shape, seed)
    blob = codec.encode(kv).to_bytes()
    assert len(blob) == codec.size_table(shape).total_bytes
    out = codec.decode(Encoded.from_bytes(blob))
    assert torch.isfinite(out).all()


# ---- window 'kivi': KIVI's code keeps T mod R keys and R values in bf16 ---------------------
@pytest.mark.parametrize("tokens", [5, 8, 13, 16, 27, 40])
def test_kivi_window_rule_exact(tokens):
    g = torch.Generator().manual_seed(tokens)
    kv = torch.randn(2, 2, 3, tokens, 16, generator=g)
    exact = kv.to(torch.bfloat16).to(torch.float32)
    params = {"bits": 2, "group": 4, "value_group": 8, "residual": 8, "page_tokens": 8,
              "window": "kivi"}
    outs, payloads = [], []
    for backend in ("torch", "cpu"):
        codec = make_codec("kivi", {**params, "backend": backend})
        enc, out = wire_round_trip(codec, kv)
        outs.append(out)
        payloads.append([c.payload.tobytes() for c in enc.streams[0]])
    assert payloads[0] == payloads[1] and torch.equal(outs[0], outs[1])
    out = outs[0]
    nk, nv = tokens // 8 * 8, max(0, tokens - 8)  # quantized K / V tokens
    assert torch.equal(out[:, 0, :, nk:], exact[:, 0, :, nk:])  # T mod R keys in bf16
    assert torch.equal(out[:, 1, :, nv:], exact[:, 1, :, nv:])  # R values in bf16
    if nk:
        assert not torch.equal(out[:, 0, :, nk - 4:nk], exact[:, 0, :, nk - 4:nk])
    if nv:
        assert not torch.equal(out[:, 1, :, nv - 1], exact[:, 1, :, nv - 1])


def test_kivi_window_checked():
    with pytest.raises(ValueError, match="window"):
        make_codec("kivi", {"window": "recent"})
    with pytest.raises(ValueError, match="residual >= 1"):
        make_codec("kivi", {"window": "kivi", "residual": 0})
