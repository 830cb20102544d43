"""Where a sender's KV cache comes from: a live prefill of the real model, a capture file, or
synthetic KV of any model preset's shape.

A source hands out one layer at a time (`layer(l)` -> [1, 2, kv_heads, tokens, head_dim]) so
the encoder can pipeline with the link, and says how its prefill time was obtained:
`measured` (the real model ran here) or `modelled` (the hardware preset's roofline; the
sender waits that long before releasing the layers, as the simulator does).

The layers are on the source's `device`, where the sender encodes them: a live prefill's
are where the model ran; a capture's or synthetic KV's are made on the host and moved
there (in `prepare`, while a modelled prefill runs, where the cache is held whole).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvsim.core.device import device_label, synchronize
from kvsim.core.layout import KVShape


@dataclass
class KVSource:
    shape: KVShape
    kind: str  # live | capture | synthetic
    prefill_s: float  # measured (live) or modelled time of the prefill that made this cache
    prefill_measured: bool
    first_token: int | None = None  # the prefill's greedy next token (live), else None
    describe: dict = field(default_factory=dict)
    _kv: torch.Tensor | None = None  # [layers, 2, kv_heads, tokens, head_dim] when held whole
    # layer index -> [1, 2, kv_heads, tokens, head_dim] (or whatever the request's codec
    # encodes: the transport bench's pre-encoded codec takes the index itself)
    _make_layer: Any = None
    preparable: bool = False  # _make_layer's layers may be generated ahead (prepare)
    reused: bool = False  # a live prefill's KV reused for the same prompt (reused_live_source)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def layer(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.shape.layers:
            raise IndexError(f"layer {index} outside 0..{self.shape.layers - 1}")
        if self._kv is not None:
            return self._kv[index : index + 1].to(self.device)
        made = self._make_layer(index)
        return made.to(self.device) if isinstance(made, torch.Tensor) else made

    def prepare(self, budget_bytes: int) -> bool:
        """Generate a lazily made cache now and hold it whole on the source's device, if its
        bf16 bytes fit `budget_bytes` (the sender calls this while a modelled prefill runs,
        so generating synthetic KV, or moving it to the device, is not counted as encoding).
        Returns whether the cache is held."""
        if self._kv is None and self.preparable and self._make_layer is not None and \
                self.shape.bf16_bytes <= budget_bytes:
            self._kv = torch.cat([self._make_layer(i) for i in range(self.shape.layers)])
        if self._kv is not None and self._kv.device != self.device and \
                self.shape.bf16_bytes <= budget_bytes:
            self._kv = self._kv.to(self.device)
            synchronize(self.device)  # the copy is the prefill's, not the encode's
        return self._kv is not None

    def full(self) -> torch.Tensor:
        """The whole cache (layer-dependent codecs such as CacheGen encode it at once)."""
        if self._kv is not None:
            return self._kv.to(self.device)
        return torch.cat([self.layer(i) for i in range(self.shape.layers)])


def live_source(lm: Any, context_ids: list[int], describe: dict | None = None) -> KVSource:
    """Prefill the real model on `context_ids` here (timed, on the model's device) and keep
    its post-RoPE KV there."""
    from kvsim.kv.capture import cache_to_kv, prefill

    device = next(lm.model.parameters()).device
    synchronize(device)  # what other requests queued there is not this prefill's
    started = time.perf_counter()
    cache, logits = prefill(lm.model, context_ids)
    synchronize(device)  # the prefill's kernels have run, not only been queued
    prefill_s = time.perf_counter() - started
    kv = cache_to_kv(cache).to(torch.bfloat16).contiguous()
    return KVSource(KVShape.of(kv), "live", prefill_s, True, int(torch.argmax(logits)),
                    {"kv_source": "live", "live_model": lm.name,
                     "device": device_label(device), **(describe or {})}, _kv=kv,
                    device=device)


# (model name, its weights' device and dtype, prompt sha256) -> the first live prefill of
# that prompt in this sender run
# (send_all clears it when it ends: reuse spans one run's requests, not a process's life,
# unless a prefills_held scope spans several runs)
_PREFILLS: dict[tuple[str, str, str, str], KVSource] = {}
_held_scopes = 0  # prefills_held scopes open now


def forget_prefills() -> None:
    """Drop the prefills kept for reuse (reused_live_source), unless a prefills_held scope
    holds them."""
    if not _held_scopes:
        _PREFILLS.clear()


@contextlib.contextmanager
def prefills_held() -> Iterator[None]:
    """Inside it the prefills kept for reuse outlive each sender run, so that consecutive
    runs in this process (a validation's scenarios: one prompt per context) prefill each
    prompt once; they are dropped when the outermost scope ends. The KV kept is one
    context's cache per prompt (its shape's bytes), held until then."""
    global _held_scopes
    _held_scopes += 1
    try:
        yield
    finally:
        _held_scopes -= 1
        if not _held_scopes:
            _PREFILLS.clear()


def reused_live_source(lm: Any, context_ids: list[int], describe: dict | None = None
                       ) -> KVSource:
    """live_source, but a prompt this process prefilled before (the same model, on the same
    device in the same dtype, and the same token ids) reuses that prefill's KV, first token
    and measured time (`reused`: the sender books the time without waiting it). The KV is
    the same tensor; nothing writes to it."""
    import hashlib

    import numpy as np

    weights = next(lm.model.parameters())
    key = (lm.name, device_label(weights.device), str(weights.dtype),
           hashlib.sha256(np.asarray(context_ids, dtype=np.int64).tobytes()).hexdigest())
    first = _PREFILLS.get(key)
    if first is None:
        first = _PREFILLS[key] = live_source(lm, context_ids, describe)
        return first
    return KVSource(first.shape, "live", first.prefill_s, True, first.first_token,
                    {**first.describe, **(describe or {}), "prefill": "reused"},
                    _kv=first._kv, reused=True, device=first.device)


def capture_source(name_or_path: str, prefill_s: float, device: torch.device | None = None
                   ) -> KVSource:
    """A capture file's KV, moved to `device` (default: the CPU) before its encode."""
    from kvsim.kv.capture_file import load_capture

    device = device or torch.device("cpu")
    cap = load_capture(name_or_path)
    first = cap.meta.get("first_token")
    return KVSource(cap.shape, "capture", prefill_s, False,
                    int(first) if isinstance(first, int) else None,
                    {"kv_source": "capture", "capture": str(name_or_path),
                     "device": device_label(device)},
                    _kv=cap.kv.contiguous(), device=device)


def synthetic_source(shape: KVShape, prefill_s: float, seed: int = 0,
                     device: torch.device | None = None) -> KVSource:
    """Synthetic KV (calibrated on the real SmolLM2 capture) generated layer by layer on
    demand, so a 128K-token cache of a large preset never sits in memory whole; its layers
    are moved to `device` (default: the CPU)."""
    from kvsim.kv.synthetic import generate_layer

    device = device or torch.device("cpu")

    def make(index: int) -> torch.Tensor:
        return generate_layer(shape, index, seed=seed)[None]

    return KVSource(shape, "synthetic", prefill_s, False, None,
                    {"kv_source": "synthetic", "seed": seed, "device": device_label(device)},
                    _make_layer=make, preparable=True, device=device)
