"""Speculative decoding on a partial cache, verified on the full one (Lynx's draft/verify).

One round: the decode node holds the prompt's first generated token `first_token` (made by
the prefill node at full precision). The *draft* is the same model decoding `n_draft` tokens
on the draft cache (e.g. the anchor-only dequantized KV). The *target* then runs ONE forward
pass over [first_token, d_1 .. d_n] on the target cache (full precision) and
- greedy: accepts the longest prefix with d_i == argmax p_i and emits the target's token at the
  first divergence (or a bonus token after n accepted): the emitted sequence equals what
  target-only greedy decoding would produce, token for token;
- sampling: accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
  emits a sample of norm(max(0, p_i - q_i)), after n acceptances a sample of p_{n+1}; the
  emitted tokens are distributed exactly as target-only sampling (Leviathan et al. 2023).
p: target distributions, q: draft distributions, both at the same temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvsim.kv.capture import kv_to_cache
from kvsim.model.forward import lm_forward

DECODINGS = ("greedy", "sampling")


@dataclass
class SpecRound:
    proposed: int  # draft tokens sent to verification
    accepted: int  # longest accepted prefix (0..proposed)
    draft: list[int]  # d_1..d_n
    emitted: list[int]  # accepted prefix + the target's correction / bonus token (accepted + 1)
    meta: dict = field(default_factory=dict)


def _pick(logits: torch.Tensor, decoding: str, temperature: float,
          gen: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """logits [vocab] -> (token, distribution [vocab] float64 for sampling else None)."""
    if decoding == "greedy":
        return int(torch.argmax(logits)), None
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen)), probs


@torch.no_grad()
def decode(model: Any, kv: torch.Tensor, first_token: int, n: int, decoding: str = "greedy",
           temperature: float = 1.0, gen: torch.Generator | None = None
           ) -> tuple[list[int], list[torch.Tensor]]:
    """Autoregressive decoding of `n` tokens after `first_token` on a cache holding `kv`
    [layers, 2, kv_heads, tokens, head_dim]. Returns (tokens, per-token distributions for
    sampling, else empty)."""
    _check_decoding(decoding, temperature)
    cache = kv_to_cache(kv, model.config, next(model.parameters()).dtype)
    token, tokens, dists = first_token, [], []
    for _ in range(n):
        out = lm_forward(model, torch.tensor([[token]]), cache)
        token, dist = _pick(out.logits[0, -1].float(), decoding, temperature, gen)
        tokens.append(token)
        if dist is not None:
            dists.append(dist)
    return tokens, dists


def accept_greedy(draft: list[int], target_argmax: list[int]) -> tuple[int, list[int]]:
    """target_argmax[i]: the target's token after first_token, d_1..d_i (len(draft) + 1).
    Returns (accepted, emitted)."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError("target_argmax must have one more entry than draft")
    k = 0
    while k < len(draft) and draft[k] == target_argmax[k]:
        k += 1
    return k, list(draft[:k]) + [target_argmax[k]]


def accept_sampled(draft: list[int], q: list[torch.Tensor], p: list[torch.Tensor],
                   gen: torch.Generator | None) -> tuple[int, list[int]]:
    """Speculative-sampling acceptance. q[i]: draft distribution of d_{i+1}; p[i]: target
    distribution at the same position (len(draft) + 1 entries, the last for the bonus)."""
    if len(q) != len(draft) or len(p) != len(draft) + 1:
        raise ValueError("need one draft distribution per draft token and one more target one")
    for i, token in enumerate(draft):
        ratio = float(p[i][token]) / max(float(q[i][token]), 1e-300)
        if float(torch.rand((), generator=gen, dtype=torch.float64)) < min(1.0, ratio):
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        # p == q up to rounding: the residual is empty; p itself is the right distribution.
        dist = residual / total if total > 1e-12 else p[i]
        return i, list(draft[:i]) + [int(torch.multinomial(dist, 1, generator=gen))]
    return len(draft), list(draft) + [int(torch.multinomial(p[-1], 1, generator=gen))]


@torch.no_grad()
def speculative_round(model: Any, kv_draft: torch.Tensor, kv_target: torch.Tensor,
                      first_token: int, n_draft: int = 64, decoding: str = "greedy",
                      temperature: float = 1.0, seed: int = 0) -> SpecRound:
    """Draft `n_draft` tokens on `kv_draft`, verify them in one pass on `kv_target`."""
    _check_decoding(decoding, temperature)
    if n_draft < 1:
        raise ValueError(f"n_draft must be >= 1, got {n_draft}")
    if tuple(kv_draft.shape) != tuple(kv_target.shape):
        raise ValueError(f"draft and target caches differ in shape: {tuple(kv_draft.shape)} "
                         f"vs {tuple(kv_target.shape)}")
    gen = torch.Generator().manual_seed(int(seed))
    draft, q = decode(model, kv_draft, first_token, n_draft, decoding, temperature, gen)
    # verification: one forward pass of [first_token, d_1..d_n] on the target cache
    cache = kv_to_cache(kv_target, model.config, next(model.parameters()).dtype)
    ids = torch.tensor([[first_token, *draft]])
    logits = lm_forward(model, ids, cache).logits[0].float()
    if decoding == "greedy":
        accepted, emitted = accept_greedy(draft, logits.argmax(dim=-1).tolist())
    else:
        p = list(torch.softmax(logits.double() / temperature, dim=-1))
        accepted, emitted = accept_sampled(draft, q, p, gen)
    return SpecRound(n_draft, accepted, draft, emitted)


def survival_curve(accepted: list[int], max_draft: int) -> list[float]:
    """S(k) = P(accepted >= k), k = 0..max_draft, from per-run accepted counts."""
    if not accepted:
        raise ValueError("survival curve needs at least one run")
    counts = np.asarray(accepted)
    return [float((counts >= k).mean()) for k in range(max_draft + 1)]


def _check_decoding(decoding: str, temperature: float) -> None:
    if decoding not in DECODINGS:
        raise ValueError(f"decoding must be one of {DECODINGS}, got {decoding!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
