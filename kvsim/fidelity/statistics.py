"""The statistics a validation reports beside its mean and worst errors, as simulator papers
report agreement with a real system:

- the emulator's own spread: a comparison whose simulated value lies inside the range of the
  repeated emulated runs is noise, not a model error (`beyond_spread_pct`);
- TOST equivalence of each metric's mean signed error at +-margin (`tost`): a test of the
  model's bias on that metric, not of each comparison (errors of +10% and -10% average to 0);
- the noise floor (kvsim.fidelity.noise_floor): what a model exact to the emulator's
  expected values would score from the repeated runs' spread alone, and whether the run's
  errors lie beyond it;
- per request, for a multi-request run: MAPE, Pearson r, and a two-sample KS test of the two
  TTFT distributions (`per_request`). MAPE sees a constant offset, r and KS do not (r is 1
  and D small for simulated = measured + c); KS treats the two sides as independent samples
  while they are the same requests.

Errors are relative, in percent of the measured value, signed simulated minus measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

TOST_MARGIN_PCT = 5.0  # the equivalence margin of every metric's mean error (%)
TOST_ALPHA = 0.05  # each one-sided test's level (equivalence: the 90% interval inside)


def beyond_spread_pct(measured_mean_s: float, measured_min_s: float, measured_max_s: float,
                      simulated_s: float) -> float:
    """How far the simulated value lies outside the range of the repeated measurements, in %
    of their mean, signed (simulated above the range: positive); 0 inside it (the emulator's
    own noise covers it); nan where a value is not finite or the mean is not positive."""
    values = (measured_mean_s, measured_min_s, measured_max_s, simulated_s)
    if not all(math.isfinite(v) for v in values) or measured_mean_s <= 0:
        return math.nan
    if simulated_s > measured_max_s:
        return 100.0 * (simulated_s - measured_max_s) / measured_mean_s
    if simulated_s < measured_min_s:
        return 100.0 * (simulated_s - measured_min_s) / measured_mean_s
    return 0.0


def tost(errors_pct: Sequence[float], margin_pct: float = TOST_MARGIN_PCT,
         alpha: float = TOST_ALPHA) -> dict:
    """Two one-sided t-tests that the mean of `errors_pct` (one metric's signed errors over
    the scenarios compared) lies within +-margin_pct: H0 mean <= -margin, H0 mean >= +margin,
    p the larger of the two one-sided p-values; equivalent when p < alpha (the same as the
    (1 - 2 alpha) interval of the mean lying inside the margin). Non-finite errors are left
    out; with fewer than two there is no test (p and the interval nan, not equivalent)."""
    from scipy import stats

    e = np.array([x for x in errors_pct if math.isfinite(x)], dtype=np.float64)
    n = int(e.size)
    out = {"n": n, "margin_pct": margin_pct, "alpha": alpha,
           "mean_error_pct": float(e.mean()) if n else math.nan,
           "p": math.nan, "interval_pct": [math.nan, math.nan], "equivalent": False}
    if n < 2:
        return out
    mean, se = float(e.mean()), float(e.std(ddof=1) / math.sqrt(n))
    if se == 0.0:  # every error the same: the interval is that point
        inside = abs(mean) < margin_pct
        return {**out, "p": 0.0 if inside else 1.0, "interval_pct": [mean, mean],
                "equivalent": inside}
    df = n - 1
    p_low = float(stats.t.sf((mean + margin_pct) / se, df))  # H0: mean <= -margin
    p_high = float(stats.t.cdf((mean - margin_pct) / se, df))  # H0: mean >= +margin
    half = float(stats.t.ppf(1.0 - alpha, df)) * se
    p = max(p_low, p_high)
    return {**out, "p": p, "interval_pct": [mean - half, mean + half],
            "equivalent": p < alpha}


def per_request(measured_s: Sequence[float], simulated_s: Sequence[float]) -> dict:
    """Agreement of two engines' per-request times of the same requests (same arrivals, in
    the same order): MAPE (%), Pearson r of the pairs, and the two-sample Kolmogorov-Smirnov
    statistic and p-value of the two distributions. Pairs with a non-finite or non-positive
    measured value are left out (`pairs` counts the rest, `missing` those); r is nan where
    either side is constant or fewer than three pairs remain, KS needs one value on each
    side."""
    from scipy import stats

    if len(measured_s) != len(simulated_s):
        raise ValueError(f"per-request comparison needs the same requests on both sides, got "
                         f"{len(measured_s)} measured and {len(simulated_s)} simulated")
    pairs = [(float(a), float(b)) for a, b in zip(measured_s, simulated_s, strict=True)
             if math.isfinite(a) and a > 0 and math.isfinite(b)]
    out = {"pairs": len(pairs), "missing": len(measured_s) - len(pairs),
           "mape_pct": math.nan, "pearson_r": math.nan, "ks_statistic": math.nan,
           "ks_p": math.nan}
    if not pairs:
        return out
    a, b = (np.array(x, dtype=np.float64) for x in zip(*pairs, strict=True))
    out["mape_pct"] = float(100.0 * np.mean(np.abs(b - a) / a))
    if len(pairs) >= 3 and np.ptp(a) > 0 and np.ptp(b) > 0:
        out["pearson_r"] = float(stats.pearsonr(a, b)[0])
    ks = stats.ks_2samp(a, b)
    out["ks_statistic"], out["ks_p"] = float(ks.statistic), float(ks.pvalue)
    return out
