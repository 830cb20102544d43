"""How much a compressed KV cache changes what attention computes.

vNMSE (the seeds' compression-error metric, Lynx section 5): per layer l,
    vNMSE_l = mean over query tokens of ||o_l - ô_l||^2 / ||o_l||^2
where o_l = softmax(q k^T / sqrt(head_dim)) v is the attention output of one query token
(all query heads concatenated, i.e. the input of the output projection), computed on the
original cache, and ô_l the same on the reconstructed cache. Decode queries attend to every
cached token, so there is no causal mask. Lynx writes ||ô||^2 in the denominator; the
difference is second order for small errors, and `normalize_by="compressed"` reproduces it.

GQA: queries [layers, q_heads, q_tokens, head_dim], with q_heads a multiple of kv_heads;
query head h reads kv head h // (q_heads // kv_heads). Everything is computed in float32 and
in slices of query tokens so the [heads, query tokens, cached tokens] score matrix stays
under `budget_bytes`, whatever the context length.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvsim.core.layout import K, KVShape, V

DEFAULT_BUDGET_BYTES = 64 * 2**20  # score-matrix slice size (float32) per matmul


def _check_queries(queries: torch.Tensor, shape: KVShape) -> int:
    """Validate queries against the cache; return the GQA group size."""
    if queries.dim() != 4:
        raise ValueError(f"queries must be [layers, q_heads, q_tokens, head_dim], got shape "
                         f"{tuple(queries.shape)}")
    layers, q_heads, q_tokens, head_dim = (int(s) for s in queries.shape)
    if layers != shape.layers or head_dim != shape.head_dim:
        raise ValueError(f"queries {tuple(queries.shape)} do not match the KV cache "
                         f"(layers={shape.layers}, head_dim={shape.head_dim})")
    if q_heads % shape.kv_heads or q_tokens < 1:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads "
                         f"({shape.kv_heads}) and q_tokens ({q_tokens}) >= 1")
    return q_heads // shape.kv_heads


def attention_output(queries: torch.Tensor, kv: torch.Tensor,
                     budget_bytes: int = DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """Decode attention of `queries` over the whole cache `kv`, in float32.

    queries: [layers, q_heads, q_tokens, head_dim]; kv: [layers, 2, kv_heads, tokens, head_dim].
    Returns o: [layers, q_heads, q_tokens, head_dim] float32 on kv's device.
    """
    shape = KVShape.of(kv)
    group = _check_queries(queries, shape)
    q_tokens = int(queries.shape[2])
    device = kv.device
    scale = 1.0 / math.sqrt(shape.head_dim)
    # queries of one kv head's group, for a slice of query tokens: [kv_heads, group * n, T]
    per_token_bytes = 4 * shape.kv_heads * group * shape.tokens
    step = max(1, min(q_tokens, budget_bytes // max(1, per_token_bytes)))
    out = torch.empty(tuple(queries.shape), dtype=torch.float32, device=device)
    for layer in range(shape.layers):
        k = kv[layer, K].to(torch.float32)  # [H, T, D]
        v = kv[layer, V].to(torch.float32)  # [H, T, D]
        q_layer = queries[layer].to(device=device, dtype=torch.float32)  # [Hq, Tq, D]
        q_layer = q_layer.reshape(shape.kv_heads, group, q_tokens, shape.head_dim)
        for t0 in range(0, q_tokens, step):
            q = q_layer[:, :, t0 : t0 + step]  # [H, G, n, D]
            n = q.shape[2]
            q = q.reshape(shape.kv_heads, group * n, shape.head_dim)
            probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * scale, dim=-1)  # [H, G*n, T]
            o = torch.bmm(probs, v).view(shape.kv_heads, group, n, shape.head_dim)
            out[layer, :, t0 : t0 + n] = o.reshape(shape.kv_heads * group, n, shape.head_dim)
    return out


def vnmse_from_outputs(o: torch.Tensor, o_hat: torch.Tensor,
                       normalize_by: str = "reference") -> np.ndarray:
    """Per-layer vNMSE from attention outputs o, o_hat: [layers, q_heads, q_tokens, head_dim].

    normalize_by: "reference" divides by ||o||^2, "compressed" by ||ô||^2 (Lynx's formula).
    Returns [layers] float64. A zero denominator with a zero error counts as 0, with a
    nonzero error as inf.
    """
    if o.shape != o_hat.shape:
        raise ValueError(f"attention outputs differ in shape: {tuple(o.shape)} vs "
                         f"{tuple(o_hat.shape)}")
    if normalize_by not in ("reference", "compressed"):
        raise ValueError(f"normalize_by must be 'reference' or 'compressed', got {normalize_by!r}")
    o = o.to(torch.float64)
    o_hat = o_hat.to(device=o.device, dtype=torch.float64)
    err = (o - o_hat).square().sum(dim=(1, 3))  # [layers, q_tokens]: all heads of a token
    ref = (o if normalize_by == "reference" else o_hat).square().sum(dim=(1, 3))
    ratio = torch.where(ref > 0, err / ref.clamp_min(torch.finfo(torch.float64).tiny),
                        torch.where(err > 0, torch.inf, 0.0))
    return ratio.mean(dim=1).cpu().numpy()


def attention_vnmse(queries: torch.Tensor, kv: torch.Tensor, kv_hat: torch.Tensor,
                    normalize_by: str = "reference",
                    budget_bytes: int = DEFAULT_BUDGET_BYTES) -> np.ndarray:
    """Per-layer vNMSE ([layers] float64) of the attention output of `queries` over the
    reconstructed cache `kv_hat` against the original `kv` (same shape)."""
    if tuple(kv.shape) != tuple(kv_hat.shape):
        raise ValueError(f"kv and kv_hat differ in shape: {tuple(kv.shape)} vs "
                         f"{tuple(kv_hat.shape)}")
    o = attention_output(queries, kv, budget_bytes)
    o_hat = attention_output(queries, kv_hat.to(kv.device), budget_bytes)
    return vnmse_from_outputs(o, o_hat, normalize_by)


def relative_mse(kv: torch.Tensor, kv_hat: torch.Tensor) -> float:
    """||kv - kv_hat||^2 / ||kv||^2 over the whole cache (float64 accumulation, one layer at a
    time). 0 for an all-zero cache reproduced exactly; inf for a zero cache with error."""
    if tuple(kv.shape) != tuple(kv_hat.shape):
        raise ValueError(f"kv and kv_hat differ in shape: {tuple(kv.shape)} vs "
                         f"{tuple(kv_hat.shape)}")
    err = ref = 0.0
    for layer in range(kv.shape[0]):
        a = kv[layer].to(torch.float64)
        b = kv_hat[layer].to(device=a.device, dtype=torch.float64)
        err += float((a - b).square().sum())
        ref += float(a.square().sum())
    if ref == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / ref
