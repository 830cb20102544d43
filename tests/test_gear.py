"""gear / gear-l: backbone + low-rank residual (+ fp16 outliers), exact sizes."""

from __future__ import annotations

import pytest
import torch
from codec_checks import wire_round_trip

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import CodecError, make_codec
from kvsim.kernels.kivi.lowrank import fit_fp16, low_rank
from kvsim.kernels.kivi.outliers import outliers_per_side, split_outliers


def structured_kv(shape: KVShape, seed: int = 0) -> torch.Tensor:
    """Low-rank-ish KV (a few shared directions + noise) with outlier key channels."""
    g = torch.Generator().manual_seed(seed)
    lead = (shape.layers, 2, shape.kv_heads)
    basis = torch.randn(*lead, 6, shape.head_dim, generator=g)
    coef = torch.randn(*lead, shape.tokens, 6, generator=g)
    kv = coef @ basis + 0.3 * torch.randn(shape.dims, generator=g)
    kv[:, 0, :, :, 2] += 12.0
    kv[:, 0, :, :, 9] *= 6
    spikes = torch.rand(shape.dims, generator=g) < 0.003
    kv = torch.where(spikes, kv * 8, kv)
    return kv.to(getattr(torch, shape.dtype))


def rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b) ** 2).sum() / (a**2).sum())


def test_outlier_count_is_exact_rational():
    assert outliers_per_side(100, 2.0) == 1  # 2/200*100 = 1 exactly, no float ceil drift
    assert outliers_per_side(256, 2.0) == 3  # 2.56 -> 3
    assert outliers_per_side(128, 2.0) == 2
    assert outliers_per_side(3, 50.0) == 1  # capped at (n-1)//2
    assert outliers_per_side(1, 10.0) == 0
    assert outliers_per_side(64, 0.0) == 0


def test_split_outliers_removes_extremes():
    x = torch.tensor([[0.5, 9.0, -1.0, 0.2, -7.0, 0.1, 3.0]])
    filled, idx, vals = split_outliers(x, 1)
    assert sorted(idx[0].tolist()) == [1, 4]
    assert sorted(vals[0].tolist()) == [-7.0, 9.0]
    assert filled[0, 1] == 0.0 and filled[0, 4] == 0.0  # 0 lies within the remaining range
    assert filled.max() == 3.0 and filled.min() == -1.0


def test_low_rank_recovers_rank_two_and_is_deterministic():
    g = torch.Generator().manual_seed(1)
    e = torch.randn(3, 40, 2, generator=g) @ torch.randn(3, 2, 16, generator=g)
    a, b = low_rank(e, 2, 3, seed=7)
    assert torch.allclose(a @ b.transpose(-1, -2), e, atol=1e-4)
    a2, b2 = low_rank(e, 2, 3, seed=7)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    a0, b0 = low_rank(torch.zeros(2, 5, 8), 4, 2, seed=0)
    assert torch.isfinite(a0).all()
    assert torch.equal(a0 @ b0.transpose(-1, -2), torch.zeros(2, 5, 8))


@pytest.mark.parametrize("backbone,bits", [("kivi", 2), ("kcvt", 4)])
def test_gear_beats_gear_l_beats_backbone(backbone, bits):
    shape = KVShape(2, 2, 400, 64)
    kv = structured_kv(shape)
    common = {"bits": bits, "residual": 0 if backbone == "kcvt" else 32}
    base = make_codec(backbone, common if backbone == "kcvt" else {**common})
    errs = {"base": rel_mse(kv, base.decode(base.encode(kv)))}
    for name in ("gear-l", "gear"):
        c = make_codec(name, {"backbone": backbone, **common})
        errs[name] = rel_mse(kv, c.decode(c.encode(kv)))
    assert errs["gear"] < errs["gear-l"] < errs["base"]
    assert errs["gear-l"] < 0.9 * errs["base"]


@pytest.mark.parametrize("name", ["gear", "gear-l"])
@pytest.mark.parametrize("params", [{"page_tokens": 32, "group": 8, "residual": 16},
                                    {"backbone": "kcvt", "bits": 4, "residual": 3,
                                     "page_tokens": 300},  # u16 token indices
                                    {"rank": 8, "group": 4, "residual": 0, "page_tokens": 4}])
@pytest.mark.parametrize("tokens", [1, 9, 45])
def test_sizes_exact_irregular(name, params, tokens):
    shape = KVShape(2, 3, tokens, 16, "float16")
    kv = structured_kv(shape, tokens)
    codec = make_codec(name, params)
    enc, out = wire_round_trip(codec, kv)
    assert torch.isfinite(out).all()
    assert codec.encode(kv).to_bytes() == enc.to_bytes()  # deterministic


def test_outliers_restored_to_fp16_precision():
    shape = KVShape(1, 2, 256, 32)
    kv = structured_kv(shape)
    codec = make_codec("gear", {"residual": 0})
    out = codec.decode(codec.encode(kv))
    k = kv[0, 0].float()  # [heads, tokens, d]
    top = k.argmax(dim=1, keepdim=True)  # the largest entry of each channel is an outlier
    want = k.gather(1, top).half().float()
    assert torch.equal(out[0, 0].float().gather(1, top), want)


def test_bad_params():
    with pytest.raises(CodecError, match="backbone"):
        make_codec("gear", {"backbone": "int4"})
    with pytest.raises(CodecError, match="multiples of group"):
        make_codec("gear-l", {"residual": 20})


@pytest.mark.parametrize("field", ["ko_idx", "vo_idx"])
def test_outlier_index_out_of_range_is_codec_error(field):
    """An outlier index past its vector (token >= q, channel >= head_dim) is refused before
    the scatter that would use it."""
    codec = make_codec("gear", {"outlier_pct": 10.0})
    shape = KVShape(1, 2, 300, 32)
    enc = codec.encode(structured_kv(shape))
    lay = codec.layout(shape, 0)
    at = lay.offsets()[field]
    enc.streams[0][0].payload = enc.streams[0][0].payload.copy()
    enc.streams[0][0].payload[at] = 255 if field == "ko_idx" else 32
    if field == "ko_idx":  # u8 indices of page 0's 172 quantized tokens
        assert 255 >= codec.backbone().split(shape, 256, 0)[1]
    with pytest.raises(CodecError, match=f"page 0.*{field} holds index"):
        codec.decode(enc)


def test_low_rank_factors_fit_fp16_on_extreme_inputs():
    """fp16 inputs at +-65504 (accepted by the range check) make the 2-bit residual large:
    B = E^T A would overflow fp16; a power of two moves to A instead, product unchanged."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(1, 2, 2, 300, 32, generator=g)
    kv = torch.where(torch.rand(kv.shape, generator=g) < 0.5, -65504.0, 65504.0) * (kv > 0)
    kv = kv.to(torch.float16)
    for name in ("gear", "gear-l"):
        codec = make_codec(name)
        enc = codec.encode(kv)
        f = codec.layout(enc.shape, 0).parse(enc.streams[0][0].payload, torch.device("cpu"))
        assert torch.isfinite(f["lr_a"]).all() and torch.isfinite(f["lr_b"]).all()
        out = codec.decode(enc)
        assert torch.isfinite(out).all()
        assert rel_mse(kv, out) < rel_mse(kv, make_codec("kivi").decode(
            make_codec("kivi").encode(kv)))


def test_fit_fp16_leaves_fitting_factors_alone():
    a = torch.randn(3, 20, 2)
    b = torch.randn(3, 8, 2) * 1000
    a[0, 0, 0] = -0.0
    a2, b2 = fit_fp16(a, b)  # the same bits (x 1 and / 1)
    assert torch.equal(a2.view(torch.int32), a.view(torch.int32))
    assert torch.equal(b2.view(torch.int32), b.view(torch.int32))
    b[1, 3, 0] = 1e6  # one column overflows: only that column moves, by a power of two
    a2, b2 = fit_fp16(a, b)
    c = a2[1, 0, 0] / a[1, 0, 0]
    assert float(torch.log2(c)) == int(torch.log2(c)) and float(b2.abs().max()) <= 32768
    assert torch.equal(a2[:, :, 1], a[:, :, 1]) and torch.equal(a2[0], a[0])
    torch.testing.assert_close(a2 @ b2.transpose(-1, -2), a @ b.transpose(-1, -2))


def test_fit_fp16_finds_its_power_of_two_exactly():
    """k = ceil(log2(peak / 32768)) from the exponent bits: a peak a few ulps above 2^19 needs
    k = 5 (a log2 rounded to 4.0 gave k = 4 and |b| just above 32768), a power of two itself
    k one less."""
    for peak, k in ((2.0 ** 19, 4), (float(torch.nextafter(torch.tensor(2.0 ** 19),
                                                           torch.tensor(2.0 ** 20))), 5),
                    (65520.0, 1), (1e6, 5)):
        a, b = torch.ones(1, 2, 1), torch.full((1, 3, 1), peak)
        a2, b2 = fit_fp16(a, b)
        assert float(a2[0, 0, 0]) == 2.0 ** k and float(b2.abs().max()) <= 32768


# ---- lowrank 'sequence': one fit per (layer, K|V, head) over every quantized token -----------
@pytest.mark.parametrize("name", ["gear", "gear-l"])
def test_sequence_lowrank_one_b_per_layer_and_same_sizes(name):
    shape = KVShape(2, 2, 70, 16, "float32")
    kv = structured_kv(shape, 4)
    params = {"group": 4, "value_group": 4, "residual": 8, "page_tokens": 16, "rank": 2,
              "outlier_pct": 20.0}
    seq = make_codec(name, {**params, "lowrank": "sequence"})
    page = make_codec(name, {**params, "lowrank": "page"})
    enc, out = wire_round_trip(seq, kv)
    # B is carried in every chunk, as the per-page B is: the same bytes per chunk
    assert (seq.payload_bytes(shape) == page.payload_bytes(shape)).all()
    kivi = make_codec("kivi", {k: params[k] for k in ("group", "value_group", "residual",
                                                      "page_tokens")})
    assert rel_mse(kv, out) < rel_mse(kv, kivi.decode(kivi.encode(kv)))
    tq = 60  # floor((70 - 8) / 4) * 4 quantized tokens: pages 0-2 full, page 3 has 12
    assert seq.rank_of(shape, 16) == 2 and seq.rank_of(shape, 0) == 0
    for layer in range(shape.layers):
        fields = [seq.layout(shape, p).parse(enc.payloads(0)[(layer, p)], torch.device("cpu"))
                  for p in range(seq.num_pages(shape))]
        live = [f for f in fields if f["lr_a"].shape[2]]
        assert sum(f["lr_a"].shape[2] for f in live) == tq
        assert all(torch.equal(f["lr_b"], live[0]["lr_b"]) for f in live)
        # the factors stacked over pages are one fit of the whole sequence: A has
        # orthonormal columns (fp16-rounded) over all Tq tokens, not page by page
        a = torch.cat([f["lr_a"].float() for f in live], dim=2)  # [2, heads, Tq, r]
        gram = a.transpose(-1, -2) @ a
        assert torch.allclose(gram, torch.eye(2).expand_as(gram), atol=2e-2)


def test_sequence_lowrank_backends_same_bytes():
    kv = structured_kv(KVShape(1, 2, 45, 16, "bfloat16"), 2)
    params = {"group": 4, "value_group": 4, "residual": 4, "page_tokens": 8, "rank": 2,
              "lowrank": "sequence"}
    a = make_codec("gear", {**params, "backend": "torch"}).encode(kv)
    b = make_codec("gear", {**params, "backend": "cpu"}).encode(kv)
    assert [c.payload.tobytes() for c in a.streams[0]] == [c.payload.tobytes()
                                                          for c in b.streams[0]]


def test_lowrank_scope_checked():
    with pytest.raises(ValueError, match="lowrank"):
        make_codec("gear", {"lowrank": "layer"})


# ---- outlier_count 'exact': s % of the entries of each head-page ----------------------------
def test_exact_schedule_keeps_s_percent():
    from kvsim.kernels.kivi.outliers import outlier_schedule

    # 2 % of a 256-token page x 64 channels: 163.84 per side -> 163 (ceil keeps 3 x 64 = 192)
    assert int(outlier_schedule(256, 64, 2.0, True).sum()) == 163
    assert int(outlier_schedule(64, 256, 2.0, True).sum()) == 163  # ceil: 1 x 256
    assert int(outlier_schedule(256, 64, 2.0, False).sum()) == 192
    counts = outlier_schedule(64, 256, 2.0, True)
    assert set(counts.tolist()) == {0, 1}  # spread as evenly as floor allows
    assert outlier_schedule(3, 5, 90.0, True).max() == 1  # capped at (n - 1) // 2


def test_exact_equals_ceil_when_counts_are_whole():
    """25 % of 8 tokens and of 16 channels: every vector keeps 1 / 2 per side both ways, so
    the ragged layout must give the bytes of the per-vector one."""
    kv = structured_kv(KVShape(2, 2, 37, 16, "float32"), 3)
    params = {"group": 4, "value_group": 4, "residual": 4, "page_tokens": 8, "rank": 2,
              "outlier_pct": 25.0}
    a = make_codec("gear", {**params, "outlier_count": "ceil"}).encode(kv)
    b = make_codec("gear", {**params, "outlier_count": "exact"}).encode(kv)
    assert [c.payload.tobytes() for c in a.streams[0]] == [c.payload.tobytes()
                                                          for c in b.streams[0]]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_exact_outliers_restored_and_sized(backend):
    shape = KVShape(1, 2, 70, 16, "float32")
    kv = structured_kv(shape, 5)
    codec = make_codec("gear", {"group": 4, "value_group": 4, "residual": 4, "page_tokens": 16,
                                "rank": 2, "outlier_pct": 15.0, "outlier_count": "exact",
                                "backend": backend})
    enc, out = wire_round_trip(codec, kv)
    f = codec.layout(shape, 0).parse(enc.payloads(0)[(0, 0)], torch.device("cpu"))
    # 15 % of 16 x 16 entries of K (and of V) of each head: floor(19.2) per side
    assert f["ko_idx"].shape == (2, 38) and f["vo_idx"].shape == (2, 38)
    from kvsim.kernels.kivi.outliers import outlier_schedule, ragged_vectors

    vec = ragged_vectors(outlier_schedule(16, 16, 15.0, True))
    k = out[0, 0, :, :16].transpose(-1, -2)  # [heads, d, q] of page 0
    for h in range(2):  # outlier j of head h sits at (channel vec[j], token ko_idx[h, j])
        assert torch.equal(k[h][vec, f["ko_idx"][h].long()], f["ko_val"][h].float())


@pytest.mark.parametrize("name, params, tokens, scale", [
    ("gear", {"outlier_count": "exact", "page_tokens": 8, "rank": 3, "residual": 4,
              "group": 4, "value_group": 4}, 31, 1.0),
    ("gear", {"page_tokens": 64, "rank": 2, "residual": 0, "group": 8, "value_group": 8},
     150, 6e4),  # large errors: fit_fp16 moves powers of two between the factors
    ("gear-l", {"backbone": "kcvt", "bits": 4, "page_tokens": 5, "rank": 4, "residual": 1},
     13, 1.0),  # a last page shorter than the rank
])
def test_batched_page_fits_equal_one_fit_per_page(name, params, tokens, scale):
    """post_quantize fits every page of one length in one low_rank call: each page's factors
    must have the bits of fitting that page alone (low_rank works row by row)."""
    codec = make_codec(name, {**params, "backend": "torch"})
    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(2, 2, 2, tokens, 16, generator=g) * scale).clamp(-65000, 65000)
    shape, p = KVShape.of(kv), codec.params
    bb = codec.tuned_backbone()
    tq = bb.quantized_tokens(tokens)
    xq, state = codec.pre_quantize(kv[:, :, :, :tq], shape)
    _, xhat = bb.quantize(xq, codec.uses_xhat)
    state = codec.post_quantize(state, xq, xhat)
    pages = 0
    for layer in range(shape.layers):
        for t0 in range(0, tq, p.page_tokens):
            q = min(p.page_tokens, tq - t0)
            err = codec.fit_error(state, layer, t0, xq[layer, :, :, t0:t0 + q],
                                  xhat[layer, :, :, t0:t0 + q])
            a, b = fit_fp16(*low_rank(err.reshape(2 * shape.kv_heads, q, 16), p.rank, p.iters,
                                      p.seed))
            got_a, got_b = state[("lowrank", layer, t0)]
            assert torch.equal(got_a.reshape(a.shape).view(torch.int32), a.view(torch.int32))
            assert torch.equal(got_b.reshape(b.shape).view(torch.int32), b.view(torch.int32))
            pages += 1
    assert pages >= 4
