"""The device path: codecs that encode a whole cache into wire-ordered buffers on its device
(kvsim.kernels.device_wire), checked against the bytes of their reference backends; the
staging copies and the bench's device timings on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import CodecError, make_codec
from kvsim.kernels.device_wire import stream_offsets


def kv_sample(dims: tuple[int, ...], dtype: torch.dtype = torch.bfloat16,
              seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((dims[0], 2, *dims[1:]), generator=g) * 2  # dims: (L, H, T, D)
    kv[:, 0, :, :, 1] *= 15  # an outlier key channel
    return kv.to(dtype)


def payloads(enc) -> list[list[tuple[int, int, bytes]]]:
    return [[(c.layer, c.page, c.payload.tobytes()) for c in s] for s in enc.streams]


def test_stream_offsets_lay_chunks_end_to_end_in_layer_page_order():
    sizes = np.array([[[10, 10, 4], [10, 10, 4]],
                      [[3, -1, 2], [5, 5, -1]]])  # stream 1: two absent chunks
    (start0, size0, total0), (start1, size1, total1) = stream_offsets(sizes)
    assert start0.tolist() == [[0, 10, 20], [24, 34, 44]] and total0 == 48
    assert start1.tolist() == [[0, 3, 3], [5, 10, 15]] and total1 == 15
    assert size1.tolist() == [[3, 0, 2], [5, 5, 0]]


# (codec, params, reference params): the device path of each family against the backend
# that is its specification
CASES = [
    ("bf16", {"page_tokens": 32}, None),
    ("uniform", {"bits": 4, "group": 32, "page_tokens": 32, "backend": "triton"},
     {"backend": "torch"}),
    ("kivi", {"bits": 2, "group": 16, "value_group": 16, "residual": 32, "page_tokens": 64,
              "backend": "triton"}, {"backend": "torch"}),
    ("kivi", {"bits": 4, "group": 16, "value_group": 0, "residual": 32, "page_tokens": 64,
              "window": "kivi", "backend": "triton"}, {"backend": "torch"}),
    # kcvt: each key channel's scale over every quantized token, across pages (150 - 22 =
    # 128 quantized: 2-bit rows fill their bytes); 4-bit with no window; 8-bit, any count
    ("kcvt", {"bits": 2, "residual": 22, "page_tokens": 64, "backend": "triton"},
     {"backend": "torch"}),
    ("kcvt", {"bits": 4, "page_tokens": 64, "backend": "triton"}, {"backend": "torch"}),
    ("kcvt", {"bits": 8, "residual": 7, "page_tokens": 64, "backend": "triton"},
     {"backend": "torch"}),
    # oscar: kivi's kernels on the rotated, norm-scaled tokens (112 of 150 quantized)
    ("oscar", {"bits": 2, "group": 16, "value_group": 16, "residual": 32, "page_tokens": 64,
               "backend": "triton"}, {"backend": "torch"}),
    ("oscar", {"bits": 4, "group": 16, "residual": 32, "page_tokens": 64,
               "scale_values": True, "backend": "triton"}, {"backend": "torch"}),
    # gear: outliers and per-page fits batched on the device around the backbone's kernels
    # (kivi: 112 quantized tokens, a full page and a 48-token one; kcvt: 130, 64 + 64 + 2)
    ("gear", {"bits": 2, "group": 16, "value_group": 16, "residual": 32, "page_tokens": 64,
              "rank": 3, "backend": "triton"}, {"backend": "torch"}),
    ("gear", {"backbone": "kcvt", "bits": 4, "residual": 20, "page_tokens": 64, "rank": 2,
              "outlier_pct": 5.0, "backend": "triton"}, {"backend": "torch"}),
    ("gear-l", {"bits": 4, "group": 16, "value_group": 0, "residual": 16, "page_tokens": 32,
                "rank": 4, "backend": "triton"}, {"backend": "torch"}),
    # rank-1 factors (a one-page run's field with a last dimension of one); kcvt at 8 bits
    # with a page of one quantized token (150 - 21 = 129 = 2 x 64 + 1)
    ("gear", {"bits": 2, "group": 16, "value_group": 16, "residual": 32, "page_tokens": 64,
              "rank": 1, "backend": "triton"}, {"backend": "torch"}),
    ("gear", {"backbone": "kcvt", "bits": 8, "residual": 21, "page_tokens": 64, "rank": 3,
              "backend": "triton"}, {"backend": "torch"}),
    ("lynx", {"page_tokens": 64, "backend": "triton"}, {"backend": "torch"}),
    ("lynx", {"page_tokens": 64, "split": [2, 2, 4], "backend": "triton"},
     {"backend": "torch"}),
    ("lynx", {"page_tokens": 64, "precondition": "oscar", "backend": "triton"},
     {"backend": "torch"}),
]


@pytest.mark.parametrize("name,params,ref_params", CASES)
def test_device_path_gives_the_reference_bytes(name, params, ref_params, kernel_device):
    dims = (2, 2, 150, 64)  # a short last page (150 = 2 x 64 + 22)
    kv = kv_sample(dims)
    codec = make_codec(name, params)
    assert codec.has_device_path(torch.device(kernel_device), KVShape.of(kv))
    dw = codec.encode_device(kv.to(kernel_device))
    assert [b.device.type for b in dw.buffers] == [kernel_device] * codec.num_streams
    assert dw.nbytes == int(np.maximum(codec.payload_bytes(KVShape.of(kv)), 0).sum())
    enc = dw.to_encoded()
    ref = make_codec(name, {**params, **ref_params}) if ref_params else codec
    want = ref.encode(kv)
    assert payloads(enc) == payloads(want)
    assert enc.total_bytes == codec.size_table(KVShape.of(kv)).total_bytes
    for streams in range(1, codec.num_streams + 1):
        expect = ref.decode(want, streams=streams, dtype=torch.float32)
        got = codec.decode_device(dw.buffers[:streams], KVShape.of(kv), torch.float32)
        torch.testing.assert_close(got.cpu(), expect, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name,params,ref_params", CASES)
def test_compiled_device_path_gives_the_reference_bytes(name, params, ref_params):
    """The same on a GPU, compiled (bf16 read directly; decode written in bf16 directly)."""
    # (kcvt: 302 - 22 = 280 quantized tokens, whole bytes of 2-bit codes per key row)
    kv = kv_sample((2, 4, 302 if name == "kcvt" else 300, 128))
    shape = KVShape.of(kv)
    codec = make_codec(name, params)
    ref = make_codec(name, {**params, **ref_params}) if ref_params else codec
    want = ref.encode(kv)
    dw = codec.encode_device(kv.cuda())
    assert payloads(dw.to_encoded()) == payloads(want)
    for dtype in (torch.float32, torch.bfloat16):
        expect = ref.decode(want, dtype=dtype)
        got = codec.decode_device(dw.buffers, shape, dtype).cpu()
        # the receiver's way: the host's chunks joined in pinned memory, copied, decoded
        assert torch.equal(codec.decode(dw.to_encoded(), dtype=dtype, device="cuda").cpu(),
                           got)
        if name in ("lynx", "oscar"):  # as tests/test_lynx_triton.py: fp32 within 1e-6,
            # bf16 one ulp (oscar: the FWHT kernel rotates back, the reference on the host)
            rtol = 8e-3 if dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(got.float(), expect.float(), rtol=rtol, atol=1e-6)
        else:
            assert torch.equal(got, expect)


def test_bf16_device_path_rounds_other_dtypes_and_refuses_nan():
    codec = make_codec("bf16", {"page_tokens": 7})
    kv = kv_sample((2, 3, 20, 8), torch.float32)
    enc = codec.encode(kv)
    # chunk (l, p): kv[l, :, :, page] as bf16, C-order [2, H, t, D] (7, 7 and 6 tokens)
    for c in enc.streams[0]:
        page = kv[c.layer, :, :, 7 * c.page:7 * c.page + 7].to(torch.bfloat16).contiguous()
        assert c.payload.tobytes() == page.view(torch.int16).numpy().tobytes()
    assert [c.payload.size for c in enc.streams[0]] == [2 * 3 * 7 * 8 * 2] * 2 + [
        2 * 3 * 6 * 8 * 2] + [2 * 3 * 7 * 8 * 2] * 2 + [2 * 3 * 6 * 8 * 2]
    assert torch.equal(codec.decode(enc), kv.to(torch.bfloat16))
    kv[0, 1, 2, 19, 5] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite.*\(0, 1, 2, 19, 5\)"):
        codec.encode(kv)


def test_decode_device_refuses_a_buffer_of_the_wrong_size(kernel_device):
    codec = make_codec("uniform", {"bits": 4, "group": 32, "backend": "triton"})
    kv = kv_sample((1, 1, 40, 64))
    buf = codec.encode_device(kv.to(kernel_device)).buffers[0]
    with pytest.raises(CodecError, match="stream 0 buffer must be 1-D uint8 of"):
        codec.decode_device([buf[:-1]], KVShape.of(kv))


def test_oscar_device_path_refuses_rotated_values_beyond_fp16(kernel_device):
    """A value token within fp16 whose rotation is not (x 8 at head_dim 64): refused before
    any byte is written, as the reference refuses it."""
    codec = make_codec("oscar", {"bits": 2, "group": 16, "value_group": 16, "residual": 32,
                                 "page_tokens": 64, "backend": "triton"})
    kv = kv_sample((1, 1, 80, 64), torch.float32)
    kv[0, 1, 0, 3] = 60000.0
    assert codec.has_device_path(torch.device(kernel_device), KVShape.of(kv))
    with pytest.raises(ValueError, match="rotated values reach"):
        codec.encode_device(kv.to(kernel_device))


def test_kcvt_triton_falls_back_where_key_rows_do_not_fill_bytes():
    """bits 4 packs 2 codes a byte: 21 quantized tokens leave each key channel's row half a
    byte short, so there is no device path and 'triton' runs the reference (the bytes of
    backend 'torch')."""
    params = {"bits": 4, "residual": 3, "page_tokens": 8}
    kv = kv_sample((1, 2, 24, 8))
    tri = make_codec("kcvt", {**params, "backend": "triton"})
    assert not tri.has_device_path(kv.device, KVShape.of(kv))
    assert tri.has_device_path(kv.device, KVShape.of(kv[:, :, :, :23]))  # 20 quantized
    assert payloads(tri.encode(kv)) == payloads(make_codec("kcvt", {**params,
                                                                    "backend": "torch"})
                                                 .encode(kv))


def test_kivi_triton_falls_back_where_groups_do_not_fill_bytes():
    """bits 2 packs 4 codes a byte: a key group of 2 tokens has no device path, and the
    'triton' backend then runs the reference (same bytes as backend 'torch')."""
    params = {"bits": 2, "group": 2, "value_group": 4, "residual": 4, "page_tokens": 8,
              "window": "kivi"}
    kv = kv_sample((1, 1, 20, 8))
    tri = make_codec("kivi", {**params, "backend": "triton"})
    assert not tri.has_device_path(kv.device, KVShape.of(kv))
    assert payloads(tri.encode(kv)) == payloads(make_codec("kivi", {**params,
                                                                    "backend": "torch"})
                                                 .encode(kv))


def test_gear_device_path_with_wide_pages_stores_u16_indices(kernel_device):
    """Pages of more than 256 tokens index their key outliers in u16 (a full 288-token page,
    then a 96-token one): the device path writes and reads them as the reference does."""
    params = {"bits": 4, "group": 16, "value_group": 16, "residual": 16, "page_tokens": 288,
              "rank": 2, "outlier_pct": 1.0}
    kv = kv_sample((1, 1, 400, 32))
    shape = KVShape.of(kv)
    codec = make_codec("gear", {**params, "backend": "triton"})
    assert codec.has_device_path(torch.device(kernel_device), shape)
    assert [f.kind for f in codec.layout(shape, 0).fields if f.name == "ko_idx"] == ["u16"]
    dw = codec.encode_device(kv.to(kernel_device))
    ref = make_codec("gear", {**params, "backend": "torch"})
    want = ref.encode(kv)
    assert payloads(dw.to_encoded()) == payloads(want)
    got = codec.decode_device(dw.buffers, shape, torch.float32)
    assert torch.equal(got.cpu(), ref.decode(want, dtype=torch.float32))


@pytest.mark.gpu
def test_compiled_gear_picks_tied_outliers_as_the_reference():
    """Ties, +0.0 beside -0.0 among them, are picked lower index first (a stable sort) by
    the CPU reference; the device's sort must pick the same."""
    kv = kv_sample((1, 2, 300, 128))
    kv[:, 0, :, :, 3] = 0.0  # a key channel of zeros, a quarter of them -0.0
    kv[:, 0, :, ::4, 3] = -0.0
    kv[:, 1, :, 7] = 1.0  # a value token of ties
    params = {"bits": 2, "group": 32, "value_group": 32, "residual": 32, "page_tokens": 128,
              "rank": 2}
    want = make_codec("gear", {**params, "backend": "torch"}).encode(kv)
    dw = make_codec("gear", {**params, "backend": "triton"}).encode_device(kv.cuda())
    assert payloads(dw.to_encoded()) == payloads(want)


@pytest.mark.parametrize("params", [{"lowrank": "sequence"}, {"outlier_count": "exact"}])
def test_gear_triton_runs_the_reference_where_it_has_no_device_path(params):
    """Sequence-wide fits and 'exact' outlier counts have no device path: backend 'triton'
    gives the reference's bytes through it."""
    small = {"group": 8, "value_group": 8, "residual": 8, "page_tokens": 16, "rank": 2}
    kv = kv_sample((1, 1, 40, 16))
    tri = make_codec("gear", {**small, **params, "backend": "triton"})
    assert not tri.has_device_path(kv.device, KVShape.of(kv))
    assert payloads(tri.encode(kv)) == payloads(
        make_codec("gear", {**small, **params, "backend": "torch"}).encode(kv))


def test_gear_page_runs_group_pages_of_one_layout():
    """kcvt's page 0 carries the keys' scales (a layout of its own), the full pages after it
    form one evenly spaced run, the short page another; pages with no quantized tokens none."""
    from kvsim.kernels.kivi.page_runs import page_runs

    codec = make_codec("gear", {"backbone": "kcvt", "bits": 4, "residual": 40,
                                "page_tokens": 32})
    shape = KVShape.of(kv_sample((1, 1, 180, 16)))  # 140 quantized: 32 x 4 + 12
    geo, _, _ = codec.geometry(shape)
    runs = page_runs(geo)
    assert [(r.first, r.count, r.t0, r.q) for r in runs] == [(0, 1, 0, 32), (1, 3, 32, 32),
                                                             (4, 1, 128, 12)]
    assert runs[1].stride == codec.layout(shape, 1).nbytes


@pytest.mark.parametrize("name,params", [
    ("gear", {"group": 8, "value_group": 8, "rank": 2}),
    ("oscar", {"group": 8, "value_group": 8, "scale_values": True}),
    ("kcvt", {}),
])
def test_device_path_launches_do_not_grow_with_the_pages(name, params, kernel_device):
    """The torch ops of a device path (gear's outliers, fits and fields, oscar's norms,
    kcvt's key stats) are batched over the pages: a cache of 6 full pages runs as many as
    one of 2."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for tokens in (32, 96):
        kv = kv_sample((1, 1, tokens, 16)).to(kernel_device)
        codec = make_codec(name, {**params, "bits": 4, "residual": 0, "page_tokens": 16,
                                  "backend": "triton"})
        codec.encode_device(kv)  # the shape's geometry built once, as a sender's is
        Count.ops = 0
        with Count():
            codec.encode_device(kv)
        counts.append(Count.ops)
    assert counts[0] == counts[1] > 0


def test_encode_device_refused_where_there_is_no_device_path():
    gear = make_codec("gear", {"lowrank": "sequence", "backend": "triton"})
    kv = kv_sample((1, 1, 64, 32))
    assert not gear.has_device_path(kv.device, KVShape.of(kv))
    with pytest.raises(CodecError, match="no device path"):
        gear.encode_device(kv)
    assert not make_codec("kivi", {}).has_device_path(kv.device, KVShape.of(kv))  # auto, CPU
    cpu_uniform = make_codec("uniform", {"bits": 8, "backend": "cpu"})
    assert not cpu_uniform.has_device_path(torch.device("cpu"), KVShape.of(kv))


@pytest.mark.gpu
def test_pinned_staging_round_trip_and_device_timing():
    from kvsim.bench.device_codecs import device_timing
    from kvsim.kernels.device_wire import PinnedStaging

    kv = kv_sample((4, 8, 1024, 128)).cuda()
    codec = make_codec("uniform", {"bits": 8})
    dw = codec.encode_device(kv)
    staging = PinnedStaging(kv.device)
    host = staging.to_host(dw.buffers)
    staging.wait()
    assert host[0].is_pinned()
    assert payloads(dw.to_encoded([h.numpy() for h in host])) == payloads(codec.encode(kv))
    back = staging.to_device(host)
    assert torch.equal(back[0], dw.buffers[0])
    row = device_timing(codec, kv, repeats=3, warmup=1)
    assert row["wire_bytes"] == dw.nbytes
    for key in ("kernel_encode_s", "encode_with_copy_s", "kernel_decode_s", "d2d_copy_s",
                "pinned_d2h_s", "pinned_h2d_s", "decode_with_copy_s"):
        assert row[key] > 0, key
    # the copy of the wire bytes to the host cannot be slower than encode + that copy by much
    assert row["encode_with_copy_s"] > 0.5 * row["pinned_d2h_s"]
    assert device_timing(make_codec("cachegen", {}), kv, 1, 0) is None


def test_per_shape_tables_hold_under_threads_encoding_several_shapes():
    """A sender's producer threads share one codec per variant and encode requests of
    several context lengths at once: each thread gets its own shape's table, whatever the
    others ask for meanwhile, and the codec keeps a bounded number of them."""
    from concurrent.futures import ThreadPoolExecutor

    from kvsim.kernels.codec import SHAPES_REMEMBERED

    codec = make_codec("kivi", {"backend": "triton"})
    shapes = [KVShape(2, 1, tokens, 64) for tokens in range(40, 40 + 3 * SHAPES_REMEMBERED)]

    def check(shape: KVShape) -> bool:
        want = np.asarray(codec.payload_bytes(shape), dtype=np.int64)
        return all(np.array_equal(codec.wire_sizes(shape), want) and
                   codec._device_geometry(shape, torch.device("cpu"))[2] ==
                   codec.geometry(shape)[1] for _ in range(20))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, shapes * 2))
    assert len(codec._wire_sizes) <= SHAPES_REMEMBERED
    assert len(codec._device_geometries) <= SHAPES_REMEMBERED
