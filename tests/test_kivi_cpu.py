"""KIVI backbone (kivi, kcvt, gear, oscar): the numba cpu path (kivi/cpu.py: the fused
whole-cache kernels, and the per-page kernels of the configurations they leave to the generic
path) against the torch reference, byte for byte and bit for bit; and the pieces of the fused
kernels (Walsh-Hadamard rows, gear's low-rank fit and outlier choice) against theirs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.kernels import bitpack_cpu
from kvsim.kernels.bitpack import pack, unpack
from kvsim.kernels.codec import make_codec
from kvsim.kernels.encoded import Encoded
from kvsim.kernels.groupquant import dequantize_groups, quantize_groups
from kvsim.kernels.hadamard import hadamard
from kvsim.kernels.kivi import cpu as kivi_cpu
from kvsim.kernels.kivi.codec import use_cpu_kernels
from kvsim.kernels.kivi.lowrank import low_rank, low_rank_start, sqrt_rn
from kvsim.kernels.kivi.outliers import split_outliers

# values that stress the quantizer: signed zeros, fp16 subnormal ranges, near the fp16 max
# (65280 is exact in bf16 as well), a constant
SPECIALS = (0.0, -0.0, 65280.0, -65280.0, 6e-8, -6e-8, 1e-9, 1.25, 3.0e4)


def kv_with_specials(dims: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float,
                     special_frac: float) -> torch.Tensor:
    """Random [L, 2, H, T, D] tensor; some entries replaced by SPECIALS, some token rows and
    some channels constant, one row all -0.0."""
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal(dims) * scale, -65280, 65280).astype(np.float32)
    pick = rng.random(dims) < special_frac
    x[pick] = rng.choice(np.array(SPECIALS, np.float32), size=int(pick.sum()))
    flat = x.reshape(-1, dims[-1])
    rows = rng.choice(flat.shape[0], size=max(1, flat.shape[0] // 5), replace=False)
    flat[rows[::2]] = rng.choice(np.array(SPECIALS, np.float32))  # constant token rows
    flat[rows[0]] = -0.0
    if rng.random() < 0.5:  # a constant key channel (per-channel groups of one value)
        x[:, 0, :, :, int(rng.integers(dims[-1]))] = rng.choice(np.array(SPECIALS, np.float32))
    return torch.from_numpy(x).to(dtype)


def payloads(enc: Encoded) -> list[bytes]:
    return [c.payload.tobytes() for c in enc.streams[0]]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def pair(name: str, params: dict, monkeypatch: pytest.MonkeyPatch):
    """(torch reference codec, cpu-kernel codec) with the same params but the backend."""
    return (make_codec(name, {**params, "backend": "torch"}),
            make_codec(name, {**params, "backend": "cpu"}))


def check_same(name: str, params: dict, kv: torch.Tensor, monkeypatch) -> None:
    ref_codec, cpu_codec = pair(name, params, monkeypatch)
    ref, got = ref_codec.encode(kv), cpu_codec.encode(kv)
    assert payloads(got) == payloads(ref)
    np.testing.assert_array_equal(got.chunk_bytes(), cpu_codec.size_table(got.shape).chunk_bytes)
    back = Encoded.from_bytes(got.to_bytes())
    for out_dtype in (None, torch.float32):
        assert same_bits(ref_codec.decode(ref, dtype=out_dtype),
                         cpu_codec.decode(back, dtype=out_dtype))


CASES = st.sampled_from([
    ("kivi", {"group": 4, "value_group": 4, "residual": 4, "page_tokens": 8}),
    ("kivi", {"bits": 4, "group": 2, "value_group": 0, "residual": 0, "page_tokens": 6}),
    ("kivi", {"bits": 8, "group": 8, "value_group": 8, "residual": 8, "page_tokens": 16}),
    ("kcvt", {"residual": 3, "page_tokens": 5}),
    ("kcvt", {"bits": 2, "residual": 0, "page_tokens": 7}),
    ("gear", {"group": 4, "value_group": 8, "residual": 4, "page_tokens": 8, "rank": 2,
              "outlier_pct": 10.0}),
    ("gear", {"backbone": "kcvt", "bits": 4, "residual": 2, "page_tokens": 9, "rank": 3}),
    ("gear-l", {"group": 2, "value_group": 4, "residual": 2, "page_tokens": 4, "rank": 1}),
    ("oscar", {"group": 4, "value_group": 8, "residual": 4, "page_tokens": 8}),
    ("oscar", {"bits": 4, "group": 2, "value_group": 0, "residual": 0, "page_tokens": 4,
               "scale_values": True, "rotate_values": False}),
    # added with the fused CPU path (kivi_cpu.encode_fused / decode_fused)
    ("kivi", {"group": 4, "value_group": 4, "residual": 8, "page_tokens": 8,
              "window": "kivi"}),
    ("kcvt", {"bits": 8, "residual": 1, "page_tokens": 3}),
    ("gear", {"group": 2, "value_group": 4, "residual": 2, "page_tokens": 6, "rank": 4,
              "outlier_pct": 40.0, "iters": 1}),
    ("gear", {"backbone": "kcvt", "bits": 2, "residual": 0, "page_tokens": 5, "rank": 2,
              "outlier_pct": 30.0}),
    ("gear-l", {"backbone": "kcvt", "bits": 8, "residual": 1, "page_tokens": 7, "rank": 2}),
    ("oscar", {"group": 4, "value_group": 8, "residual": 4, "page_tokens": 8,
               "rotate_values": False}),
    ("oscar", {"bits": 8, "group": 2, "value_group": 4, "residual": 2, "page_tokens": 4,
               "scale_values": True}),
    # configurations the fused kernels leave to the generic path (fused_ok False)
    ("gear", {"group": 4, "value_group": 8, "residual": 4, "page_tokens": 8, "rank": 2,
              "lowrank": "sequence"}),
    ("gear", {"group": 4, "value_group": 8, "residual": 4, "page_tokens": 8, "rank": 2,
              "outlier_pct": 10.0, "outlier_count": "exact"}),
])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=CASES, layers=st.integers(1, 2), heads=st.integers(1, 2),
       tokens=st.integers(1, 40), head_dim=st.sampled_from([8, 16, 32]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 2**31), scale=st.sampled_from([1e-6, 1.0, 300.0, 2e3]),
       special_frac=st.sampled_from([0.0, 0.05, 0.5]))
def test_cpu_path_same_bytes_and_tensors_as_torch(monkeypatch, case, layers, heads, tokens,
                                                  head_dim, dtype, seed, scale, special_frac):
    name, params = case
    dims = (layers, 2, heads, tokens, head_dim)
    if name == "oscar":  # rotation and norms must stay within fp16: moderate inputs only
        scale, special_frac = min(scale, 300.0), 0.0
    kv = kv_with_specials(dims, dtype, seed, scale, special_frac)
    if name == "oscar" and not params.get("scale_values"):
        # rotated V must stay within fp16 (oscar refuses more): |v| * sqrt(head_dim) <= 65504
        kv = kv.clamp(-2000.0, 2000.0)
    check_same(name, params, kv, monkeypatch)


@pytest.mark.parametrize("name", ["kivi", "kcvt", "gear", "oscar"])
def test_default_params_realistic_shape(monkeypatch, name):
    # default params (page 256, residual 128, group 32): several full pages + the window
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(1, 2, 2, 700, 64, generator=g).to(torch.bfloat16)
    check_same(name, {}, kv, monkeypatch)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from([
    ("kcvt", {"bits": 2, "residual": 1, "page_tokens": 5}),
    ("kivi", {"bits": 2, "group": 1, "value_group": 0, "residual": 1, "page_tokens": 3}),
    ("kivi", {"bits": 4, "group": 1, "value_group": 0, "residual": 1, "page_tokens": 5,
              "window": "kivi"}),
    ("gear", {"backbone": "kcvt", "bits": 4, "residual": 1, "page_tokens": 5, "rank": 2}),
    ("gear", {"bits": 2, "group": 1, "value_group": 0, "residual": 1, "page_tokens": 7,
              "rank": 3, "outlier_pct": 20.0}),
]), tokens=st.integers(1, 30), head_dim=st.sampled_from([1, 3, 5, 7]),
       heads=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_cpu_path_codes_sharing_bytes_across_heads(monkeypatch, case, tokens, head_dim, heads,
                                                   seed):
    # head_dim * q not a multiple of the codes per byte: two heads' packed codes share a
    # byte, so the fused encode kernel takes all heads of a page in one work item
    name, params = case
    kv = kv_with_specials((2, 2, heads, tokens, head_dim), torch.bfloat16, seed, 1.0, 0.05)
    check_same(name, params, kv, monkeypatch)


def test_cpu_path_u16_indices_and_strided_input(monkeypatch):
    # page_tokens > 256 (u16 K outlier indices), head_dim > 256 (u16 V indices), and a
    # non-contiguous input tensor (the kernels read strides)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(1, 2, 1, 700, 16, generator=g).to(torch.bfloat16)
    check_same("gear", {"page_tokens": 320, "residual": 64}, kv, monkeypatch)
    kv = torch.randn(1, 2, 1, 40, 512, generator=g).to(torch.bfloat16)
    check_same("gear", {"page_tokens": 16, "residual": 16, "group": 16, "value_group": 0},
               kv, monkeypatch)
    wide = torch.randn(2, 2, 3, 300, 128, generator=g).to(torch.bfloat16)
    for name in ("kivi", "gear", "oscar"):
        check_same(name, {}, wide[:, :, ::2, :, ::2], monkeypatch)
        ref = make_codec(name, {"backend": "cpu"})
        assert (payloads(ref.encode(wide[:, :, ::2, :, ::2]))
                == payloads(ref.encode(wide[:, :, ::2, :, ::2].contiguous())))


@pytest.mark.parametrize("name", ["kivi", "kcvt", "gear", "oscar"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_path_reads_a_layer_sliced_from_a_whole_cache(name, dtype):
    """A layer the sender takes from a cache held whole (kv[l:l + 1]: contiguous, but starting
    inside the storage) encodes to its copy's bytes. The kernels' flat view once ran from the
    storage's start to its end past the offset, and every layer but the first failed."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(3, 2, 2, 300, 32, generator=g).to(dtype)
    codec = make_codec(name, {"backend": "cpu"})
    for layer in (1, 2):
        sliced = cache[layer:layer + 1]
        assert sliced.is_contiguous() and sliced.storage_offset() > 0
        assert payloads(codec.encode(sliced)) == payloads(codec.encode(sliced.clone()))


@given(n=st.integers(1, 20), log_d=st.integers(0, 8), seed=st.integers(0, 2**31),
       scale=st.sampled_from([1e-30, 1.0, 3e4]))
@settings(max_examples=40, deadline=None)
def test_fwht_rows_equals_hadamard(n, log_d, seed, scale):
    d = 1 << log_d
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32) * scale
    got = x.copy()
    kivi_cpu._fwht_rows(got, n, d, np.float32(1.0 / np.sqrt(d)))
    np.testing.assert_array_equal(got.view(np.int32),
                                  hadamard(torch.from_numpy(x)).numpy().view(np.int32))


@given(q=st.integers(1, 40), d=st.integers(1, 24), rank=st.integers(1, 6),
       iters=st.integers(1, 3), seed=st.integers(0, 2**31),
       kind=st.sampled_from(["normal", "low-rank", "zeros", "tiny"]))
@settings(max_examples=60, deadline=None)
def test_low_rank_kernel_equals_torch(q, d, rank, iters, seed, kind):
    rng = np.random.default_rng(seed)
    e = rng.standard_normal((q, d)).astype(np.float32)
    if kind == "low-rank":  # rank-deficient: Gram-Schmidt meets (near) zero columns
        e = (rng.standard_normal((q, 1)) @ rng.standard_normal((1, d))).astype(np.float32)
    elif kind == "zeros":
        e[:] = 0.0
    elif kind == "tiny":
        e *= np.float32(1e-20)
    r = min(rank, q, d)
    a, b = low_rank(torch.from_numpy(e)[None], rank, iters, seed)
    fa, fb = np.empty(q * r, np.float32), np.empty(d * r, np.float32)
    kivi_cpu._low_rank(e, q, d, r, iters, low_rank_start(d, r, seed).numpy(), fa, fb)
    np.testing.assert_array_equal(fa.view(np.int32), a[0].numpy().reshape(-1).view(np.int32))
    np.testing.assert_array_equal(fb.view(np.int32), b[0].numpy().reshape(-1).view(np.int32))


@given(q=st.integers(3, 40), d=st.integers(3, 40), kv=st.integers(0, 1),
       seed=st.integers(0, 2**31), levels=st.sampled_from([2, 3, 5, 1000]))
@settings(max_examples=60, deadline=None)
def test_page_outliers_equal_split_outliers_with_ties(q, d, kv, seed, levels):
    # few distinct values: many ties at the cut, which the stable-sort rule decides
    rng = np.random.default_rng(seed)
    x = rng.integers(-levels, levels + 1, (q, d)).astype(np.float32)
    x[x == 0] = rng.choice(np.array([0.0, -0.0], np.float32), int((x == 0).sum()))
    n = q if kv == 0 else d  # vector length
    k = max(1, (n - 1) // 3)
    vecs = torch.from_numpy(x.T.copy() if kv == 0 else x)  # [vectors, n]
    filled, idx, vals = split_outliers(vecs, k)
    buf = x.copy()
    out = np.zeros(2 * 2 * 2 * k * max(q, d) * 2, np.uint8)
    val_at = out.size // 2
    kivi_cpu._page_outliers(buf, q, d, kv, k, 0, out, 0, val_at, 2)
    m = vecs.shape[0] * 2 * k
    got_idx = out[:2 * m].view("<u2").astype(np.int64)
    got_val = out[val_at:val_at + 2 * m].view(np.float16)
    np.testing.assert_array_equal(got_idx, idx.reshape(-1).numpy())
    np.testing.assert_array_equal(got_val.view(np.int16),
                                  vals.reshape(-1).to(torch.float16).numpy().view(np.int16))
    want = filled.numpy().T if kv == 0 else filled.numpy()
    np.testing.assert_array_equal(buf, want)  # fills (their zero signs may differ: as values)


@given(x=st.lists(st.floats(0, 2.0 ** 127, width=32), min_size=1, max_size=50))
def test_sqrt_rn_is_correctly_rounded(x):
    t = torch.tensor(x, dtype=torch.float32)
    np.testing.assert_array_equal(sqrt_rn(t).numpy(), np.sqrt(t.numpy()))


@given(rows=st.integers(0, 5), ngroups=st.integers(1, 4), group=st.sampled_from([1, 3, 8, 32]),
       bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31),
       scale=st.sampled_from([1e-7, 1.0, 6e4]))
@settings(max_examples=60, deadline=None)
def test_quantize_rows_equals_quantize_groups(rows, ngroups, group, bits, seed, scale):
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal((rows, ngroups * group)) * scale, -65504, 65504)
    x = torch.from_numpy(x.astype(np.float32))
    if rows:
        x[0] = -0.0
    c, s, z = quantize_groups(x, group, bits)
    c2, s2, z2, xhat = kivi_cpu.quantize_rows(x, group, bits)
    assert torch.equal(c, c2) and same_bits(s, s2) and same_bits(z, z2)
    assert same_bits(xhat, dequantize_groups(c, s, z, group))
    assert same_bits(kivi_cpu.dequantize_rows(c, s, z, group), xhat)


@given(n=st.integers(0, 70), bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31))
def test_pack_unpack_equal_bitpack(n, bits, seed):
    per = 8 // bits
    codes = torch.from_numpy(np.random.default_rng(seed).integers(0, 1 << bits, n)
                             .astype(np.uint8))
    padded = torch.cat((codes, codes.new_zeros((-n) % per)))
    ref = pack(padded, bits).numpy()
    got = bitpack_cpu.pack_flat(codes, bits)
    np.testing.assert_array_equal(got, ref)
    assert torch.equal(bitpack_cpu.unpack_flat(got, bits, n),
                       unpack(torch.from_numpy(ref), bits, n))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="group size"):
        kivi_cpu.quantize_rows(torch.zeros(2, 10), 4, 2)
    with pytest.raises(ValueError, match="bits"):
        kivi_cpu.quantize_rows(torch.zeros(2, 8), 4, 3)
    with pytest.raises(ValueError, match="backend"):
        make_codec("kivi", {"backend": "gpu"})
    with pytest.raises(ValueError, match="backend"):
        use_cpu_kernels("numba", torch.device("cpu"))


def test_auto_backend_runs_the_cpu_kernels_on_cpu_tensors(monkeypatch):
    assert use_cpu_kernels("auto", torch.device("cpu"))
    assert not use_cpu_kernels("auto", torch.device("cuda"))
    assert not use_cpu_kernels("torch", torch.device("cpu"))
    calls = []
    real_e, real_d = kivi_cpu.encode_fused, kivi_cpu.decode_fused

    def spy_e(*args, **kwargs):
        calls.append("e")
        return real_e(*args, **kwargs)

    def spy_d(*args, **kwargs):
        calls.append("d")
        return real_d(*args, **kwargs)

    monkeypatch.setattr(kivi_cpu, "encode_fused", spy_e)
    monkeypatch.setattr(kivi_cpu, "decode_fused", spy_d)
    kv = torch.randn(1, 2, 2, 20, 16).to(torch.bfloat16)
    params = {"group": 4, "value_group": 8, "residual": 4, "page_tokens": 8}
    codec = make_codec("kivi", params)
    auto = codec.encode(kv)
    codec.decode(auto)
    assert "e" in calls and "d" in calls
    ref = make_codec("kivi", {**params, "backend": "torch"}).encode(kv)
    assert payloads(auto) == payloads(ref)


@pytest.mark.parametrize("q", [1, 7, 8, 13, 64, 256])
def test_transpose_equals_numpy(q):
    """kivi_cpu._transpose (eight rows at a time on flat views, then a tail) is e.T."""
    e = np.random.default_rng(q).standard_normal((q, 24)).astype(np.float32)
    et = np.empty((24, q), np.float32)
    kivi_cpu._transpose(e, q, 24, et)
    assert np.array_equal(et, e.T)
