"""Request arrivals: one request, a Poisson stream, a trace, or the shape of an Azure trace
(kvsim.scenario.azure_workload); context lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.scenario.config import WorkloadConfig


@dataclass(frozen=True, slots=True)  # slots: a run creates every request up front
class Request:
    seq: int
    arrival_t: float  # s
    context_tokens: int
    output_tokens: int  # tokens it decodes
    # ids of its prompt's blocks of prefix_cache.block_tokens tokens, in order (equal ids:
    # the same prefix; kvsim.scenario.prefix_cache); empty: the workload names none
    prefix_blocks: tuple[int, ...] = ()


def requests(cfg: WorkloadConfig, rng: np.random.Generator) -> list[Request]:
    cfg.validate()
    out = cfg.output_tokens
    if cfg.kind == "single":
        return [Request(0, 0.0, cfg.context_tokens, out)]
    if cfg.kind == "trace" and cfg.trace_path:
        from kvsim.scenario.request_trace import workload_trace

        tr = workload_trace(cfg)
        blocks = tr.prefix_blocks or ((),) * len(tr.arrival_s)
        return [Request(i, float(t), int(c), int(o), b) for i, (t, c, o, b) in enumerate(zip(
            tr.arrival_s.tolist(), tr.context_tokens.tolist(), tr.output_tokens.tolist(),
            blocks, strict=True))]
    if cfg.kind == "trace":
        times = np.asarray(cfg.arrivals_t, dtype=float)
        if np.any(np.diff(times) < 0) or times[0] < 0:
            raise ValueError("workload.arrivals_t must be non-negative and non-decreasing")
        blocks = [tuple(int(h) for h in b) for b in cfg.arrivals_prefix_blocks] or \
            [()] * len(times)
        return [Request(i, float(t), int(c), out, b) for i, (t, c, b) in
                enumerate(zip(times, cfg.arrivals_context_tokens, blocks, strict=True))]
    if cfg.rate_per_s <= 0:
        raise ValueError(f"workload.rate_per_s must be > 0, got {cfg.rate_per_s}")
    if cfg.kind == "azure":
        from kvsim.scenario.azure_workload import azure_requests

        times, ctx, gen = azure_requests(cfg, rng)
        return [Request(i, float(t), int(c), int(o))
                for i, (t, c, o) in enumerate(zip(times, ctx, gen, strict=True))]
    gaps = rng.exponential(1.0 / cfg.rate_per_s, size=cfg.requests)
    times = np.cumsum(gaps) - gaps[0]  # first request at t = 0
    ctx = _contexts(cfg, rng)
    return [Request(i, float(t), int(c), out)
            for i, (t, c) in enumerate(zip(times, ctx, strict=True))]


def _contexts(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    n = cfg.requests
    if cfg.context_dist == "fixed":
        return np.full(n, cfg.context_tokens)
    if cfg.context_dist == "uniform":
        raw = rng.uniform(cfg.context_min_tokens, cfg.context_max_tokens, size=n)
    else:  # lognormal with the configured mean
        mu = np.log(cfg.context_tokens) - cfg.context_sigma**2 / 2
        raw = rng.lognormal(mu, cfg.context_sigma, size=n)
    raw = np.clip(raw, cfg.context_min_tokens, cfg.context_max_tokens)
    r = cfg.context_round_tokens
    return (np.ceil(raw / r) * r).astype(int)
