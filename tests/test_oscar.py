"""oscar: Hadamard rotation, then per-token L2 scaling, then KIVI INT2."""

from __future__ import annotations

import pytest
import torch
from codec_checks import wire_round_trip

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import make_codec


def sink_kv(layers: int, heads: int, tokens: int, head_dim: int, seed: int = 0,
            norm_sigma: float = 0.7) -> torch.Tensor:
    """Keys with outlier channels (offsets and wide channels), token norms varying
    log-normally, and 4 low-norm attention-sink tokens at the start."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, 2, heads, tokens, head_dim, generator=g)
    bias = torch.zeros(head_dim)
    bias[[1, 3, 6]] = torch.tensor([6.0, -5.0, 4.0])
    x[:, 0] += bias
    x[:, 0, ..., head_dim - 1] *= 5
    x = x * torch.exp(norm_sigma * torch.randn(layers, 2, heads, tokens, 1, generator=g))
    x[:, :, :, :4] *= 0.05
    return x


def errors(kv: torch.Tensor, out: torch.Tensor, tq: int) -> tuple[float, float]:
    """(relative MSE, mean per-token relative squared error of the 4 sink tokens) over the
    quantized tokens."""
    a, b = kv[:, :, :, :tq].float(), out[:, :, :, :tq].float()
    per_token = ((a - b) ** 2).sum(-1) / (a**2).sum(-1)
    return float(((a - b) ** 2).sum() / (a**2).sum()), float(per_token[..., :4].mean())


def test_oscar_beats_kivi2_on_sinks_and_outlier_channels():
    kv = sink_kv(2, 2, 400, 64)
    kivi, oscar = make_codec("kivi", {"bits": 2}), make_codec("oscar")
    tq = kivi.backbone().quantized_tokens(400)
    assert tq == oscar.backbone().quantized_tokens(400) == 256
    e_kivi = errors(kv, kivi.decode(kivi.encode(kv)), tq)
    e_oscar = errors(kv, oscar.decode(oscar.encode(kv)), tq)
    assert e_oscar[0] < 0.8 * e_kivi[0]
    assert e_oscar[1] < 0.05 * e_kivi[1]  # sink tokens: scale-free error after scaling


@pytest.mark.parametrize("params", [{}, {"scale_values": True, "rotate_values": False},
                                    {"bits": 4, "group": 8, "residual": 8, "page_tokens": 16}])
@pytest.mark.parametrize("tokens", [1, 20, 150, 301])
def test_sizes_exact_window_exact(params, tokens):
    kv = sink_kv(2, 2, tokens, 32, seed=tokens).to(torch.bfloat16)
    codec = make_codec("oscar", params)
    _, out = wire_round_trip(codec, kv)
    tq = codec.backbone().quantized_tokens(tokens)
    assert torch.equal(out[:, :, :, tq:], kv[:, :, :, tq:])  # unrotated bf16 window
    assert torch.isfinite(out).all()


def test_norm_bytes_counted():
    shape = KVShape(1, 4, 512, 64)
    plain = make_codec("oscar").payload_bytes(shape).sum()
    kivi = make_codec("kivi").payload_bytes(shape).sum()
    both = make_codec("oscar", {"scale_values": True}).payload_bytes(shape).sum()
    tq = 384
    assert plain - kivi == 2 * 4 * tq  # one fp16 key norm per quantized token per head
    assert both - plain == 2 * 4 * tq


def test_zero_tokens_no_nan():
    kv = torch.zeros(1, 2, 2, 200, 32)
    kv[:, :, :, 50:] = 1.5
    codec = make_codec("oscar", {"residual": 32})
    out = codec.decode(codec.encode(kv))
    assert torch.isfinite(out).all()
    assert out[:, :, :, :50].abs().max() == 0
    assert torch.allclose(out, kv, atol=2e-2)


def test_non_power_of_two_head_dim_is_clear_error():
    codec = make_codec("oscar")
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        codec.encode(torch.zeros(1, 2, 1, 8, 96))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        codec.size_table(KVShape(1, 1, 8, 96))


@pytest.mark.gpu
def test_gpu_rotation_path_matches_cpu():
    kv = sink_kv(2, 4, 700, 128)
    codec = make_codec("oscar")
    cpu = codec.decode(codec.encode(kv))
    gpu_enc = codec.encode(kv.cuda())
    assert gpu_enc.total_bytes == codec.size_table(KVShape.of(kv)).total_bytes
    gpu = codec.decode(gpu_enc, device="cuda").cpu()
    tq = codec.backbone().quantized_tokens(700)
    assert abs(errors(kv, gpu, tq)[0] - errors(kv, cpu, tq)[0]) < 1e-3
