"""uniform codec (int8/int4) and its Triton quantize+pack / unpack+dequantize kernels."""

from __future__ import annotations

import pytest
import torch
from codec_checks import wire_round_trip

from kvsim.core.layout import KVShape
from kvsim.kernels import hadamard_triton
from kvsim.kernels.codec import CodecError, make_codec
from kvsim.kernels.groupquant import dequantize_groups, quantize_groups
from kvsim.kernels.uniform import triton as ut


def rows_with_edge_cases(rows: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[rows, n] random data plus a constant row, a zero row and a row with one spike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 3 + 0.5
    x[0] = 1.25  # constant -> every group has max == min
    x[1] = 0.0
    x[2, n // 2] = 900.0
    return x.to(dtype)


def payloads(enc) -> list[bytes]:
    return [c.payload.tobytes() for c in enc.streams[0]]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dims,group,page_tokens", [((2, 3, 75, 48), 16, 32),
                                                    ((1, 2, 19, 96), 48, 256),
                                                    ((3, 1, 17, 64), 64, 5)])
def test_wire_kernels_match_reference_bit_for_bit(bits, dims, group, page_tokens, kernel_device):
    """One launch writes every chunk's payload where the wire has it (irregular shapes: a
    short last page, a page of 5 tokens, a group of 48); decode reads it back exactly."""
    layers, heads, tokens, head_dim = dims
    params = {"bits": bits, "group": group, "page_tokens": page_tokens}
    ref = make_codec("uniform", {**params, "backend": "torch"})
    tri = make_codec("uniform", {**params, "backend": "triton"})
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        kv = torch.stack([rows_with_edge_cases(2 * heads * tokens, head_dim, dtype,
                                               seed=bits + layer).reshape(2, heads, tokens,
                                                                          head_dim)
                          for layer in range(layers)])
        want = ref.encode(kv)
        got = tri.encode(kv.to(kernel_device))
        assert payloads(got) == payloads(want), f"{dtype} {bits}-bit differs"
        assert torch.equal(tri.decode(got, dtype=torch.float32),
                           ref.decode(want, dtype=torch.float32))
        buffers = tri.encode_device(kv.to(kernel_device)).buffers
        assert torch.equal(tri.decode_device(buffers, KVShape.of(kv), torch.float32).cpu(),
                           ref.decode(want, dtype=torch.float32))


# the interpreter casts -7e4 to fp16 in numpy (-inf, with a warning) before the kernel's
# count refuses it: the warning is the point of the test, not a fault
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_wire_kernel_refuses_what_the_reference_refuses(kernel_device):
    """The kernel counts NaN / Inf and values beyond fp16 on the device; encode() raises the
    reference's errors from those counts."""
    tri = make_codec("uniform", {"bits": 4, "group": 16, "backend": "triton"})
    kv = torch.zeros(1, 2, 1, 8, 16)
    kv[0, 1, 0, 5, 2] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite.*\(0, 1, 0, 5, 2\)"):
        tri.encode(kv.to(kernel_device))
    kv[0, 1, 0, 5, 2] = -7e4
    with pytest.raises(ValueError, match="fp16 range"):
        tri.encode(kv.to(kernel_device))
    dw = tri.encode_device(kv.to(kernel_device), verify=False)  # the check is left for later
    with pytest.raises(ValueError, match="fp16 range"):
        dw.verify(kv)


def test_kernel_rejects_bad_group():
    with pytest.raises(ValueError, match="multiple of the group"):
        ut.encode_wire(torch.zeros(1, 2, 1, 3, 10), 4, 4, 256, 1, 1)
    with pytest.raises(ValueError, match="multiple of 4"):
        ut.encode_wire(torch.zeros(1, 2, 1, 3, 12), 6, 2, 256, 1, 1)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_bound_half_step(bits):
    x = torch.randn(64, 128, dtype=torch.float64).to(torch.float32) * 4
    codes, s16, z16 = quantize_groups(x, 32, bits)
    xh = dequantize_groups(codes, s16, z16, 32)
    xg = x.view(64, 4, 32)
    mn, mx = xg.amin(-1), xg.amax(-1)
    s_exact = (mx - mn) / (2**bits - 1)
    s, z = s16.float(), z16.float()
    # half a step, plus the fp16 rounding of the zero point and of the scale (x qmax)
    bound = s / 2 + (mn - z).abs() + (2**bits - 1) * (s - s_exact).abs() + 1e-6
    err = (xh - x).view(64, 4, 32).abs().amax(-1)
    assert (err <= bound).all()
    assert codes.max() <= 2**bits - 1


def test_constant_groups_no_nan():
    x = torch.full((4, 64), 3.0)
    x[1] = 0.0
    x[2] = 1e-9  # range underflows fp16 scale
    codes, s16, z16 = quantize_groups(x, 32, 4)
    xh = dequantize_groups(codes, s16, z16, 32)
    assert torch.isfinite(xh).all()
    assert torch.equal(codes, torch.zeros_like(codes))
    assert torch.allclose(xh, x, atol=1e-3)


def kv_sample(shape: KVShape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape.dims, generator=g)
    kv[:, 0, :, :, 3] *= 20  # an outlier key channel
    return kv.to(getattr(torch, shape.dtype))


def rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b) ** 2).sum() / (a**2).sum())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_codec_round_trip_sizes_and_order(dtype):
    shape = KVShape(2, 3, 75, 64, dtype)
    kv = kv_sample(shape)
    errs = {}
    for bits in (8, 4):
        codec = make_codec("uniform", {"bits": bits, "group": 32, "page_tokens": 32})
        _, out = wire_round_trip(codec, kv)
        assert out.dtype == kv.dtype and out.shape == kv.shape
        errs[bits] = rel_mse(kv, out)
    assert errs[8] < errs[4] / 50
    assert errs[4] < 0.02


def test_bits_per_element_int8_int4():
    shape = KVShape(1, 2, 256, 128)
    kv = kv_sample(shape)
    for bits, group, expect in ((8, 64, 8 + 32 / 64), (4, 64, 4 + 32 / 64), (4, 128, 4.25)):
        enc = make_codec("uniform", {"bits": bits, "group": group}).encode(kv)
        payload_bits = 8 * sum(c.payload_bytes for c in enc.streams[0]) / shape.numel
        assert payload_bits == pytest.approx(expect)


def test_triton_backend_same_bytes_as_torch(kernel_device):
    shape = KVShape(1, 2, 40, 32, "bfloat16")
    kv = kv_sample(shape, 3)
    a = make_codec("uniform", {"bits": 4, "group": 16, "backend": "torch"}).encode(kv)
    b_codec = make_codec("uniform", {"bits": 4, "group": 16, "backend": "triton"})
    b = b_codec.encode(kv.to(kernel_device))
    assert a.to_bytes()[-200:] == b.to_bytes()[-200:]  # preambles differ only in `backend`
    assert [c.payload.tobytes() for c in a.streams[0]] == [c.payload.tobytes()
                                                          for c in b.streams[0]]
    assert torch.equal(b_codec.decode(b, device=kernel_device).cpu(),
                       make_codec("uniform", {"bits": 4, "group": 16,
                                              "backend": "torch"}).decode(a))


def test_triton_backend_on_a_cpu_tensor_without_interpreter_is_a_clear_error(monkeypatch,
                                                                             kernel_device):
    """Launched on CPU pointers without TRITON_INTERPRET, Triton fails inside its launcher; the
    wrappers refuse first and say what to use instead."""
    codec = make_codec("uniform", {"bits": 4, "group": 16, "backend": "triton"})
    kv = kv_sample(KVShape(1, 1, 8, 32, "bfloat16"), 0)
    enc = codec.encode(kv.to(kernel_device))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(CodecError, match="uniform triton backend needs a CUDA tensor.*'cpu'"):
        codec.encode(kv)
    with pytest.raises(CodecError, match="needs a CUDA tensor"):
        codec.decode(enc)
    with pytest.raises(CodecError, match="Hadamard kernel needs a CUDA tensor"):
        hadamard_triton.hadamard(torch.ones(4, 32))


def test_bad_shapes_and_range():
    codec = make_codec("uniform", {"bits": 4, "group": 48})
    with pytest.raises(ValueError, match="not a multiple of the group"):
        codec.encode(torch.zeros(1, 2, 1, 4, 64))
    big = torch.zeros(1, 2, 1, 4, 64)
    big[0, 0, 0, 0, 0] = 1e6
    with pytest.raises(ValueError, match="fp16 range"):
        make_codec("uniform", {"bits": 8}).encode(big)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_wire_kernels_match_reference(bits):
    """Compiled kernels (not the interpreter): bf16 read directly, bf16 written directly."""
    shape = KVShape(2, 4, 300, 128)
    kv = kv_sample(shape)
    ref = make_codec("uniform", {"bits": bits, "backend": "torch"})
    tri = make_codec("uniform", {"bits": bits, "backend": "triton"})
    want = ref.encode(kv)
    got = tri.encode(kv.cuda())
    assert payloads(got) == payloads(want)
    buffers = tri.encode_device(kv.cuda()).buffers
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(tri.decode_device(buffers, shape, dtype).cpu(),
                           ref.decode(want, dtype=dtype))


@pytest.mark.gpu
def test_gpu_codec_auto_backend_same_bytes():
    shape = KVShape(2, 4, 300, 128)
    kv = kv_sample(shape)
    codec = make_codec("uniform", {"bits": 4})
    a = codec.encode(kv)
    b = codec.encode(kv.cuda())
    assert a.to_bytes() == b.to_bytes()
    assert torch.equal(codec.decode(a, device="cuda").cpu(), codec.decode(a))


# ---- scale scopes: per-token (group 0) and per-tensor ---------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_per_tensor_scope_one_scale_per_layer_and_kv(bits):
    shape = KVShape(2, 3, 75, 16, "float32")
    kv = kv_sample(shape, 5)
    kv[1, 1] = 0.25  # layer 1's V is constant: scale 0, decoded exactly
    codec = make_codec("uniform", {"bits": bits, "scope": "tensor", "page_tokens": 32})
    enc, out = wire_round_trip(codec, kv)
    qmax = (1 << bits) - 1
    for c in enc.streams[0]:  # every chunk carries its layer's K and V scale / zero point
        t = c.payload.nbytes - 8
        scale = c.payload[t: t + 4].view("<f2")
        zero = c.payload[t + 4:].view("<f2")
        layer = kv[c.layer].float().reshape(2, -1)
        want_scale = ((layer.amax(-1) - layer.amin(-1)) / qmax).half().numpy()
        assert (scale == want_scale).all() and (zero == layer.amin(-1).half().numpy()).all()
    assert torch.equal(out[1, 1], kv[1, 1])
    # error bound: half a step of the layer's scale (+ fp16 rounding of the zero point)
    step = (kv.reshape(2, 2, -1).amax(-1) - kv.reshape(2, 2, -1).amin(-1)) / qmax
    err = (out - kv).abs().reshape(2, 2, -1).amax(-1)
    assert (err <= step * 0.5 + 1e-3 + step * 1e-3).all()


def test_per_tensor_is_coarser_than_per_token_is_coarser_than_groups():
    shape = KVShape(1, 4, 256, 64)
    kv = kv_sample(shape, 7)
    kv[0, 0, :, :, 5] *= 10.0  # an outlier key channel, as in real caches
    err, bits = {}, {}
    for label, params in (("g16", {"group": 16}), ("token", {"group": 0}),
                          ("tensor", {"scope": "tensor"})):
        enc = make_codec("uniform", {"bits": 4, **params}).encode(kv)
        err[label] = rel_mse(kv, make_codec("uniform", {"bits": 4, **params}).decode(enc))
        bits[label] = 8 * sum(c.payload_bytes for c in enc.streams[0]) / shape.numel
    assert err["g16"] < err["token"] < err["tensor"]
    assert bits["tensor"] < bits["token"] < bits["g16"]
    assert bits["token"] == pytest.approx(4 + 32 / 64)
    assert bits["tensor"] == pytest.approx(4 + 8 * 8 / (2 * 4 * 256 * 64))  # 8 bytes per chunk


@pytest.mark.parametrize("backend", ["auto", "cpu", "triton"])
def test_per_tensor_every_backend_runs_the_reference(backend):
    shape = KVShape(2, 2, 40, 32, "bfloat16")
    kv = kv_sample(shape, 3)
    ref = make_codec("uniform", {"bits": 4, "scope": "tensor", "backend": "torch"})
    other = make_codec("uniform", {"bits": 4, "scope": "tensor", "backend": backend})
    a, b = ref.encode(kv), other.encode(kv)
    assert [c.payload.tobytes() for c in a.streams[0]] == [c.payload.tobytes()
                                                          for c in b.streams[0]]
    assert torch.equal(other.decode(b), ref.decode(a))


def test_scope_is_checked():
    with pytest.raises(ValueError, match="scope"):
        make_codec("uniform", {"scope": "channel"})
    with pytest.raises(ValueError, match="head_dim 6 must be a multiple of 4"):
        make_codec("uniform", {"bits": 2, "scope": "tensor"}).encode(torch.zeros(1, 2, 1, 4, 6))
