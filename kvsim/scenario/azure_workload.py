"""Requests with the published shape of the Azure LLM inference traces 2023 (`workload.kind=azure`).

The shape files, data/workload/azure-2023-<trace>.json (written by `python -m
kvsim.bench.azure_shape`, statistics only), hold per trace quantile tables of
ContextTokens and GeneratedTokens (tokens), their Spearman rank correlation and the arrival
process (mean rate, inter-arrival coefficient of variation). A request's context and output are
drawn jointly through a Gaussian copula: two standard normals with the correlation that gives
the measured Spearman correlation, each mapped to its marginal by inverse-CDF sampling with
linear interpolation between the table's quantiles. Arrivals come at `workload.rate_per_s` as a
renewal process: `trace` (default) draws each gap from the trace's inter-arrival quantile table
scaled to mean 1 / rate_per_s (the measured shape: CV ~13 for code, bursty; ~1.1 for conv);
`gamma` draws gamma gaps with the trace's coefficient of variation; `poisson` draws exponential
gaps (CV 1).

Source: Azure/AzurePublicDataset (CC-BY); Patel et al., "Splitwise: Efficient generative LLM
inference using phase splitting", ISCA 2024.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.core.paths import DATA_DIR

AZURE_TRACES = ("code", "conv")
AZURE_ARRIVALS = ("trace", "gamma", "poisson")  # = kvsim.scenario.config.AZURE_ARRIVALS
SHAPE_DIR = DATA_DIR / "workload"


@dataclass(frozen=True)
class QuantileTable:
    p: np.ndarray  # [k] probabilities, 0 .. 1 increasing
    value: np.ndarray  # [k] the quantile at each p, non-decreasing

    def inverse_cdf(self, u: np.ndarray) -> np.ndarray:
        """Values at probabilities u in [0, 1], linear between the tabulated quantiles."""
        return np.interp(u, self.p, self.value)

    def moments(self) -> tuple[float, float]:
        """Mean and coefficient of variation of the distribution inverse_cdf samples (exact for
        the piecewise-linear quantile function: on a segment from a to b of probability dp,
        E[x] += dp (a + b) / 2 and E[x^2] += dp (a^2 + ab + b^2) / 3)."""
        dp = np.diff(self.p)
        a, b = self.value[:-1], self.value[1:]
        mean = float(np.sum(dp * (a + b) / 2))
        second = float(np.sum(dp * (a * a + a * b + b * b) / 3))
        return mean, math.sqrt(max(0.0, second - mean * mean)) / mean


@dataclass(frozen=True)
class AzureShape:
    trace: str
    context_tokens: QuantileTable  # tokens
    generated_tokens: QuantileTable  # tokens
    spearman: float  # rank correlation of ContextTokens and GeneratedTokens
    mean_rate_per_s: float  # requests/s over the trace
    interarrival_cv: float  # std / mean of the gaps between arrivals
    interarrival_s: QuantileTable  # s, gaps between consecutive arrivals
    source: str  # the shape file

    def max_generated_tokens(self) -> int:
        return int(round(self.generated_tokens.value[-1]))


def _table(node: dict, key: str, path: Path, minimum: float) -> QuantileTable:
    try:
        p = np.asarray(node["p"], dtype=float)
        v = np.asarray(node["value"], dtype=float)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"azure shape {path}: {key} has no quantile table ({exc})") from exc
    if p.ndim != 1 or p.shape != v.shape or p.size < 2 or p[0] != 0.0 or p[-1] != 1.0 \
            or np.any(np.diff(p) <= 0) or np.any(np.diff(v) < 0) or not v[0] >= minimum \
            or not np.isfinite(v).all() or not v[-1] > 0:
        raise ValueError(f"azure shape {path}: {key} quantiles must run from p=0 to p=1 with "
                         f"increasing p and non-decreasing finite values >= {minimum:g}")
    return QuantileTable(p, v)


def load_azure_shape_file(path: str | Path, trace: str = "") -> AzureShape:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"azure shape {path}: cannot read it ({exc})") from exc
    from kvsim.core.data_files import record_loaded

    record_loaded(path)  # provenance: path and sha256 in every report
    try:
        rho_s = float(raw["rank_correlation"]["spearman"])
        rate = float(raw["arrivals"]["mean_rate_per_s"])
        cv = float(raw["arrivals"]["interarrival_s"]["cv"])
        tables = {key: raw[key] for key in ("context_tokens", "generated_tokens")}
        tables["interarrival_s"] = raw["arrivals"]["interarrival_s"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"azure shape {path}: missing rank_correlation, a quantile table or "
                         f"arrivals ({exc})") from exc
    if not (-1.0 <= rho_s <= 1.0 and rate > 0 and cv > 0):
        raise ValueError(f"azure shape {path}: spearman {rho_s}, rate {rate}/s, CV {cv} out "
                         "of range")
    return AzureShape(raw.get("trace", trace),
                      _table(tables["context_tokens"], "context_tokens", path, 1.0),
                      _table(tables["generated_tokens"], "generated_tokens", path, 1.0),
                      rho_s, rate, cv,
                      _table(tables["interarrival_s"], "arrivals.interarrival_s", path, 0.0),
                      str(path))


@functools.lru_cache(maxsize=4)
def load_azure_shape(trace: str) -> AzureShape:
    """The shipped shape of a trace in AZURE_TRACES (read once per process)."""
    if trace not in AZURE_TRACES:
        raise ValueError(f"workload.azure_trace must be one of {AZURE_TRACES}, got {trace!r}")
    return load_azure_shape_file(SHAPE_DIR / f"azure-2023-{trace}.json", trace)


def copula_uniforms(n: int, rho_spearman: float,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n pairs of uniforms on (0, 1) whose Spearman correlation is rho_spearman (Gaussian
    copula: normal correlation 2 sin(pi rho_s / 6))."""
    from scipy.special import ndtr

    rho = 2.0 * math.sin(math.pi * rho_spearman / 6.0)
    z1 = rng.standard_normal(n)
    z2 = rho * z1 + math.sqrt(max(0.0, 1.0 - rho * rho)) * rng.standard_normal(n)
    return ndtr(z1), ndtr(z2)


def arrival_gaps_s(n: int, rate_per_s: float, shape: AzureShape, process: str,
                   rng: np.random.Generator) -> np.ndarray:
    """n gaps (s) with mean 1 / rate_per_s: trace: inverse-CDF draws from the trace's gap
    table, scaled so the mean is 1 / rate_per_s (the shape and CV of the table are kept) |
    gamma: coefficient of variation = the trace's (gamma shape 1 / CV^2) | poisson:
    exponential."""
    mean_s = 1.0 / rate_per_s
    if process == "poisson":
        return rng.exponential(mean_s, size=n)
    if process == "gamma":
        k = 1.0 / (shape.interarrival_cv * shape.interarrival_cv)
        return rng.gamma(k, mean_s / k, size=n)
    if process != "trace":
        raise ValueError(f"workload.azure_arrivals must be one of {AZURE_ARRIVALS}, "
                         f"got {process!r}")
    table_mean_s, _ = shape.interarrival_s.moments()
    return shape.interarrival_s.inverse_cdf(rng.random(n)) * (mean_s / table_mean_s)


def azure_draws(shape: AzureShape, n: int, rng: np.random.Generator,
                ) -> tuple[np.ndarray, np.ndarray]:
    """n (context, generated) token counts from the shape, before clipping: [n] float each."""
    u_ctx, u_gen = copula_uniforms(n, shape.spearman, rng)
    return shape.context_tokens.inverse_cdf(u_ctx), shape.generated_tokens.inverse_cdf(u_gen)


def azure_requests(cfg, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrival times (s, first at 0), contexts and outputs (tokens, int) of cfg.requests requests
    (cfg: a WorkloadConfig with kind=azure). Contexts are clipped to context_min/max_tokens and
    rounded up to a multiple of context_round_tokens, like the lognormal contexts; outputs are
    rounded to the nearest integer >= 1."""
    shape = load_azure_shape(cfg.azure_trace)
    n = cfg.requests
    ctx_raw, gen_raw = azure_draws(shape, n, rng)
    gaps_s = arrival_gaps_s(n, cfg.rate_per_s, shape, cfg.azure_arrivals, rng)
    times_s = np.cumsum(gaps_s) - gaps_s[0]  # first request at t = 0
    r = cfg.context_round_tokens
    ctx = np.ceil(np.clip(ctx_raw, cfg.context_min_tokens, cfg.context_max_tokens) / r) * r
    gen = np.maximum(1, np.rint(gen_raw))
    return times_s, ctx.astype(int), gen.astype(int)
