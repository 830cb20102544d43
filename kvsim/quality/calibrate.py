"""Fit the synthetic KV generator (kvsim.kv.synthetic.SyntheticKVParams) to a real capture, so
codec bytes and error can be estimated for shapes whose weights are not here (Llama-8B,
Qwen-32B) with the statistics of a real model.

Estimators (per layer x head, then averaged), mirroring how generate_kv builds K and V:
- keys are un-rotated with the model's RoPE base first (captures are post-RoPE; the generator
  draws pre-RoPE statistics and rotates);
- channel std sigma_d over non-sink tokens; outlier channels: sigma_d > 3 x median sigma;
  k_outlier_channel_fraction = their share, k_outlier_magnitude = mean outlier sigma / median;
- k_channel_bias = RMS over channels of (channel mean / channel std);
- layer profile: median ordinary key std per layer, fit log-linearly in depth ->
  layer_scale_first/last around 1 at mid-depth, k_scale = that mid-depth std;
  v_scale = median over layers of value std / layer scale;
- k/v_token_correlation: lag-1 autocorrelation of centred (pre-RoPE) channels;
- sink tokens: leading tokens whose key L2 norm is below half the median (at most 8);
  sink_key/value_norm_ratio: their mean norm / median norm of the others.

    params = calibrate(capture.kv, rope_base=1e5)      # SyntheticKVParams
    save_calibration(params, "smollm2-135m", meta)      # data/synthetic/smollm2-135m.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvsim.core.layout import K, KVShape, V
from kvsim.core.paths import DATA_DIR
from kvsim.kv.synthetic import SyntheticKVParams

SYNTHETIC_DIR = DATA_DIR / "synthetic"
_OUTLIER_STD_RATIO = 3.0  # channel std / median channel std above which a channel is an outlier
_MAX_SINKS = 8  # leading tokens examined for attention-sink norms
_SINK_NORM_RATIO = 0.5  # key norm / median below which a leading token counts as a sink


def unrope(x: torch.Tensor, base: float, start: int = 0) -> torch.Tensor:
    """Undo half-split RoPE: x [..., tokens, head_dim] at positions start.. -> pre-RoPE."""
    tokens, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / dim)  # [half] rad/token
    pos = torch.arange(start, start + tokens, dtype=torch.float64)
    angle = pos[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = torch.cos(angle), torch.sin(angle)
    x = x.to(torch.float64)
    a, b = x[..., :half], x[..., half : 2 * half]
    out = x.clone()
    out[..., :half] = a * cos + b * sin
    out[..., half : 2 * half] = -a * sin + b * cos
    return out


def _lag1(x: torch.Tensor) -> float:
    """Mean lag-1 autocorrelation over channels of x [heads, tokens, dim] (float64)."""
    xc = x - x.mean(dim=1, keepdim=True)
    num = (xc[:, 1:] * xc[:, :-1]).sum(dim=1)
    den = xc.square().sum(dim=1).clamp_min(1e-30)
    return float((num / den).mean())


def count_sinks(kv: torch.Tensor) -> int:
    """Leading tokens whose key L2 norm (mean over layers and heads, relative to the median
    token) is below 0.5, counted from token 0 while the condition holds."""
    norms = kv[:, K].to(torch.float64).norm(dim=-1)  # [layers, heads, tokens]
    rel = norms / norms.median(dim=-1, keepdim=True).values.clamp_min(1e-30)
    rel = rel.mean(dim=(0, 1))  # [tokens]
    sinks = 0
    while sinks < min(_MAX_SINKS, kv.shape[3] - 1) and rel[sinks] < _SINK_NORM_RATIO:
        sinks += 1
    return sinks


def calibrate(kv: torch.Tensor, rope_base: float | None = None,
              sink_tokens: int | None = None) -> SyntheticKVParams:
    """Fit SyntheticKVParams to a captured cache kv [layers, 2, kv_heads, tokens, head_dim]
    (post-RoPE with `rope_base`, or pre-RoPE/no RoPE when rope_base is None)."""
    shape = KVShape.of(kv)
    if shape.tokens < 16:
        raise ValueError(f"calibration needs at least 16 tokens, got {shape.tokens}")
    sinks = count_sinks(kv) if sink_tokens is None else int(sink_tokens)
    k_std, v_std = [], []
    fractions, magnitudes, biases, k_rho, v_rho, k_sink, v_sink = [], [], [], [], [], [], []
    for layer in range(shape.layers):
        k = kv[layer, K].to(torch.float64)  # [H, T, D]
        v = kv[layer, V].to(torch.float64)
        k_norm, v_norm = k.norm(dim=-1), v.norm(dim=-1)  # [H, T]
        if sinks:
            k_sink.append(float((k_norm[:, :sinks].mean(1) / k_norm[:, sinks:].median(1).values)
                                .mean()))
            v_sink.append(float((v_norm[:, :sinks].mean(1) / v_norm[:, sinks:].median(1).values)
                                .mean()))
        k_pre = unrope(k, rope_base) if rope_base else k
        body_k, body_v = k_pre[:, sinks:], v[:, sinks:]
        sigma = body_k.std(dim=1, correction=0).clamp_min(1e-30)  # [H, D]
        med = sigma.median(dim=1, keepdim=True).values  # [H, 1]
        outlier = sigma > _OUTLIER_STD_RATIO * med
        fractions.append(float(outlier.float().mean()))
        if outlier.any():
            magnitudes.append(float((sigma / med)[outlier].mean()))
        mean = body_k.mean(dim=1)  # [H, D]
        biases.append(float((mean / sigma).square().mean().sqrt()))
        ordinary = torch.where(outlier, torch.nan, sigma)
        k_std.append(float(ordinary.nanmedian()))
        v_std.append(float(body_v.std(dim=1, correction=0).median()))
        k_rho.append(_lag1(body_k))
        v_rho.append(_lag1(body_v))
    # log-linear depth profile of the ordinary key std: log s = a + b * depth (depth 0..1)
    log_k = torch.log(torch.tensor(k_std, dtype=torch.float64))
    depth = torch.linspace(0.0, 1.0, shape.layers, dtype=torch.float64)
    if shape.layers > 1:
        slope = float(((depth - depth.mean()) * (log_k - log_k.mean())).sum()
                      / (depth - depth.mean()).square().sum())
    else:
        slope = 0.0
    mid = float(log_k.mean())  # fitted log std at mean depth 0.5
    layer_scales = torch.exp(slope * (depth - 0.5))
    v_scale = float((torch.tensor(v_std, dtype=torch.float64) / layer_scales).median())
    return SyntheticKVParams(
        k_scale=float(torch.exp(torch.tensor(mid))),
        k_outlier_channel_fraction=float(sum(fractions) / len(fractions)),
        k_outlier_magnitude=max(1.0, sum(magnitudes) / len(magnitudes)) if magnitudes else 1.0,
        k_channel_bias=float(sum(biases) / len(biases)),
        v_scale=v_scale,
        layer_scale_first=float(torch.exp(torch.tensor(-0.5 * slope))),
        layer_scale_last=float(torch.exp(torch.tensor(0.5 * slope))),
        sink_tokens=sinks,
        sink_key_norm_ratio=sum(k_sink) / len(k_sink) if k_sink else 0.1,
        sink_value_norm_ratio=sum(v_sink) / len(v_sink) if v_sink else 0.3,
        k_token_correlation=min(0.99, max(0.0, sum(k_rho) / len(k_rho))),
        v_token_correlation=min(0.99, max(0.0, sum(v_rho) / len(v_rho))),
        rope=rope_base is not None,
        rope_base=float(rope_base) if rope_base else 10000.0,
    )


def save_calibration(params: SyntheticKVParams, name: str, meta: dict | None = None,
                     directory: str | Path | None = None) -> Path:
    """data/synthetic/<name>.json: the params (loadable by SyntheticKVParams.load) and a
    sibling <name>.meta.json with provenance (model, capture, text)."""
    directory = Path(directory) if directory else SYNTHETIC_DIR
    path = params.save(directory / f"{name}.json")
    if meta:
        (directory / f"{name}.meta.json").write_text(json.dumps(meta, indent=1, default=str)
                                                     + "\n")
    return path


def load_calibration(name_or_path: str) -> SyntheticKVParams:
    """By name in data/synthetic/ (e.g. 'smollm2-135m') or a path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = SYNTHETIC_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in SYNTHETIC_DIR.glob("*.json")
                       if not p.stem.endswith(".meta")) if SYNTHETIC_DIR.is_dir() else []
        raise ValueError(f"unknown synthetic calibration {name_or_path!r}; a path or one of "
                         f"{known}")
    return SyntheticKVParams.load(path)
