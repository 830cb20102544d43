"""Triton kernels of `lynx` vs the torch reference: EXACT bytes (codes and metadata) and
decode. Without CUDA they run under TRITON_INTERPRET=1 (set by conftest), so shapes are
small; the `gpu` test repeats the comparison on CUDA at a realistic size."""

from __future__ import annotations

import pytest
import torch
from triton_checks import needs_ptxas, run_compiled

from kvsim.kernels.codec import CodecError
from kvsim.kernels.lynx.codec import LynxCodec

# (layers, kv_heads, tokens, head_dim): tokens not a multiple of chunk / page, odd heads
# The interpreter evaluates both sides of tl.where and masked-off lanes too (pad tokens times
# a page scale up to 2^127), and numpy warns when those overflow. Only stored lanes matter:
# the tests compare them byte for byte and check them finite.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")

SHAPES = [(1, 3, 45, 16), (2, 1, 17, 24), (1, 2, 8, 8), (1, 1, 1, 8)]


def _kv(dims: tuple[int, int, int, int], dtype: torch.dtype, device: str = "cpu",
        seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    layers, heads, tokens, head_dim = dims
    kv = torch.randn(layers, 2, heads, tokens, head_dim, generator=g) * 2 + 0.5
    kv[:, 1, 0, :, 1] = -3.0  # a constant channel (sigma = 0, page range 0)
    kv[:, 0, -1, tokens // 2, :] *= 40  # an outlier token
    return kv.to(dtype).to(device)


def _pair(split: list[int], **extra) -> tuple[LynxCodec, LynxCodec]:
    params = dict(split=split, page_tokens=32, chunk_tokens=16, **extra)
    return LynxCodec({**params, "backend": "torch"}), LynxCodec({**params, "backend": "triton"})


@pytest.mark.parametrize("dims", SHAPES)
@pytest.mark.parametrize("split", [[4, 4], [2, 2, 4], [2, 6], [8], [4]])
def test_triton_bytes_equal_reference(dims, split, kernel_device):
    ref, tri = _pair(split)
    kv = _kv(dims, torch.float32, kernel_device, seed=sum(dims))
    enc = tri.encode(kv)
    assert enc.to_bytes() == ref.encode(kv).to_bytes()
    for s in range(1, len(split) + 1):
        want = ref.decode(enc, s, device=kernel_device)
        got = tri.decode(enc, s, device=kernel_device)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_inputs_and_cpu_backend_agree(dtype, kernel_device):
    """torch vs numba cpu vs Triton: one set of bytes for 16-bit inputs."""
    ref, tri = _pair([4, 4])
    cpu = LynxCodec({**ref.params_dict(), "backend": "cpu"})
    kv = _kv((1, 3, 40, 16), dtype, kernel_device, seed=3)
    want = ref.encode(kv).to_bytes()
    assert tri.encode(kv).to_bytes() == want
    assert cpu.encode(kv.cpu()).to_bytes() == want


def test_triton_extremes_equal_reference(kernel_device):
    vals = torch.tensor([3.4e38, -3.4e38, 1e-45, 0.0, -1e-40, 65504.0, 1e30, -7.0, 1e-20,
                         -0.0])
    kv = vals[torch.arange(2 * 2 * 24 * 8) % len(vals)].reshape(1, 2, 2, 24, 8)
    ref, tri = _pair([4, 4])
    kv = kv.to(kernel_device)
    enc = tri.encode(kv)
    assert enc.to_bytes() == ref.encode(kv).to_bytes()
    out = tri.decode(enc, device=kernel_device)
    assert torch.isfinite(out).all()


def test_triton_oscar_equal_reference(kernel_device):
    ref, tri = _pair([4, 4], precondition="oscar")
    kv = _kv((1, 2, 20, 16), torch.float32, kernel_device, seed=9)
    assert tri.encode(kv).to_bytes() == ref.encode(kv).to_bytes()


def test_triton_rejects_head_dim_not_multiple_of_8(kernel_device):
    _, tri = _pair([4, 4])
    with pytest.raises(CodecError, match="head_dim % 8"):
        tri.encode(torch.randn(1, 2, 1, 8, 12, device=kernel_device))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [[4, 4], [2, 2, 4], [2, 6]])
def test_triton_cuda_matches_reference_and_cpu(split):
    """On CUDA: Triton bytes == torch reference on CUDA == numba cpu on the same data; decode
    equal to the reference (fp32, FMA contraction is disabled) and to the cpu path (bf16)."""
    kv = _kv((2, 8, 1000, 128), torch.bfloat16, "cuda", seed=11)
    ref, tri = _pair(split)
    cpu = LynxCodec({**ref.params_dict(), "backend": "cpu"})
    auto = LynxCodec({**ref.params_dict()})
    enc = tri.encode(kv)
    blob = enc.to_bytes()
    assert blob == ref.encode(kv).to_bytes()
    assert blob == cpu.encode(kv.cpu()).to_bytes()
    assert blob == auto.encode(kv).to_bytes()
    for s in range(1, len(split) + 1):
        got = tri.decode(enc, s, device="cuda", dtype=torch.float32)
        want = ref.decode(enc, s, device="cuda", dtype=torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        got16 = tri.decode(enc, s, device="cuda").cpu()
        want16 = cpu.decode(enc, s)  # numba writes bf16 directly (round to nearest even)
        assert got16.dtype == want16.dtype == torch.bfloat16
        torch.testing.assert_close(got16.float(), want16.float(), rtol=8e-3, atol=1e-6)


@needs_ptxas
def test_kernels_compile_for_cuda_without_fma():
    """Compile both kernels for sm_90 in a fresh process (no interpreter, no GPU needed): the
    GPU path builds, has no fused multiply-add (bit-exactness with the reference) and divides
    by sigma with IEEE rounding."""
    import json

    code = ("import json; from kvsim.kernels.lynx.triton import compile_for_cuda; "
            "p = compile_for_cuda(); "
            "print(json.dumps({k: [v.count('fma.rn.f32'), v.count('div.rn.f32'), "
            "v.count('.ftz')] for k, v in p.items()}))")
    run = run_compiled(code)
    assert run.returncode == 0, run.stderr[-2000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["encode"][0] == 0 and counts["decode"][0] == 0  # no fma.rn.f32
    assert counts["encode"][1] >= 1  # div.rn.f32 for 1/sigma
    assert counts["encode"][2] == 0 and counts["decode"][2] == 0  # no flush-to-zero
