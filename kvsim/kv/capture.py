"""Run a real model's prefill and take its KV cache (and decode queries) in kvsim's layout.

KV is *post-RoPE*: it is what the model's cache holds (Llama/Qwen apply RoPE to keys before
caching), i.e. what a prefill node would ship. Queries are post-RoPE too (same state as K).

    cache, last_logits = prefill(model, context_ids)   # transformers DynamicCache, [vocab]
    kv = cache_to_kv(cache)                        # [layers, 2, kv_heads, tokens, head_dim]
    queries, logits = forward_with_kv(model, kv, heldout_ids, record_queries=True)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvsim.core.layout import K, KVShape, V
from kvsim.kv.capture_file import Capture
from kvsim.model.forward import lm_forward


def _as_batch(ids: torch.Tensor | list[int], model: Any) -> torch.Tensor:
    """ids as [1, tokens] on the device of `model`'s weights."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=next(model.parameters()).device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"token ids must be [tokens] or [1, tokens] with tokens >= 1, got "
                         f"{tuple(ids.shape)}")
    return ids


def cache_to_kv(cache: Any) -> torch.Tensor:
    """transformers DynamicCache (batch 1) -> kv [layers, 2, kv_heads, tokens, head_dim]."""
    layers = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values  # [1, kv_heads, tokens, head_dim]
        if k is None or k.dim() != 4 or k.shape[0] != 1:
            raise ValueError("cache_to_kv needs a filled batch-1 cache")
        layers.append(torch.stack([k[0], v[0]]))
    return torch.stack(layers)


def kv_to_cache(kv: torch.Tensor, config: Any, dtype: torch.dtype | None = None) -> Any:
    """kv [layers, 2, kv_heads, tokens, head_dim] -> a fresh DynamicCache the model can extend
    (the model's forward appends to it; build a new one per pass)."""
    from transformers import DynamicCache

    KVShape.of(kv)
    if kv.shape[0] != config.num_hidden_layers:
        raise ValueError(f"kv has {kv.shape[0]} layers, the model {config.num_hidden_layers}")
    dtype = dtype or kv.dtype
    data = [(kv[layer, K][None].to(dtype), kv[layer, V][None].to(dtype))
            for layer in range(kv.shape[0])]
    return DynamicCache(data, config=config)


class CacheFromLayers:
    """A fresh DynamicCache filled one layer at a time, in any order (a receiver adds each
    layer as it is dequantized, so the cache is ready when the last one is): the same cache
    kv_to_cache builds from the whole tensor."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str = "cpu"):
        from transformers import DynamicCache

        self.layers = int(config.num_hidden_layers)
        self.dtype, self.device = dtype, torch.device(device)
        self._cache = DynamicCache(config=config)
        self._added: set[int] = set()

    def add(self, layer: int, kv_layer: torch.Tensor) -> None:
        """kv_layer: [2, kv_heads, tokens, head_dim] (K, V) of `layer`."""
        if not 0 <= layer < self.layers or layer in self._added:
            raise ValueError(f"layer {layer} is out of 0..{self.layers - 1} or added twice")
        if kv_layer.dim() != 4 or kv_layer.shape[0] != 2:
            raise ValueError(f"a layer's KV must be [2, kv_heads, tokens, head_dim], got "
                             f"{tuple(kv_layer.shape)}")
        k, v = (kv_layer[i][None].to(device=self.device, dtype=self.dtype) for i in (K, V))
        self._cache.update(k, v, layer)
        self._added.add(layer)

    def cache(self) -> Any:
        if len(self._added) != self.layers:
            missing = sorted(set(range(self.layers)) - self._added)
            raise ValueError(f"the cache lacks layers {missing[:8]}"
                             f"{'...' if len(missing) > 8 else ''}")
        return self._cache


@torch.no_grad()
def prefill(model: Any, ids: torch.Tensor | list[int]) -> tuple[Any, torch.Tensor]:
    """Prefill `ids`; return (the model's DynamicCache with post-RoPE K/V of every token,
    logits [vocab] float32 of the last position: the first generated token's distribution)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = lm_forward(model, _as_batch(ids, model), cache, logits_to_keep=1)
    return cache, out.logits[0, -1].float()


@contextmanager
def _recording_queries(model: Any) -> Iterator[dict[int, torch.Tensor]]:
    """While active, the model's attention records its post-RoPE query states per layer:
    {layer_idx: [q_heads, q_tokens, head_dim]}. Wraps the model's attention function (in
    transformers' attention registry, restored on exit), so masks and kernels are unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    if impl not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"cannot record queries with attention implementation {impl!r}; "
                         "load the model with attn_implementation='sdpa'")
    inner = ALL_ATTENTION_FUNCTIONS[impl]
    had_local = impl in ALL_ATTENTION_FUNCTIONS._local_mapping
    recorded: dict[int, torch.Tensor] = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        recorded[int(module.layer_idx)] = query[0].detach().clone()  # [q_heads, q_tokens, D]
        return inner(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = recording
    try:
        yield recorded
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[impl] = inner
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]


@torch.no_grad()
def forward_with_kv(model: Any, kv: torch.Tensor, ids: torch.Tensor | list[int],
                    record_queries: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Run `ids` (teacher-forced) after a cache holding `kv`. Returns (queries
    [layers, q_heads, tokens, head_dim] or None, logits [tokens, vocab] float32)."""
    param = next(model.parameters())
    cache = kv_to_cache(kv.to(param.device), model.config, param.dtype)
    ids = _as_batch(ids, model)
    if not record_queries:
        out = lm_forward(model, ids, cache)
        return None, out.logits[0].float()
    with _recording_queries(model) as recorded:
        out = lm_forward(model, ids, cache)
    layers = model.config.num_hidden_layers
    if sorted(recorded) != list(range(layers)):
        raise RuntimeError(f"recorded queries of layers {sorted(recorded)}, "
                           f"expected 0..{layers - 1}")
    return torch.stack([recorded[i] for i in range(layers)]), out.logits[0].float()


def kv_statistics(kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer statistics that show outlier channels and sink tokens.

    kv: [layers, 2, kv_heads, tokens, head_dim]. Returns float32 tensors:
      key_channel_absmax, value_channel_absmax: [layers, kv_heads, head_dim]  (max |x| over tokens)
      key_token_l2, value_token_l2:             [layers, kv_heads, tokens]    (L2 norm per token)
    """
    KVShape.of(kv)
    x = kv.float()
    return {"key_channel_absmax": x[:, K].abs().amax(dim=2),
            "value_channel_absmax": x[:, V].abs().amax(dim=2),
            "key_token_l2": x[:, K].norm(dim=-1),
            "value_token_l2": x[:, V].norm(dim=-1)}


def summarize_statistics(stats: dict[str, torch.Tensor], sink_tokens: int = 4) -> list[dict]:
    """One row per layer: outlier-channel ratio (max channel absmax / median channel absmax)
    and sink ratio (mean key L2 norm of the first `sink_tokens` / median key L2 norm)."""
    rows = []
    kmax, knorm = stats["key_channel_absmax"], stats["key_token_l2"]
    for layer in range(kmax.shape[0]):
        ch = kmax[layer]  # [kv_heads, head_dim]
        norms = knorm[layer]  # [kv_heads, tokens]
        rest = norms[:, sink_tokens:] if norms.shape[1] > sink_tokens else norms
        rows.append({
            "layer": layer,
            "key_outlier_ratio": float((ch.amax(dim=1) / ch.median(dim=1).values).mean()),
            "key_sink_norm_ratio": float((norms[:, :sink_tokens].mean(dim=1)
                                          / rest.median(dim=1).values).mean()),
            "key_token_l2_median": float(norms.median()),
            "value_token_l2_median": float(stats["value_token_l2"][layer].median()),
        })
    return rows


@dataclass
class PrefillResult:
    """One context through the real model, at the model's precision (the reference)."""

    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim], post-RoPE
    queries: torch.Tensor  # [layers, q_heads, heldout tokens, head_dim], post-RoPE
    last_logits: torch.Tensor  # [vocab]: distribution of the first generated token
    heldout_logits: torch.Tensor  # [heldout tokens, vocab] on the reference cache
    prefill_s: float

    def to_capture(self, meta: dict, dtype: torch.dtype = torch.bfloat16) -> Capture:
        meta = {**meta, "rope": "post", "context_tokens": int(self.kv.shape[3]),
                "query_tokens": int(self.queries.shape[2]),
                "model_dtype": str(self.kv.dtype).removeprefix("torch.")}
        return Capture(self.kv.to(dtype), self.queries.to(dtype), meta)


def run_context(model: Any, context_ids: list[int], heldout_ids: list[int]) -> PrefillResult:
    """Prefill `context_ids`, then run `heldout_ids` teacher-forced on that cache recording
    their queries (the real decode queries the vNMSE uses) and logits."""
    started = time.perf_counter()
    cache, last_logits = prefill(model, context_ids)
    prefill_s = time.perf_counter() - started
    kv = cache_to_kv(cache)
    queries, logits = forward_with_kv(model, kv, heldout_ids, record_queries=True)
    return PrefillResult(kv, queries, last_logits, logits, prefill_s)
