"""Synthetic KV caches with the structure real ones have, for codec tests and benches that
must run without a model.

What real KV looks like (and what each parameter reproduces):
- Keys have a few *outlier channels* whose magnitude is many times the others, stable across
  tokens (KIVI, GEAR: the reason keys are quantized per channel), and a per-channel offset.
- Keys are *post-RoPE*: channel pair (i, i + head_dim/2) is rotated by angle pos * base^(-2i/d);
  low-frequency pairs barely rotate, high-frequency pairs spin from token to token.
- The first few tokens are *attention sinks*; their keys have 5-50x smaller L2 norm than the
  other keys (OScaR review), which is what per-token key scaling must cope with.
- Neighbouring tokens are correlated (smooth hidden states); values are less smooth than keys
  and have no channel outliers (the reason values are quantized per token).
- Magnitudes change with depth (per-layer scale profile).

All magnitudes are in activation units (the units of the model's K/V projections, i.e.
dimensionless numbers of order 1); ratios are dimensionless.

    kv = generate_kv(KVShape(layers, kv_heads, tokens, head_dim), SyntheticKVParams(), seed=0)
    # kv: [layers, 2 (K, V), kv_heads, tokens, head_dim]
    q = generate_queries(kv, q_heads=4 * kv_heads, q_tokens=8, seed=0)
    # q: [layers, q_heads, q_tokens, head_dim]
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvsim.core.data_files import record_loaded
from kvsim.core.layout import DTYPES, K, KVShape, V


@dataclass(frozen=True)
class SyntheticKVParams:
    """Statistics of a synthetic KV cache. Every field is JSON-serializable (to_dict)."""

    # Std of an ordinary key channel at layer scale 1 (activation units).
    k_scale: float = 1.0
    # Fraction of head_dim channels (of each layer x head) that are key outlier channels
    # (dimensionless, 0..1; chosen in RoPE pairs so rotation keeps them outliers).
    k_outlier_channel_fraction: float = 0.06
    # Std of an outlier key channel / std of an ordinary one (dimensionless, >= 1).
    k_outlier_magnitude: float = 10.0
    # Std of the per-channel key offset, relative to that channel's std (dimensionless).
    k_channel_bias: float = 0.5
    # Std of a value element at layer scale 1 (activation units).
    v_scale: float = 0.5
    # Per-layer magnitude multiplier of the first and last layer (dimensionless); layers in
    # between are interpolated geometrically. Applies to both K and V.
    layer_scale_first: float = 0.5
    layer_scale_last: float = 2.0
    # Number of attention-sink tokens at the start of the sequence (tokens).
    sink_tokens: int = 4
    # L2 norm of a sink key / median L2 norm of the other keys of the same layer x head
    # (dimensionless; OScaR review: sinks are 5-50x smaller, i.e. 0.02..0.2).
    sink_key_norm_ratio: float = 0.1
    # L2 norm of a sink value / median L2 norm of the other values (dimensionless).
    sink_value_norm_ratio: float = 0.3
    # Lag-1 autocorrelation of each key channel across consecutive tokens (AR(1) coefficient,
    # dimensionless, 0 <= rho < 1). Measured before RoPE rotation.
    k_token_correlation: float = 0.8
    # Lag-1 autocorrelation of each value channel across consecutive tokens.
    v_token_correlation: float = 0.3
    # Apply a rotary position embedding to keys (half-split pairing, as Llama/Qwen do).
    rope: bool = True
    # RoPE base (theta); pair i rotates by pos * rope_base^(-2i/head_dim) radians per token.
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        positive = ("k_scale", "v_scale", "layer_scale_first", "layer_scale_last", "rope_base",
                    "sink_key_norm_ratio", "sink_value_norm_ratio")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SyntheticKVParams.{name} must be a finite number > 0, "
                                 f"got {value!r}")
        if not 0.0 <= self.k_outlier_channel_fraction <= 1.0:
            raise ValueError("SyntheticKVParams.k_outlier_channel_fraction must be in [0, 1], "
                             f"got {self.k_outlier_channel_fraction!r}")
        if not (math.isfinite(self.k_outlier_magnitude) and self.k_outlier_magnitude >= 1.0):
            raise ValueError("SyntheticKVParams.k_outlier_magnitude must be >= 1, "
                             f"got {self.k_outlier_magnitude!r}")
        if not (math.isfinite(self.k_channel_bias) and self.k_channel_bias >= 0.0):
            raise ValueError(f"SyntheticKVParams.k_channel_bias must be >= 0, "
                             f"got {self.k_channel_bias!r}")
        for name in ("k_token_correlation", "v_token_correlation"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"SyntheticKVParams.{name} must be in [0, 1), got {value!r}")
        if not (isinstance(self.sink_tokens, int) and self.sink_tokens >= 0):
            raise ValueError(f"SyntheticKVParams.sink_tokens must be an int >= 0, "
                             f"got {self.sink_tokens!r}")

    # ---- serialization ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SyntheticKVParams:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"SyntheticKVParams: unknown field(s) {unknown}; valid: "
                             f"{sorted(names)}")
        return cls(**values)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> SyntheticKVParams:
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
            record_loaded(path)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read synthetic KV params ({exc})") from exc
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: synthetic KV params must be a JSON object")
        return cls.from_dict(doc)

    def layer_scales(self, layers: int) -> torch.Tensor:
        """[layers] float64 magnitude multiplier per layer (geometric first -> last)."""
        if layers == 1:
            return torch.tensor([self.layer_scale_first], dtype=torch.float64)
        frac = torch.arange(layers, dtype=torch.float64) / (layers - 1)
        return self.layer_scale_first * (self.layer_scale_last / self.layer_scale_first) ** frac


def _ar1(noise: torch.Tensor, rho: float) -> torch.Tensor:
    """Stationary unit-variance AR(1) along dim -2 (tokens) driven by unit-variance `noise`.

    noise: [..., tokens, channels] float64. x_0 = e_0; x_t = rho x_{t-1} + sqrt(1-rho^2) e_t.
    Computed in blocks of tokens: inside a block the recursion is a scaled cumsum, so the
    Python loop runs tokens/block times instead of tokens times. The block is short enough
    that rho^-block stays below 1e6 (float64 cumsum keeps full accuracy). Tokens are moved
    to the last (contiguous) dim for the scan: the same sums in the same order, several times
    faster than torch's cumsum over a strided dim.
    """
    if rho == 0.0:
        return noise
    tokens = noise.shape[-2]
    block = max(1, min(256, int(6.0 * math.log(10.0) / -math.log(rho))))
    gain = math.sqrt(1.0 - rho * rho)
    by_token = noise.transpose(-1, -2).contiguous()  # [..., channels, tokens]
    out = torch.empty_like(by_token)
    prev = None  # [..., channels] state after the previous block
    for t0 in range(0, tokens, block):
        e = by_token[..., t0 : t0 + block]
        n = e.shape[-1]
        j = torch.arange(n, dtype=noise.dtype)
        up = rho ** (-j)  # [n]
        down = rho**j  # [n]
        drive = e * gain
        if prev is None:
            drive = drive.clone()
            drive[..., 0] = e[..., 0]  # stationary start: x_0 has unit variance
            x = down * torch.cumsum(drive * up, dim=-1)
        else:
            x = down * torch.cumsum(drive * up, dim=-1)
            x = x + (rho * down) * prev[..., None]
        out[..., t0 : t0 + n] = x
        prev = x[..., -1]
    return out.transpose(-1, -2)


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate x: [heads, tokens, head_dim] float64 by position (half-split pairing)."""
    tokens, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    if half == 0:
        return x
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / dim)  # [half] rad/token
    angle = torch.arange(tokens, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = torch.cos(angle), torch.sin(angle)
    a, b = x[..., :half], x[..., half : 2 * half]
    out = x.clone()
    out[..., :half] = a * cos - b * sin
    out[..., half : 2 * half] = a * sin + b * cos
    return out


def _outlier_channels(gen: torch.Generator, heads: int, dim: int, fraction: float) -> torch.Tensor:
    """[heads, dim] bool mask of outlier channels, chosen in RoPE pairs (i, i + dim/2)."""
    mask = torch.zeros(heads, dim, dtype=torch.bool)
    half = dim // 2
    if half == 0:
        count = round(fraction * dim)
        for h in range(heads):
            mask[h, torch.randperm(dim, generator=gen)[:count]] = True
        return mask
    pairs = round(fraction * dim / 2)
    for h in range(heads):
        chosen = torch.randperm(half, generator=gen)[:pairs]
        mask[h, chosen] = True
        mask[h, chosen + half] = True
    return mask


def _set_sink_norms(x: torch.Tensor, sinks: int, ratio: float) -> None:
    """In place: x: [heads, tokens, dim]; give the first `sinks` tokens an L2 norm equal to
    `ratio` x the median norm of the other tokens (per head)."""
    tokens = x.shape[-2]
    sinks = min(sinks, tokens)
    if sinks == 0:
        return
    rest = x[:, sinks:, :] if tokens > sinks else x
    target = ratio * rest.norm(dim=-1).median(dim=-1).values  # [heads]
    norms = x[:, :sinks, :].norm(dim=-1).clamp_min(1e-30)  # [heads, sinks]
    x[:, :sinks, :] *= (target[:, None] / norms)[..., None]


def _layer_seed(seed: int, layer: int, salt: int) -> int:
    return (int(seed) * 1_000_003 + layer * 7919 + salt) % (2**63 - 1)


def generate_kv(shape: KVShape, params: SyntheticKVParams | None = None,
                seed: int = 0) -> torch.Tensor:
    """A synthetic KV cache, deterministic for (shape, params, seed).

    Returns [layers, 2 (K, V), kv_heads, tokens, head_dim] in shape.dtype, on the CPU.
    Generated one layer at a time in float64 (peak extra memory ~ 3 layers in float64).
    """
    out = torch.empty(shape.dims, dtype=DTYPES[shape.dtype])
    for layer in range(shape.layers):
        out[layer] = generate_layer(shape, layer, params, seed)
    return out


def generate_layer(shape: KVShape, layer: int, params: SyntheticKVParams | None = None,
                   seed: int = 0) -> torch.Tensor:
    """Layer `layer` of generate_kv(shape, params, seed): [2 (K, V), kv_heads, tokens,
    head_dim] in shape.dtype (the same values, without holding the other layers)."""
    p = params or SyntheticKVParams()
    if not isinstance(p, SyntheticKVParams):
        raise ValueError(f"params must be SyntheticKVParams, got {type(p).__name__}")
    if not 0 <= layer < shape.layers:
        raise ValueError(f"layer {layer} outside 0..{shape.layers - 1}")
    heads, tokens, dim = shape.kv_heads, shape.tokens, shape.head_dim
    out = torch.empty(shape.dims[1:], dtype=DTYPES[shape.dtype])
    scales = p.layer_scales(shape.layers)
    gen = torch.Generator().manual_seed(_layer_seed(seed, layer, 0))
    scale = float(scales[layer])
    # keys: per-channel std (outliers) and offset, smooth over tokens, then RoPE.
    outlier = _outlier_channels(gen, heads, dim, p.k_outlier_channel_fraction)
    chan_std = torch.where(outlier, p.k_outlier_magnitude, 1.0).to(torch.float64)  # [H, D]
    bias = torch.randn(heads, dim, generator=gen, dtype=torch.float64) * p.k_channel_bias
    z = _ar1(torch.randn(heads, tokens, dim, generator=gen, dtype=torch.float64),
             p.k_token_correlation)  # [H, T, D] unit variance
    k = scale * p.k_scale * chan_std[:, None, :] * (z + bias[:, None, :])
    if p.rope:
        k = _rope(k, p.rope_base)
    _set_sink_norms(k, p.sink_tokens, p.sink_key_norm_ratio)
    # values: no channel outliers, weaker token correlation.
    v = scale * p.v_scale * _ar1(
        torch.randn(heads, tokens, dim, generator=gen, dtype=torch.float64),
        p.v_token_correlation)
    _set_sink_norms(v, p.sink_tokens, p.sink_value_norm_ratio)
    out[K] = k.to(out.dtype)
    out[V] = v.to(out.dtype)
    return out


def generate_queries(kv: torch.Tensor, q_heads: int, q_tokens: int, seed: int = 0, *,
                     focus_keys: int = 4, logit_std: float = 3.0,
                     noise: float = 0.5) -> torch.Tensor:
    """Decode-time queries for a KV cache, with peaked (not uniform) attention.

    kv: [layers, 2, kv_heads, tokens, head_dim]. Returns [layers, q_heads, q_tokens, head_dim]
    float32 (in the same RoPE frame as the keys). q_heads must be a multiple of kv_heads (GQA:
    query head h reads kv head h // (q_heads // kv_heads)).

    Each query is a random mix of the unit directions of `focus_keys` keys of its kv head
    (chosen uniformly, sinks included) plus isotropic noise of relative size `noise`, then
    scaled so that the logits q.k / sqrt(head_dim) over all cached keys have standard
    deviation `logit_std` (dimensionless): with ~3 the softmax concentrates on a handful of
    keys, as real decode attention does, while still mixing many values.
    """
    shape = KVShape.of(kv)
    if q_heads < 1 or q_heads % shape.kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a positive multiple of kv_heads "
                         f"({shape.kv_heads})")
    if q_tokens < 1:
        raise ValueError(f"q_tokens must be >= 1, got {q_tokens}")
    if focus_keys < 1:
        raise ValueError(f"focus_keys must be >= 1, got {focus_keys}")
    if not (logit_std > 0 and noise >= 0):
        raise ValueError(f"logit_std must be > 0 and noise >= 0, got {logit_std}, {noise}")
    group = q_heads // shape.kv_heads
    dim = shape.head_dim
    out = torch.empty(shape.layers, q_heads, q_tokens, dim, dtype=torch.float32)
    for layer in range(shape.layers):
        gen = torch.Generator().manual_seed(_layer_seed(seed, layer, 1))
        keys = kv[layer, K].to(torch.float32)  # [H, T, D]
        keys_rep = keys.repeat_interleave(group, dim=0)  # [Hq, T, D]
        unit = keys_rep / keys_rep.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        idx = torch.randint(0, shape.tokens, (q_heads, q_tokens, focus_keys), generator=gen)
        weights = torch.rand(q_heads, q_tokens, focus_keys, generator=gen) + 0.5
        picked = torch.gather(unit, 1, idx.reshape(q_heads, -1, 1).expand(-1, -1, dim))
        picked = picked.reshape(q_heads, q_tokens, focus_keys, dim)
        q = (weights[..., None] * picked).sum(dim=2)  # [Hq, Tq, D]
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        iso = torch.randn(q_heads, q_tokens, dim, generator=gen) / math.sqrt(dim)
        q = q + noise * iso
        logits = torch.einsum("hqd,htd->hqt", q, keys_rep) / math.sqrt(dim)  # [Hq, Tq, T]
        spread = logits.std(dim=-1, correction=0, keepdim=True) if shape.tokens > 1 else \
            logits.abs()
        q = q * (logit_std / spread.clamp_min(1e-12))
        out[layer] = q
    return out
