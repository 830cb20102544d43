"""KV layout, codec registry and presets, bit packing, acceptance models, captures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsim.core.layout import KVShape, check_finite
from kvsim.kernels.bitpack import pack, packed_len, unpack
from kvsim.kernels.codec import CodecError, codec_names, make_codec
from kvsim.kernels.hadamard import hadamard
from kvsim.kernels.presets import resolve_codec
from kvsim.kv.capture_file import Capture, load_capture
from kvsim.scenario.acceptance import AcceptanceModel, geometric, load_acceptance, seeds_fig10


def test_kvshape_validates_layout():
    with pytest.raises(ValueError, match="layers, 2"):
        KVShape.of(torch.zeros(2, 3, 4, 5, 6))
    with pytest.raises(ValueError, match="positive"):
        KVShape(0, 1, 1, 1)
    s = KVShape(94, 4, 131072, 128)
    assert s.bf16_bytes == 2 * 94 * 131072 * 4 * 128 * 2  # Qwen3-235B-A22B at 128K: 23.5 GB
    assert s.bf16_bytes / 2**30 == pytest.approx(23.5, abs=0.05)  # the seeds' '23.5 GB' is GiB


def test_non_finite_input_is_refused():
    kv = torch.zeros(1, 2, 1, 4, 8)
    kv[0, 1, 0, 2, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        check_finite(kv)
    with pytest.raises(ValueError, match="non-finite"):
        make_codec("bf16").encode(kv)


def test_registry_errors_are_clear():
    assert "bf16" in codec_names()
    with pytest.raises(CodecError, match="unknown codec"):
        make_codec("nope")
    with pytest.raises(CodecError, match="unknown parameter"):
        make_codec("bf16", {"page_tokns": 3})
    with pytest.raises(ValueError, match="unknown codec preset"):
        resolve_codec("no-such-preset")
    spec = resolve_codec({"preset": "bf16", "params": {"page_tokens": 64}})
    assert spec.params == {"page_tokens": 64} and spec.label == "bf16(page_tokens=64)"


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bitpack_round_trip(bits):
    n = 48
    codes = torch.randint(0, 2**bits, (3, n), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.shape[-1] == packed_len(n, bits)
    assert torch.equal(unpack(packed, bits, n), codes.to(torch.uint8))


def test_hadamard_is_orthonormal_involution():
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    y = hadamard(x)
    torch.testing.assert_close(hadamard(y), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.randn(2, 80))


def test_acceptance_models(tmp_path):
    g = geometric(0.9)
    assert g.survival_at(3) == pytest.approx(0.729)
    assert g.mean_accepted(2) == pytest.approx(0.9 + 0.81)
    rng = np.random.default_rng(0)
    draws = [g.sample_accepted(64, rng) for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(g.mean_accepted(64), rel=0.05)
    f = seeds_fig10()
    assert f.survival_at(10) == pytest.approx(0.88) and f.survival_at(20) == pytest.approx(0.70)
    model = AcceptanceModel("t", [1.0, 0.5, 0.25], "measured", {"model": "x"})
    path = model.save(tmp_path / "t.json")
    assert load_acceptance(str(path)).survival == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="non-increasing"):
        AcceptanceModel("bad", [1.0, 0.2, 0.5])
    with pytest.raises(ValueError, match="unknown acceptance model"):
        load_acceptance("no-such-model")
    assert geometric(1.0).sample_accepted(5, rng) == 5
    assert geometric(0.0).sample_accepted(5, rng) == 0


def test_capture_round_trip(tmp_path):
    kv = torch.randn(2, 2, 3, 10, 8).to(torch.bfloat16)
    q = torch.randn(2, 6, 4, 8)
    path = Capture(kv, q, {"model": "tiny", "rope": "post"}).save(tmp_path / "c.pt")
    cap = load_capture(path)
    assert torch.equal(cap.kv, kv) and torch.equal(cap.queries, q) and cap.meta["rope"] == "post"
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        Capture(kv, torch.randn(2, 4, 4, 8))
    with pytest.raises(FileNotFoundError, match="no KV capture"):
        load_capture(tmp_path / "missing.pt")
