"""KIVI backbone (kivi, kcvt, gear, oscar): the numba cpu path (kivi_cpu.py) against the torch
reference, byte for byte and bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.kernels import Encoded, kivi_cpu, make_codec
from kvsim.kernels.bitpack import pack, unpack
from kvsim.kernels.groupquant import dequantize_groups, quantize_groups
from kvsim.kernels.kivi import use_cpu_kernels

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
])


@settings(max_examples=40, deadline=None,
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
    got = kivi_cpu.pack_flat(codes, bits)
    np.testing.assert_array_equal(got, ref)
    assert torch.equal(kivi_cpu.unpack_flat(got, bits, n), unpack(torch.from_numpy(ref), bits, n))


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
