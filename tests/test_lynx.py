"""Tests of the `lynx` codec: code widths (proved), LUT == threshold count, byte accounting,
identical bytes across backends (torch reference vs numba cpu), error bounds, edge cases,
OScaR preconditioning, presets. Triton kernels: tests/test_lynx_triton.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import CodecError, make_codec
from kvsim.kernels.encoded import Encoded
from kvsim.kernels.lynx.codec import LynxCodec
from kvsim.kernels.lynx.format import lynx_tables, make_layout
from kvsim.kernels.lynx.reference import (
    join_fields,
    pack_rows,
    reference_codes,
    split_fields,
    unpack_rows,
)
from kvsim.kernels.presets import load_preset

SPLITS = [(4, 4), (2, 6), (2, 2, 4), (4,), (8,), (3, 5), (2, 2, 2, 2), (2,), (3, 2)]
PRESETS = ["lynx", "lynx-int4", "lynx-int8", "lynx-2+6", "lynx-2+2+4", "lynx-oscar"]


def codec(**params) -> LynxCodec:
    return LynxCodec(params)


def rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b) ** 2).mean() / (b**2).mean())


# ---- the hierarchy: every field fits its width, and it is lossless -------------------------
@pytest.mark.parametrize("split", SPLITS)
def test_fields_fit_and_invert_exhaustively(split):
    """Every (sign, magnitude code) of the M-bit domain: each stream's field fits its b bits,
    prefixes of the streams recover the top bits, all streams recover the code exactly."""
    tab = lynx_tables(4.0, split)
    m = tab.mag_bits
    code = torch.arange(1 << m, dtype=torch.int32).repeat(2)
    neg = torch.arange(2 << m) >= (1 << m)
    fields = split_fields(neg, code, tab)
    for f, b in zip(fields, split, strict=True):
        assert int(f.max()) < (1 << b) and int(f.min()) >= 0
    for s in range(1, len(split) + 1):
        got_neg, prefix = join_fields(fields[:s], tab)
        assert torch.equal(got_neg, neg)
        assert torch.equal(prefix, code >> tab.field_shift(s - 1))
    # residual digits are signed corrections around the centre of the coarser bucket
    for s in range(1, len(split)):
        digit = fields[s].to(torch.int32) ^ (1 << (split[s] - 1))
        signed = digit - (1 << (split[s] - 1))
        assert int(signed.min()) == -(1 << (split[s] - 1))
        assert int(signed.max()) == (1 << (split[s] - 1)) - 1


finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
extremes = st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.4e38, -3.4e38, 65504.0,
                            -65504.0, 1e-8, 1.0, -1.0, 1e30, -1e30])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), split=st.sampled_from(SPLITS))
def test_codes_fit_on_arbitrary_inputs(data, split):
    """Arbitrary finite fp32 inputs, extremes included: the quantizer's magnitude code is in
    [0, 2^M), every stream field fits its width, and metadata / decode stay finite."""
    tokens = data.draw(st.integers(1, 40))
    head_dim = data.draw(st.integers(1, 5))
    vals = data.draw(arrays(np.float32, (1, 2, 1, tokens, head_dim),
                            elements=st.one_of(finite32, extremes)))
    x = torch.from_numpy(vals)
    c = codec(split=list(split), page_tokens=16, chunk_tokens=8, backend="torch")
    lay, tab = make_layout(KVShape.of(x), c.params), c.tables
    rc = reference_codes(x, lay, tab)
    assert int(rc.code.min()) >= 0 and int(rc.code.max()) < (1 << tab.mag_bits)
    for f, b in zip(split_fields(rc.neg, rc.code, tab), split, strict=True):
        assert int(f.max()) < (1 << b)
    assert torch.isfinite(rc.lo).all() and torch.isfinite(rc.sigma.float()).all()
    enc = c.encode(x)
    for s in range(1, len(split) + 1):
        out = c.decode(enc, streams=s)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("alpha", [0.01, 1.0, 4.0, 255.0, 1e4])
@pytest.mark.parametrize("split", [(4, 4), (4,), (2, 2)])
def test_lookup_table_equals_threshold_count(alpha, split):
    """The LUT over fp32 bits (numba / Triton) == bucketize over the thresholds (reference),
    at every threshold, its fp32 neighbours, every cell boundary, 0, 1 and beyond 1."""
    tab = lynx_tables(alpha, split)
    thr = tab.thresholds
    cells = (tab.lut_lo + (np.arange(tab.lut_cells, dtype=np.uint32) << tab.lut_shift))
    cells = cells.astype(np.uint32).view(np.float32)
    probes = np.concatenate([
        thr, np.nextafter(thr, np.float32(0)), np.nextafter(thr, np.float32(2)),
        cells, np.nextafter(cells, np.float32(0)), np.nextafter(cells, np.float32(2)),
        np.float32([0.0, 1e-45, 1e-30, 0.5, 1.0, 1.0001, 1.5, 3.9]),
        np.random.default_rng(0).random(20000).astype(np.float32),
    ]).astype(np.float32)
    probes = probes[np.isfinite(probes) & (probes >= 0)]
    want = np.searchsorted(thr, probes, side="left")  # number of thresholds < u
    off = np.maximum(probes.view(np.uint32).astype(np.int64) - tab.lut_lo, 0)
    cell = np.minimum(off >> tab.lut_shift, tab.lut_cells - 1)
    got = tab.lut_base[cell].astype(np.int64) + (probes > tab.lut_thr[cell])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_rows_roundtrip_and_bit_order(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 13), generator=g, dtype=torch.uint8)
    packed = pack_rows(codes, bits)
    assert packed.shape == (3, -(-13 * bits // 8))
    assert torch.equal(unpack_rows(packed, bits, 13), codes)
    # little-end first: bit i of the row is bit i % 8 of byte i // 8
    stream = [(int(c) >> j) & 1 for c in codes[0] for j in range(bits)]
    row = [(int(packed[0, i // 8]) >> (i % 8)) & 1 for i in range(len(stream))]
    assert row == stream


# ---- byte accounting ---------------------------------------------------------------------
IRREGULAR = [(1, 1, 1, 1), (2, 3, 7, 5), (1, 2, 33, 16), (3, 1, 300, 24), (2, 3, 513, 8),
             (1, 5, 256, 12)]


@pytest.mark.parametrize("dims", IRREGULAR)
@pytest.mark.parametrize("preset", PRESETS)
def test_size_table_equals_serialized_bytes(dims, preset):
    spec = load_preset(preset)
    params = dict(spec.params)
    layers, heads, tokens, head_dim = dims
    if params.get("precondition") == "oscar":
        head_dim = 1 << (head_dim - 1).bit_length()  # oscar needs a power of two
    params.update(page_tokens=64, chunk_tokens=16)
    c = make_codec("lynx", params)
    kv = torch.randn(layers, 2, heads, tokens, head_dim).to(torch.bfloat16)
    enc = c.encode(kv)
    table = c.size_table(enc.shape)
    blob = enc.to_bytes()
    assert table.total_bytes == len(blob)
    np.testing.assert_array_equal(table.chunk_bytes, enc.chunk_bytes())
    assert enc.bits_per_element() == pytest.approx(8 * len(blob) / enc.shape.numel)
    back = Encoded.from_bytes(blob)
    torch.testing.assert_close(c.decode(back), c.decode(enc), rtol=0, atol=0)


def test_payload_bytes_formula_default_page():
    """4+4, page 256 / chunk 32, no oscar: per full page and channel, 4 B lo + 1 B k +
    8 chunks x (2 B mu + 2 B sigma) of metadata, 256 x 4 bits of anchor and of residual."""
    shape = KVShape(2, 8, 1000, 128)
    pb = codec().payload_bytes(shape)
    ch = 2 * 8 * 128
    assert pb[0, 0, 0] == ch * (4 + 1 + 8 * 4) + ch * 256 // 2
    assert pb[1, 0, 0] == ch * 256 // 2
    last = 1000 - 3 * 256  # 232 tokens, 8 chunks (the last has 8 tokens)
    assert pb[0, 1, 3] == ch * (4 + 1 + 8 * 4) + ch * last // 2
    oscar = codec(precondition="oscar").payload_bytes(shape)
    assert oscar[0, 0, 0] - pb[0, 0, 0] == 2 * 2 * 8 * 256  # fp16 scale per token, head, K|V
    assert codec(precondition="oscar", oscar_targets="k").payload_bytes(shape)[0, 0, 0] \
        - pb[0, 0, 0] == 2 * 8 * 256


# ---- backends write identical bytes --------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("split", [(4, 4), (2, 6), (2, 2, 4), (4,), (8,), (3, 5)])
@pytest.mark.parametrize("dims", [(2, 3, 45, 24), (1, 1, 1, 3), (1, 2, 70, 5)])
def test_cpu_backend_bytes_equal_reference(dtype, split, dims):
    layers, heads, tokens, head_dim = dims
    g = torch.Generator().manual_seed(tokens)
    kv = (torch.randn(layers, 2, heads, tokens, head_dim, generator=g) * 3 + 1).to(dtype)
    kv[0, 0, 0, :, 0] = 2.5  # a constant channel
    params = dict(split=list(split), page_tokens=32, chunk_tokens=16)
    ref = codec(**params, backend="torch")
    cpu = codec(**params, backend="cpu")
    enc = cpu.encode(kv)
    assert enc.to_bytes() == ref.encode(kv).to_bytes()
    for s in range(1, len(split) + 1):
        torch.testing.assert_close(cpu.decode(enc, s), ref.decode(enc, s), rtol=0, atol=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), split=st.sampled_from([(4, 4), (2, 6), (2, 2, 4), (4,), (3, 5)]))
def test_cpu_backend_bytes_equal_reference_arbitrary(data, split):
    tokens = data.draw(st.integers(1, 40))
    head_dim = data.draw(st.integers(1, 6))
    vals = data.draw(arrays(np.float32, (1, 2, 1, tokens, head_dim),
                            elements=st.one_of(finite32, extremes)))
    x = torch.from_numpy(vals)
    params = dict(split=list(split), page_tokens=16, chunk_tokens=8)
    ref, cpu = codec(**params, backend="torch"), codec(**params, backend="cpu")
    enc = cpu.encode(x)
    assert enc.to_bytes() == ref.encode(x).to_bytes()
    torch.testing.assert_close(cpu.decode(enc), ref.decode(enc), rtol=0, atol=0)


def test_cpu_backend_bytes_equal_reference_extremes():
    vals = torch.tensor([3.4e38, -3.4e38, 1e-45, 0.0, -1e-40, 65504.0, 1e30, -7.0, 1e-20,
                         -0.0])
    kv = vals[torch.arange(2 * 3 * 40 * 8) % len(vals)].reshape(1, 2, 3, 40, 8)
    kv = kv * torch.linspace(0.5, 1.0, 40).view(1, 1, 1, 40, 1)
    for split in ([4, 4], [2, 2, 4]):
        ref = codec(split=split, page_tokens=32, chunk_tokens=8, backend="torch")
        cpu = codec(split=split, page_tokens=32, chunk_tokens=8, backend="cpu")
        enc = cpu.encode(kv)
        assert enc.to_bytes() == ref.encode(kv).to_bytes()
        out = cpu.decode(enc)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref.decode(enc), rtol=0, atol=0)


def test_deterministic_bytes():
    kv = torch.randn(2, 2, 2, 100, 16).to(torch.bfloat16)
    c = codec()
    assert c.encode(kv).to_bytes() == c.encode(kv.clone()).to_bytes()


def test_backend_not_in_wire_params():
    kv = torch.randn(1, 2, 1, 20, 8)
    enc = codec(backend="torch").encode(kv)
    assert "backend" not in enc.params
    codec(backend="cpu").decode(enc)  # any backend decodes any backend's bytes


# ---- error ---------------------------------------------------------------------------------
def _gaussian(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 4, 600, 64, generator=g).to(torch.bfloat16)


def test_error_anchor_bounded_full_close():
    kv = _gaussian()
    c = codec()
    enc = c.encode(kv)
    anchor, full = rel_mse(c.decode(enc, 1), kv), rel_mse(c.decode(enc, 2), kv)
    assert full < 1e-3
    assert 1e-3 < anchor < 0.05  # usable draft: sign + 3-bit magnitude of the centred value
    assert anchor > 20 * full


@pytest.mark.parametrize("split", [(2, 2, 4), (2, 2, 2, 2), (4, 4), (2, 6)])
def test_error_monotone_in_streams(split):
    kv = _gaussian(1)
    c = codec(split=list(split))
    enc = c.encode(kv)
    errs = [rel_mse(c.decode(enc, s), kv) for s in range(1, len(split) + 1)]
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), errs


def test_more_magnitude_bits_lower_error():
    kv = _gaussian(2)
    errs = [rel_mse(codec(split=s).decode(codec(split=s).encode(kv)), kv)
            for s in ([2], [4], [2, 4], [8])]
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), errs


def test_outlier_channel_is_isolated():
    """A x100 outlier channel does not degrade the other channels (per-channel stats)."""
    kv = _gaussian(3).float()
    clean = codec().decode(codec().encode(kv.bfloat16()))
    kv2 = kv.clone()
    kv2[:, :, :, :, 7] *= 100
    noisy = codec().decode(codec().encode(kv2.bfloat16()))
    keep = [d for d in range(64) if d != 7]
    torch.testing.assert_close(noisy[..., keep], clean[..., keep], rtol=0, atol=0)


# ---- edge cases ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_constant_and_zero_channels_exact(dtype, backend):
    kv = torch.zeros(1, 2, 2, 37, 8, dtype=dtype)
    kv[:, 0] = 3.0
    kv[:, 1, 1] = -1.5
    c = codec(backend=backend, page_tokens=32, chunk_tokens=8)
    out = c.decode(c.encode(kv))
    assert out.dtype == dtype
    torch.testing.assert_close(out, kv, rtol=0, atol=0)
    assert torch.isfinite(c.decode(c.encode(kv), 1)).all()


@pytest.mark.parametrize("tokens", [1, 2, 7, 31, 33, 255, 257])
def test_short_and_ragged_token_counts(tokens):
    g = torch.Generator().manual_seed(tokens)
    kv = torch.randn(1, 2, 3, tokens, 16, generator=g).to(torch.bfloat16)
    c = codec()
    enc = c.encode(kv)
    out = c.decode(enc)
    assert out.shape == kv.shape and torch.isfinite(out).all()
    if tokens == 1:  # a single token per chunk: every channel is constant -> exact
        torch.testing.assert_close(out, kv, rtol=0, atol=0)
    else:
        assert rel_mse(out, kv) < 1e-3


def test_fp16_extremes_no_overflow():
    kv = torch.full((1, 2, 1, 16, 8), 65504.0, dtype=torch.float16)
    kv[:, :, :, ::2] = -65504.0
    for backend in ("torch", "cpu"):
        c = codec(backend=backend, page_tokens=16, chunk_tokens=8)
        out = c.decode(c.encode(kv))
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, kv, rtol=0.01, atol=0)


def test_nan_and_inf_rejected():
    kv = torch.randn(1, 2, 1, 8, 8)
    kv[0, 1, 0, 3, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        codec().encode(kv)


@pytest.mark.parametrize("bad", [
    {"split": [9]}, {"split": [1, 7]}, {"split": [5, 5]}, {"split": []}, {"split": 4},
    {"chunk_tokens": 12}, {"page_tokens": 100}, {"alpha": 0}, {"alpha": float("inf")},
    {"precondition": "hadamard"}, {"oscar_targets": "v"}, {"backend": "gpu"}, {"bogus": 1},
])
def test_bad_params_rejected(bad):
    with pytest.raises(CodecError):
        make_codec("lynx", bad)


def test_missing_stream_rejected():
    kv = torch.randn(1, 2, 1, 40, 8)
    c = codec(page_tokens=32, chunk_tokens=8)
    enc = c.encode(kv)
    enc.streams[1] = enc.streams[1][:1]
    c.decode(enc, streams=1)  # the anchor alone is complete
    with pytest.raises(CodecError, match="missing"):
        c.decode(enc, streams=2)


# ---- OScaR preconditioning -----------------------------------------------------------------
def test_oscar_needs_power_of_two_head_dim():
    with pytest.raises(ValueError, match="power-of-two"):
        codec(precondition="oscar").encode(torch.randn(1, 2, 1, 8, 12))


@pytest.mark.parametrize("targets", ["kv", "k"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_oscar_roundtrip_returns_unrotated(targets, backend):
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 2, 3, 70, 32, generator=g)
    kv[:, 0, :, :, 3] *= 20  # a K outlier channel, the case rotation is for
    kv[:, 0, :, 10] *= 5  # a loud token, the case token scaling is for
    kv = kv.to(torch.bfloat16)
    c = codec(precondition="oscar", oscar_targets=targets, backend=backend,
              page_tokens=32, chunk_tokens=16)
    enc = c.encode(kv)
    full, anchor = c.decode(enc), c.decode(enc, 1)
    assert rel_mse(full, kv) < 1e-3  # compared with the unrotated input: decode unrotates
    assert rel_mse(full, kv) < rel_mse(anchor, kv) < 0.05


def test_oscar_backends_identical_and_extreme_inputs():
    kv = torch.randn(1, 2, 2, 40, 16)
    kv[0, 1, 1, 5] = 0.0  # a zero token: scale 0, no NaN
    a = codec(precondition="oscar", backend="torch", page_tokens=32, chunk_tokens=8)
    b = codec(precondition="oscar", backend="cpu", page_tokens=32, chunk_tokens=8)
    assert a.encode(kv).to_bytes() == b.encode(kv).to_bytes()
    assert torch.isfinite(b.decode(b.encode(kv))).all()
    with pytest.raises(CodecError, match="oscar"):
        a.encode(torch.full((1, 2, 1, 4, 16), 1e35))


# ---- presets -------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_presets_build_and_roundtrip(preset):
    c = load_preset(preset).build()
    assert c.name == "lynx"
    kv = torch.randn(1, 2, 2, 300, 64).to(torch.bfloat16)
    enc = c.encode(kv)
    assert rel_mse(c.decode(enc), kv) < 0.05
    assert enc.bits_per_element() < 10


def test_cpu_fp16_bit_conversions_match_torch():
    """The numba fp32 <-> fp16 bit conversions of the chunk sigmas (fp16_bits.*_rows) round
    like torch .half(): every fp16 boundary region, subnormals, ties, overflow to inf."""
    from kvsim.kernels.fp16_bits import f16_bits_to_f32_rows, f32_to_f16_bits_rows

    rng = np.random.default_rng(0)
    h = np.arange(0, 0x7C00, dtype=np.uint16)  # every finite non-negative fp16
    f = h.view(np.float16).astype(np.float32)
    ties = ((f[:-1].astype(np.float64) + f[1:]) / 2).astype(np.float32)
    probes = np.concatenate([
        f, ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(1e9)),
        np.float32([0.0, 1e-45, 2.0**-25, 2.0**-26, 65504.0, 65519.0, 65520.0, 1e5, 3.4e38]),
        (rng.random(20000) * 2.0 ** rng.integers(-30, 17, 20000)).astype(np.float32),
    ]).astype(np.float32)
    got = np.empty(probes.shape, np.uint16)
    f32_to_f16_bits_rows(probes, got, np.empty(probes.shape, np.float32))
    want = torch.from_numpy(probes).half().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)
    back = np.empty(h.shape, np.float32)
    f16_bits_to_f32_rows(h, back)
    np.testing.assert_array_equal(back, f)


@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 32, 128, 256])
def test_cpu_fwht_bit_identical_to_reference(d):
    """The numba Hadamard used by the cpu backend's oscar path == kvsim.kernels.hadamard,
    bit for bit, so oscar bytes do not depend on the backend."""
    from kvsim.kernels.hadamard import hadamard
    from kvsim.kernels.lynx.cpu import fwht_cpu

    g = torch.Generator().manual_seed(d)
    x = torch.randn(300, d, generator=g) * torch.logspace(-30, 30, 300).unsqueeze(1)
    assert torch.equal(fwht_cpu(x).view(torch.int32), hadamard(x).view(torch.int32))
    with pytest.raises(ValueError, match="power-of-two"):
        fwht_cpu(torch.randn(2, 12))


# ---- fast cpu paths: bf16 keys, in-kernel finite check, fused oscar ---------------------
bf16_values = st.one_of(
    finite32, extremes,
    st.sampled_from([2.0**-133, -(2.0**-133), 1e-39, 3.3895e38, -3.3895e38, 2.0**-126]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), split=st.sampled_from([(4, 4), (2, 6), (2, 2, 4), (4,), (8,)]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_cpu_backend_bytes_equal_reference_bf16_fp16(data, split, dtype):
    """bf16 input runs the int16-key page min / max (and the in-kernel finite check); fp16 the
    fp32 path: bytes and every decode dtype equal the torch reference."""
    tokens = data.draw(st.integers(1, 40))
    head_dim = data.draw(st.integers(1, 6))
    vals = data.draw(arrays(np.float32, (1, 2, 2, tokens, head_dim), elements=bf16_values))
    vals = np.clip(vals, -65504, 65504) if dtype == torch.float16 else np.clip(
        vals, -3.3895e38, 3.3895e38)  # finite in the dtype
    x = torch.from_numpy(vals).to(dtype)
    params = dict(split=list(split), page_tokens=16, chunk_tokens=8)
    ref, cpu = codec(**params, backend="torch"), codec(**params, backend="cpu")
    enc = cpu.encode(x)
    assert enc.to_bytes() == ref.encode(x).to_bytes()
    for out in (None, torch.float32, torch.bfloat16, torch.float16):
        a, b = cpu.decode(enc, dtype=out), ref.decode(enc, dtype=out)
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("precondition", ["none", "oscar"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nonfinite_rejected_by_the_kernel(bad, precondition, dtype):
    """The cpu kernels' own finite checks (bf16 keys of the hierarchy, max |x| of the oscar
    kernel) raise Codec.encode's error; fp32 without oscar keeps Codec.encode's check."""
    kv = torch.randn(1, 2, 2, 20, 8).to(dtype)
    kv[0, 1, 1, 13, 5] = bad
    for targets in ("kv", "k"):
        c = codec(backend="cpu", page_tokens=16, chunk_tokens=8, precondition=precondition,
                  oscar_targets=targets)
        assert c._kernel_checks_finite(kv) == (precondition == "oscar"
                                               or dtype == torch.bfloat16)
        with pytest.raises(ValueError, match="non-finite value.*first at index "
                                             "\\(0, 1, 1, 13, 5\\)"):
            c.encode(kv)


oscar_values = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False, width=32),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 1e20, -1e20, 1e29, 65504.0, 3.0e4]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), targets=st.sampled_from(["kv", "k"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
       head_dim=st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_cpu_oscar_fused_equals_reference(data, targets, dtype, head_dim):
    """The fused numba preconditioning / its inverse (torch's norm order, both decode clamps,
    direct bf16 output) give the torch reference's bytes and decoded tensors, zero and huge
    tokens included."""
    tokens = data.draw(st.integers(1, 40))
    vals = data.draw(arrays(np.float32, (2, 2, 2, tokens, head_dim), elements=oscar_values))
    if dtype == torch.float16:
        vals = np.clip(vals, -65504, 65504)
    x = torch.from_numpy(vals).to(dtype)
    params = dict(split=[4, 4], page_tokens=16, chunk_tokens=8, precondition="oscar",
                  oscar_targets=targets)
    ref, cpu = codec(**params, backend="torch"), codec(**params, backend="cpu")
    enc = cpu.encode(x)
    assert enc.to_bytes() == ref.encode(x).to_bytes()
    for streams in (1, 2):
        for out in (None, torch.float32, torch.bfloat16, torch.float16):
            a = cpu.decode(enc, streams, dtype=out)
            b = ref.decode(enc, streams, dtype=out)
            assert a.dtype == b.dtype
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_cpu_oscar_norm_order_probe_and_fallback(monkeypatch):
    """The norm's lane count is found on this machine; without one the cpu backend falls back
    to the torch preconditioning, with the same bytes."""
    from kvsim.kernels.lynx import cpu as lynx_cpu

    assert lynx_cpu._torch_norm_lanes(128) > 0
    kv = torch.randn(1, 2, 2, 40, 16).to(torch.bfloat16)
    params = dict(precondition="oscar", page_tokens=32, chunk_tokens=8)
    want = codec(**params, backend="torch").encode(kv).to_bytes()
    assert codec(**params, backend="cpu").encode(kv).to_bytes() == want
    monkeypatch.setattr(lynx_cpu, "_torch_norm_lanes", lambda d: 0)
    assert codec(**params, backend="cpu").encode(kv).to_bytes() == want
    with pytest.raises(CodecError, match="oscar"):
        codec(**params, backend="cpu").encode(torch.full((1, 2, 1, 4, 16), 1e35))


def test_cpu_oscar_refuses_huge_values_like_the_reference():
    kv = torch.randn(1, 2, 1, 4, 16)
    kv[0, 1, 0, 2, 3] = 2.0**101  # in V: counts for targets "k" too
    for targets in ("kv", "k"):
        for backend in ("torch", "cpu"):
            c = codec(precondition="oscar", oscar_targets=targets, backend=backend)
            with pytest.raises(CodecError, match="2\\^100"):
                c.encode(kv)


def test_decode_takes_adjacent_chunks_without_a_copy():
    """Chunks of a local encode are slices of one buffer: decode reads them in place; chunks
    from the wire (separate buffers) are joined; both decode the same."""
    from kvsim.kernels.device_wire import concat_payloads

    kv = torch.randn(2, 2, 2, 70, 8).to(torch.bfloat16)
    c = codec(backend="cpu", page_tokens=32, chunk_tokens=8)
    enc = c.encode(kv)
    parts = [ch.payload for ch in enc.streams[0]]
    joined = concat_payloads(parts)
    assert np.shares_memory(joined, parts[0])
    assert joined.tobytes() == b"".join(p.tobytes() for p in parts)
    assert not np.shares_memory(concat_payloads(parts[::-1]), parts[0])
    back = Encoded.from_bytes(enc.to_bytes())
    assert torch.equal(c.decode(back).view(torch.int16), c.decode(enc).view(torch.int16))


# ---- anchor reconstruction of each chunk's largest element ---------------------------------
def test_narrow_top_bucket_reconstructs_at_one():
    from kvsim.kernels.lynx.format import lynx_tables

    assert lynx_tables(4.0, (4, 4)).recon[0][-1] == 1.0  # 3 magnitude bits known
    assert lynx_tables(4.0, (2, 2, 4)).recon[1][-1] == 1.0  # 3 known after two streams
    assert lynx_tables(4.0, (2, 6)).recon[0][-1] < 1.0  # 1 bit known: wide bucket keeps centre


def test_anchor_keeps_a_spike_value():
    """A spike in an otherwise flat channel is its chunk's max-abs element (|u| = 1): the
    anchor alone must give it back to within fp16 metadata rounding, not ~11 % short."""
    kv = torch.zeros(1, 2, 1, 64, 8)
    kv[0, 0, 0, 5, 3] = 10.0
    kv[0, 1, 0, 40, 6] = -7.0
    c = make_codec("lynx", {})
    anchor = c.decode(c.encode(kv), streams=1, dtype=torch.float32)
    assert anchor[0, 0, 0, 5, 3].item() == pytest.approx(10.0, rel=2e-3)
    assert anchor[0, 1, 0, 40, 6].item() == pytest.approx(-7.0, rel=2e-3)


@pytest.mark.parametrize("lanes", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("d", [5, 16, 37, 128])
def test_cpu_norm_sq_sums_lanes_in_torch_order(lanes, d):
    """_norm_sq (squares first, then lane sums) equals the fp32 sequence it documents:
    lane k adds (y_j / den)^2 for j = k mod lanes in order, the lanes in order, then the tail."""
    from kvsim.kernels.lynx import cpu as lynx_cpu

    y = (np.random.default_rng(d * 100 + lanes).standard_normal(d) * 5).astype(np.float32)
    den = np.float32(3.7)
    sq = [np.float32(v / den) * np.float32(v / den) for v in y]
    vec = d - d % lanes
    acc = [np.float32(0.0)] * lanes
    for j in range(vec):
        acc[j % lanes] = np.float32(acc[j % lanes] + sq[j])
    want = acc[0]
    for k in range(1, lanes):
        want = np.float32(want + acc[k])
    for j in range(vec, d):
        want = np.float32(want + sq[j])
    got = lynx_cpu._norm_sq(y, den, lanes, np.empty(lanes + d, np.float32))
    assert np.float32(got).view(np.uint32) == want.view(np.uint32)
