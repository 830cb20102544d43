"""The statistics a validation reports beside its mean and worst errors, as simulator papers
report agreement with a real system:

- the emulator's own spread: a comparison whose simulated value lies inside the range of the
  repeated emulated runs is noise, not a model error (`beyond_spread_pct`);
- TOST equivalence of each metric's mean signed error at +-margin (`tost`): a test of the
  model's bias on that metric, not of each comparison (errors of +10% and -10% average to 0);
- the noise floor (`noise_floor`): the mean and worst |error| a model exact to the
  emulator's expected values would score on the comparisons with repeated runs, from those
  runs' spread alone; a run's worst error is judged against it, not against zero;
- per request, for a multi-request run: MAPE, Pearson r, and a two-sample KS test of the two
  TTFT distributions (`per_request`). MAPE sees a constant offset, r and KS do not (r is 1
  and D small for simulated = measured + c); KS treats the two sides as independent samples
  while they are the same requests.

Errors are relative, in percent of the measured value, signed simulated minus measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

NOISE_FLOOR_DRAWS = 4000  # simulated validations of an exact model (noise_floor)
NOISE_FLOOR_SEED = 0  # fixed: the same rows give the same floor
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


@lru_cache(maxsize=16)
def range_sq_per_variance(n: int) -> float:
    """E[R^2] / sigma^2 for the range R of n normal draws (2 for n = 2: R = |x1 - x2|);
    by a fixed-seed Monte Carlo of 400,000 samples beyond n = 2 (within ~0.3%)."""
    if n < 2:
        raise ValueError(f"a range needs at least 2 values, got {n}")
    if n == 2:
        return 2.0
    x = np.random.default_rng(12345).standard_normal((400_000, n))
    return float(np.mean(np.square(x.max(axis=1) - x.min(axis=1))))


def noise_floor(rows: Sequence[dict], draws: int = NOISE_FLOOR_DRAWS,
                seed: int = NOISE_FLOOR_SEED) -> dict | None:
    """The |error| a model exact to the emulator's expected values would score on the
    comparisons that have repeated runs (rows with `repeats` >= 2 and their measured_s /
    measured_min_s / measured_max_s), from those runs' spread alone. None without such rows.

    A row's measured value is the mean of its n runs, so an exact model misses it by that
    mean's own noise, sd sigma / sqrt(n). One row's range is one degree of freedom, so sigma
    (relative to the mean) is pooled over a class of rows, those of one case, link, rate and
    metric (its drafted and committed forms together): sigma^2 = mean(R^2) /
    range_sq_per_variance(n), R the range over the mean. `draws` validations are simulated
    with normal noise of that sd per row; rows that are the same runs' same numbers (a plain
    codec's drafted and committed times) share one draw, and are each counted, as the
    summary counts them. Different metrics of one request are drawn independently, though
    their noise is shared in part (the worst is, if anything, overstated).

    Returns {"compared": rows used, "draws", "mean_abs_pct" (median over the draws of the mean
    |error|), "max_abs_pct": {"p10", "p50", "p90"} of the worst |error|, "run_mean_abs_pct" /
    "run_max_abs_pct" (the run's own errors over the same rows, where they carry error_pct)
    and "run_max_within_p90"}."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    used = []
    for r in rows:
        n = int(r.get("repeats") or 0)
        vals = [r.get(k) for k in ("measured_s", "measured_min_s", "measured_max_s")]
        if n >= 2 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals) \
                and vals[0] > 0:
            used.append((r, n, (vals[2] - vals[1]) / vals[0]))
    if not used:
        return None
    classes: dict[tuple, list[float]] = {}
    for r, n, rel_range in used:
        classes.setdefault(_noise_class(r), []).append(rel_range ** 2 / range_sq_per_variance(n))
    sd_of_class = {k: math.sqrt(sum(v) / len(v)) for k, v in classes.items()}
    # one draw per distinct set of runs: (scenario, codec, the measured numbers)
    units: dict[tuple, int] = {}
    unit_of_row, sd_of_unit = [], []
    for r, n, _ in used:
        key = (_noise_class(r), r.get("context_tokens"), r.get("codec"),
               *(round(float(r[k]), 9) for k in ("measured_s", "measured_min_s",
                                                  "measured_max_s")))
        if key not in units:
            units[key] = len(units)
            sd_of_unit.append(sd_of_class[_noise_class(r)] / math.sqrt(n))
        unit_of_row.append(units[key])
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((draws, len(units))) * np.array(sd_of_unit)  # relative
    errors = 100.0 * np.abs(noise[:, unit_of_row])  # [draws, rows] %
    worst = errors.max(axis=1)
    own = [abs(float(r["error_pct"])) for r, _, _ in used
           if isinstance(r.get("error_pct"), (int, float)) and math.isfinite(r["error_pct"])]
    floor_max = {f"p{q}": float(np.percentile(worst, q)) for q in (10, 50, 90)}
    run_max = max(own) if own else math.nan
    return {"compared": len(used), "draws": int(draws),
            "mean_abs_pct": float(np.median(errors.mean(axis=1))), "max_abs_pct": floor_max,
            "run_mean_abs_pct": sum(own) / len(own) if own else math.nan,
            "run_max_abs_pct": run_max,
            # the run's worst no further out than 9 in 10 exact models' worst
            "run_max_within_p90": bool(run_max <= floor_max["p90"])}


def noise_floor_line(floor: dict) -> str:
    """One line for a validation's summary from noise_floor's result."""
    mx = floor["max_abs_pct"]
    where = "within" if floor["run_max_within_p90"] else "beyond"
    return (f"noise floor: a model exact to the emulator's expected values would score mean "
            f"|error| {floor['mean_abs_pct']:.2f}%, worst {mx['p50']:.2f}% (p10-p90 "
            f"{mx['p10']:.2f}-{mx['p90']:.2f}%) on the {floor['compared']} comparisons with "
            f"repeated runs, from their spread alone ({floor['draws']} simulated validations); "
            f"this run scores {floor['run_mean_abs_pct']:.2f}% / "
            f"{floor['run_max_abs_pct']:.2f}% on them, its worst {where} the floor's p90")


def _noise_class(row: dict) -> tuple:
    """The rows whose runs' spread is pooled: one case, link, rate and metric family."""
    family = "_".join(p for p in str(row.get("metric", "")).split("_") if p != "c")
    return (row.get("case"), row.get("emulation"), row.get("bandwidth_gbps"), family)
