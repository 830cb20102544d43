"""Spread over samples: a row's mean over `samples` independent runs (seeds seed..seed+n-1)
comes with the runs' standard deviation and a 95% confidence interval of that mean
(Student's t with n-1 degrees of freedom: mean +- t(0.975, n-1) * std / sqrt(n)).

With one sample there is no spread to estimate: std and the interval are None, not 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# the metrics whose spread a row carries (scalar keys; dict keys get one entry per k)
SPREAD_SCALARS = ("ttft_s", "ttft_committed_s", "ttft_from_prefill_end_s", "total_bytes",
                  "accepted_tokens")
SPREAD_DICTS = ("ttkt_s", "ttkt_committed_s", "ttkt_from_prefill_end_s")
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    mean: float
    std: float | None  # sample standard deviation (n-1 denominator); None for n = 1
    ci95_low: float | None
    ci95_high: float | None
    n: int

    @property
    def half_width(self) -> float | None:
        return None if self.ci95_high is None else (self.ci95_high - self.mean)


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile: scipy.special.stdtrit (scipy.stats costs 1.5 s to import, the
    special function 0.3 s)."""
    from scipy.special import stdtrit

    return float(stdtrit(dof, p))


def interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean, sample std and the two-sided `confidence` interval of the mean."""
    n = len(values)
    if n == 0:
        raise ValueError("interval of no values")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    vals = [float(v) for v in values]
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"interval of non-finite values {vals}")
    mean = math.fsum(vals) / n
    if n == 1:
        return Interval(mean, None, None, None, 1)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1))
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * std / math.sqrt(n)
    return Interval(mean, std, mean - half, mean + half, n)


def spread_of(rows: list[dict]) -> dict[str, dict]:
    """{metric: Interval as a dict} over the sample rows; dict metrics become `name.k`."""
    out: dict[str, dict] = {}
    for key in SPREAD_SCALARS:
        vals = [r.get(key) for r in rows]
        if vals and all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals):
            out[key] = asdict(interval(vals))  # type: ignore[arg-type]
    for key in SPREAD_DICTS:
        first = rows[0].get(key)
        if not isinstance(first, dict):
            continue
        for k in first:
            vals = [(r.get(key) or {}).get(k) for r in rows]
            if all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals):
                out[f"{key}.{k}"] = asdict(interval(vals))  # type: ignore[arg-type]
    return out
