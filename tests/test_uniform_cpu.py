"""uniform codec: the numba cpu backend (uniform/cpu.py) against the torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.kernels.codec import make_codec
from kvsim.kernels.encoded import Encoded
from kvsim.kernels.uniform import cpu as uniform_cpu
from kvsim.kernels.uniform.codec import use_cpu

# values that stress the quantizer: signed zeros, fp16 subnormal ranges, near the fp16 max
# (65280 is exact in bf16 as well), a constant
SPECIALS = (0.0, -0.0, 65280.0, -65280.0, 6e-8, -6e-8, 1e-9, 1.25, 3.0e4)


def kv_with_specials(dims: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float,
                     special_frac: float) -> torch.Tensor:
    """Random [L, 2, H, T, D] tensor; some entries replaced by SPECIALS, some token rows
    constant, one row all -0.0."""
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal(dims) * scale, -65280, 65280).astype(np.float32)
    pick = rng.random(dims) < special_frac
    x[pick] = rng.choice(np.array(SPECIALS, np.float32), size=int(pick.sum()))
    flat = x.reshape(-1, dims[-1])
    rows = rng.choice(flat.shape[0], size=max(1, flat.shape[0] // 5), replace=False)
    flat[rows[::2]] = rng.choice(np.array(SPECIALS, np.float32))  # constant rows
    flat[rows[0]] = -0.0
    return torch.from_numpy(x).to(dtype)


def payloads(enc: Encoded) -> list[bytes]:
    return [c.payload.tobytes() for c in enc.streams[0]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([4, 8, 16, 32]),
       ngroups=st.integers(1, 3), whole=st.booleans(), layers=st.integers(1, 2),
       heads=st.integers(1, 2), tokens=st.integers(1, 40), page_tokens=st.integers(1, 16),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 2**31), scale=st.sampled_from([1e-6, 1.0, 300.0, 2e4]),
       special_frac=st.sampled_from([0.0, 0.05, 0.5]))
def test_cpu_backend_same_bytes_and_tensors_as_torch(bits, group, ngroups, whole, layers, heads,
                                                     tokens, page_tokens, dtype, seed, scale,
                                                     special_frac):
    dims = (layers, 2, heads, tokens, group * ngroups)
    kv = kv_with_specials(dims, dtype, seed, scale, special_frac)
    params = {"bits": bits, "group": 0 if whole else group, "page_tokens": page_tokens}
    ref_codec = make_codec("uniform", {**params, "backend": "torch"})
    cpu_codec = make_codec("uniform", {**params, "backend": "cpu"})
    ref, got = ref_codec.encode(kv), cpu_codec.encode(kv)
    assert payloads(got) == payloads(ref)
    np.testing.assert_array_equal(got.chunk_bytes(), cpu_codec.size_table(got.shape).chunk_bytes)
    back = Encoded.from_bytes(got.to_bytes())
    for out_dtype in (None, torch.float32, torch.bfloat16, torch.float16):
        a = ref_codec.decode(ref, dtype=out_dtype)
        b = cpu_codec.decode(back, dtype=out_dtype)
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                           b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32))


def test_fp16_bit_conversions_match_torch():
    # every fp16 bit pattern -> fp32 bits, exactly as torch .float()
    h = np.arange(1 << 16, dtype=np.int64)
    want = torch.from_numpy(h.astype(np.uint16).view(np.int16)).view(torch.float16).float()
    want_bits = want.view(torch.int32).numpy().view(np.uint32)
    finite = np.isfinite(want.numpy())
    got = np.array([uniform_cpu.f16_bits_to_f32_bits(int(v)) for v in h[finite]], np.uint32)
    np.testing.assert_array_equal(got, want_bits[finite])
    # fp32 -> fp16 round to nearest even (ties, subnormals, overflow to inf), as torch .half()
    rng = np.random.default_rng(1)
    x = np.concatenate([
        (rng.standard_normal(3000) * 10.0 ** rng.integers(-9, 5, 3000)).astype(np.float32),
        np.array([0.0, -0.0, 65504, 65519.99, 65520, -65520, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                  2.0**-26, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 6.1e-5, -6.1e-5, 1e30],
                 np.float32)])
    want16 = torch.from_numpy(x).half().view(torch.int16).numpy().view(np.uint16)
    got16 = np.array([uniform_cpu.f32_bits_to_f16_bits(int(u)) for u in x.view(np.uint32)],
                     np.uint16)
    np.testing.assert_array_equal(got16, want16)


def test_cpu_backend_refuses_values_beyond_fp16():
    kv = torch.zeros(1, 2, 1, 4, 64)
    kv[0, 1, 0, 3, 7] = -7e4
    with pytest.raises(ValueError, match="fp16 range"):
        make_codec("uniform", {"bits": 8, "backend": "cpu"}).encode(kv)
    with pytest.raises(ValueError, match="not a multiple of the group"):
        uniform_cpu.encode_cpu(torch.zeros(1, 2, 1, 4, 60), 4, 16, 4, 1, 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("bits", [8, 4])
def test_nonfinite_bf16_rejected_by_the_kernel(bad, bits):
    """bf16 input: the kernel's int16-key min / max is the finite check (Codec.encode skips
    its own pass) and raises the same error; fp32 input keeps Codec.encode's check."""
    kv = torch.randn(2, 2, 2, 20, 64).to(torch.bfloat16)
    kv[1, 0, 1, 17, 40] = bad
    c = make_codec("uniform", {"bits": bits, "page_tokens": 8, "backend": "cpu"})
    assert c._kernel_checks_finite(kv) and not c._kernel_checks_finite(kv.float())
    where = "non-finite value.*first at index \\(1, 0, 1, 17, 40\\)"
    for x in (kv, kv.float()):
        with pytest.raises(ValueError, match=where):
            c.encode(x)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([8, 16, 32, 64]),
       tokens=st.integers(1, 30), page_tokens=st.integers(1, 16), seed=st.integers(0, 2**31),
       raw=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=64))
def test_cpu_backend_any_finite_bf16_bits(bits, group, tokens, page_tokens, seed, raw):
    """Arbitrary finite bf16 bit patterns (subnormals, signed zeros, the whole exponent range
    within fp16's) through the int16-key path: same bytes and decodes as the reference."""
    pool = np.array(raw, np.uint16)
    pool = pool[(pool & 0x7F80) != 0x7F80]  # finite
    if pool.size == 0:
        pool = np.array([0x8000], np.uint16)
    rng = np.random.default_rng(seed)
    bits_arr = rng.choice(pool, size=(1, 2, 2, tokens, 2 * group))
    kv = torch.from_numpy(bits_arr.view(np.int16)).view(torch.bfloat16)
    kv = kv.clamp(-65280, 65280)  # the fp16 scales' range (beyond: refused by both)
    params = {"bits": bits, "group": group, "page_tokens": page_tokens}
    ref = make_codec("uniform", {**params, "backend": "torch"})
    cpu = make_codec("uniform", {**params, "backend": "cpu"})
    a, b = ref.encode(kv), cpu.encode(kv)
    assert payloads(a) == payloads(b)
    for out in (None, torch.float32, torch.float16):
        x, y = ref.decode(a, dtype=out), cpu.decode(b, dtype=out)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_decode_reads_adjacent_chunks_in_place():
    """A local encode's chunks are slices of one buffer: decoded without joining them; the
    same chunks from the wire decode the same."""
    kv = torch.randn(2, 2, 2, 40, 64).to(torch.bfloat16)
    c = make_codec("uniform", {"bits": 4, "page_tokens": 16, "backend": "cpu"})
    enc = c.encode(kv)
    back = Encoded.from_bytes(enc.to_bytes())
    assert torch.equal(c.decode(enc).view(torch.int16), c.decode(back).view(torch.int16))


def test_auto_backend_runs_the_cpu_kernel_on_cpu_tensors(monkeypatch):
    assert use_cpu("auto", torch.device("cpu"))
    assert not use_cpu("auto", torch.device("cuda"))
    assert not use_cpu("torch", torch.device("cpu"))
    calls = []
    real = uniform_cpu.encode_cpu

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(uniform_cpu, "encode_cpu", spy)
    kv = torch.randn(1, 2, 2, 9, 32).to(torch.bfloat16)
    auto = make_codec("uniform", {"bits": 4, "group": 16, "page_tokens": 4}).encode(kv)
    assert calls
    ref = make_codec("uniform", {"bits": 4, "group": 16, "page_tokens": 4,
                                 "backend": "torch"}).encode(kv)
    assert payloads(auto) == payloads(ref)
