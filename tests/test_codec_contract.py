"""Contract every registered codec keeps (parametrized over kvsim.kernels.codec.codec_names()).

Shapes are small (a few thousand elements) so the whole matrix stays fast on CPU.
"""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest
import torch

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import CodecError, codec_names, make_codec
from kvsim.kernels.encoded import Encoded
from kvsim.kernels.presets import resolve_codec
from kvsim.kernels.wire import CHUNK_HEADER_BYTES, WireError

# the codecs kvsim ships (test modules register size-only "test-*" codecs of their own)
NAMES = [n for n in codec_names() if not n.startswith("test-")]
# (layers, kv_heads, tokens, head_dim): multi-page irregular, tiny, a single token
SHAPES = [(2, 2, 300, 32), (1, 2, 5, 16), (1, 1, 1, 32)]


def sample(shape: tuple[int, int, int, int], dtype: torch.dtype = torch.bfloat16,
           seed: int = 0) -> torch.Tensor:
    layers, heads, tokens, d = shape
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, heads, tokens, d, generator=g)
    kv[:, 0, :, :, 1] += 4.0  # an outlier key channel
    kv[:, :, :, :1] *= 0.1  # a low-norm first token
    return kv.to(dtype)


def rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b) ** 2).sum() / (a**2).sum().clamp_min(1e-30))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_and_exact_sizes(name, shape):
    codec = make_codec(name)
    kv = sample(shape)
    enc = codec.encode(kv)
    blob = enc.to_bytes()
    back = Encoded.from_bytes(blob)
    out = codec.decode(back)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    assert torch.isfinite(out).all()
    assert torch.equal(out, codec.decode(enc))
    assert rel_mse(kv, out) < 0.5  # every codec keeps most of the signal
    table = codec.size_table(KVShape.of(kv))
    assert len(blob) == enc.total_bytes
    if codec.exact_sizes:
        assert table.total_bytes == len(blob)
        np.testing.assert_array_equal(table.chunk_bytes, enc.chunk_bytes())
    else:  # estimates must at least name the same chunks
        np.testing.assert_array_equal(table.chunk_bytes > 0, enc.chunk_bytes() > 0)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_bytes(name):
    codec = make_codec(name)
    kv = sample(SHAPES[0], seed=5)
    assert codec.encode(kv).to_bytes() == make_codec(name).encode(kv.clone()).to_bytes()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_refused(name, bad):
    kv = sample(SHAPES[1])
    kv[0, 1, 0, 2, 3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        make_codec(name).encode(kv)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_constant_zero_and_dtypes_no_nan(name, dtype):
    codec = make_codec(name)
    cases = {
        "zeros": torch.zeros(1, 2, 2, 40, 32, dtype=dtype),
        "constant": torch.full((1, 2, 2, 40, 32), -2.5, dtype=dtype),
        "single token": sample((1, 2, 1, 32), dtype),
        "random": sample((1, 2, 40, 32), dtype, seed=2),
    }
    for what, kv in cases.items():
        out = codec.decode(Encoded.from_bytes(codec.encode(kv).to_bytes()))
        assert out.dtype == dtype, what
        assert torch.isfinite(out).all(), f"{name}: {what} {dtype} decoded to NaN/Inf"
        if what in ("zeros", "constant"):
            assert torch.allclose(out.float(), kv.float(), atol=1e-2), what


@pytest.mark.parametrize("name", NAMES)
def test_decode_each_stream_prefix(name):
    codec = make_codec(name)
    kv = sample(SHAPES[0], seed=1)
    enc = codec.encode(kv)
    errs = []
    for k in range(1, codec.num_streams + 1):
        out = codec.decode(enc, streams=k)
        assert out.shape == kv.shape and torch.isfinite(out).all()
        errs.append(rel_mse(kv, out))
    assert errs[-1] <= min(errs) + 1e-9  # all streams are at least as good as any prefix
    with pytest.raises(CodecError):
        codec.decode(enc, streams=codec.num_streams + 1)


@pytest.mark.parametrize("name", NAMES)
def test_missing_chunk_is_codec_error(name):
    codec = make_codec(name)
    enc = codec.encode(sample(SHAPES[0]))
    enc.streams[0] = enc.streams[0][:-1]
    with pytest.raises(CodecError, match="missing"):
        codec.decode(enc)


@pytest.mark.parametrize("name", NAMES)
def test_corrupt_bytes_are_wire_error(name):
    codec = make_codec(name)
    enc = codec.encode(sample(SHAPES[1]))
    blob = bytearray(enc.to_bytes())
    first_payload = enc.header_bytes + CHUNK_HEADER_BYTES
    blob[first_payload] ^= 0xFF  # flip the first payload byte: crc32 must catch it
    with pytest.raises(WireError):
        Encoded.from_bytes(bytes(blob))
    with pytest.raises(WireError):
        Encoded.from_bytes(bytes(blob[: len(blob) // 2 + 3]))  # truncated


@pytest.mark.parametrize("name", NAMES)
def test_params_mismatch_is_codec_error(name):
    enc = make_codec(name).encode(sample(SHAPES[1]))
    enc.params = {**enc.params, "page_tokens": -7}
    with pytest.raises(CodecError):
        make_codec(name).decode(enc)


@pytest.mark.parametrize("preset", ["int8", "int4", "int8-token", "int4-token", "int8-tensor",
                                    "int4-tensor", "kivi-2", "kivi-2-kivi-window",
                                    "kivi-4-kivi-window", "kivi-4", "kcvt-4", "gear",
                                    "gear-l", "gear-seq", "gear-l-seq", "gear-exact",
                                    "gear-paper", "oscar"])
def test_presets_build_and_order(preset):
    spec = resolve_codec(preset)
    codec = spec.build()
    shape = KVShape(1, 2, 300, 64)
    table = codec.size_table(shape)
    assert 0 < table.total_bytes < shape.bf16_bytes


def test_preset_error_ordering():
    kv = sample((1, 2, 400, 64), torch.float32, seed=9)
    err = {p: rel_mse(kv, (c := resolve_codec(p).build()).decode(c.encode(kv)))
           for p in ("int8", "int4", "kivi-2", "gear")}
    assert err["int8"] < err["int4"] < err["kivi-2"]
    assert err["gear"] < err["kivi-2"]


# ---- untrusted input: every decoder validates before it reads --------------------------
def _replace_payload(enc: Encoded, stream: int, index: int, payload: np.ndarray) -> str:
    """Swap one chunk's payload in place; return its '(stream s, layer l, page p)'."""
    c = enc.streams[stream][index]
    c.payload = payload
    return f"(stream {stream}, layer {c.layer}, page {c.page})"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("size", [0, 1, "short", "long"])
def test_wrong_payload_length_is_codec_error(name, size):
    codec = make_codec(name)
    for s in range(codec.num_streams):
        broken = codec.encode(sample(SHAPES[0]))
        good = broken.streams[s][-1].payload
        n = {"short": good.size - 1, "long": good.size + 1}.get(size, size)
        bad = np.resize(good, n).astype(np.uint8)
        where = _replace_payload(broken, s, -1, bad)
        with pytest.raises(CodecError, match=re.escape(where)):
            codec.decode(broken)


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_metadata_is_codec_error(name):
    """A payload of 0xFF bytes: every fp16 / bf16 / fp32 field in it is NaN."""
    codec = make_codec(name)
    enc = codec.encode(sample(SHAPES[0]))
    c = enc.streams[0][1]
    where = _replace_payload(enc, 0, 1, np.full(c.payload.size, 0xFF, dtype=np.uint8))
    with pytest.raises(CodecError, match=re.escape(where)):
        codec.decode(enc)


@pytest.mark.parametrize("name", NAMES)
def test_duplicate_or_misfiled_chunk_is_codec_error(name):
    codec = make_codec(name)
    enc = codec.encode(sample(SHAPES[0]))
    enc.streams[0].append(dataclasses.replace(enc.streams[0][0]))
    with pytest.raises(CodecError, match="duplicate chunk"):
        codec.decode(enc)
    with pytest.raises(WireError, match="duplicate chunk"):
        codec.encode(sample(SHAPES[0])).add_chunk(enc.streams[0][0])
    enc = codec.encode(sample(SHAPES[0]))
    enc.streams[0][0].stream = 1
    with pytest.raises(CodecError, match="says stream 1"):
        codec.decode(enc)


@pytest.mark.parametrize("name", NAMES)
def test_forged_preamble_is_refused_fast(name):
    """A preamble claiming 10^6 times the tokens (and every chunk short of it) is refused by
    counting, before any per-page work; shapes past the decoder's limits by arithmetic."""
    codec = make_codec(name)
    enc = codec.encode(sample(SHAPES[0]))
    enc.shape = dataclasses.replace(enc.shape, tokens=enc.shape.tokens * 10**6)
    t = time.perf_counter()
    with pytest.raises(CodecError, match="limit"):
        codec.decode(enc)
    enc.shape = dataclasses.replace(enc.shape, tokens=4_000_000, layers=1)
    with pytest.raises(CodecError, match="missing"):
        codec.decode(enc)
    assert time.perf_counter() - t < 1.0
    enc = codec.encode(sample(SHAPES[0]))
    enc.page_tokens += 1
    with pytest.raises(CodecError, match="page_tokens"):
        codec.decode(enc)


# ---- fp16 / bf16 extremes: finite input decodes to finite output ------------------------
BF16_BELOW_FP16_MAX = 65280.0  # the largest bf16 value within fp16's range


def extreme(dtype: torch.dtype, peak: float, seed: int = 0) -> torch.Tensor:
    """[1, 2, 2, 300, 32]: random signs at +-peak, every other token; a constant +peak row,
    a constant -peak row; the rest gaussian (so groups mix extremes and small values)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(1, 2, 2, 300, 32, generator=g)
    sign = torch.where(torch.rand(kv.shape, generator=g) < 0.5, -1.0, 1.0)
    kv[:, :, :, ::2] = sign[:, :, :, ::2] * peak
    kv[:, :, :, 5] = peak
    kv[:, :, :, 7] = -peak
    return kv.to(dtype)


def _peak(name: str, dtype: torch.dtype) -> float:
    if name in ("bf16", "lynx") and dtype == torch.bfloat16:
        return float(torch.finfo(torch.bfloat16).max)  # no fp16 metadata: bf16's own max
    return 65504.0 if dtype == torch.float16 else BF16_BELOW_FP16_MAX


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extremes_decode_finite(name, dtype):
    """Values at the largest magnitude a codec accepts (fp16: +-65504; bf16: its max, or the
    largest bf16 within fp16 for codecs with fp16 scales) decode to finite values, in the
    cache's dtype and in fp16, within the codec's usual error."""
    codec = make_codec(name, {"scale_values": True} if name == "oscar" else None)
    kv = extreme(dtype, _peak(name, dtype))
    enc = Encoded.from_bytes(codec.encode(kv).to_bytes())
    for out_dtype in (None, torch.float16, torch.float32):
        out = codec.decode(enc, dtype=out_dtype)
        assert torch.isfinite(out).all(), f"{name} {dtype} -> {out_dtype}: NaN/Inf"
        if out_dtype == torch.float16:
            assert float(out.float().abs().max()) <= 65504.0
    peak = _peak(name, dtype)  # relative error, computed where squares cannot overflow
    assert rel_mse(kv.float() / peak, codec.decode(enc).float() / peak) < 0.5


def test_oscar_refuses_rotated_values_beyond_fp16():
    """Without scale_values, the Hadamard rotation can grow a token's values past fp16 (the
    V scales would be inf): refused with the way out in the message."""
    kv = extreme(torch.float16, 65504.0)
    with pytest.raises(ValueError, match="scale_values=True"):
        make_codec("oscar").encode(kv)
    out = make_codec("oscar").decode(make_codec("oscar").encode(kv / 64))
    assert torch.isfinite(out).all()
