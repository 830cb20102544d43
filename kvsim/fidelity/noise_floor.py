"""The noise floor of a validation: what a model exact to the emulator's expected values would
score from the repeated runs' spread alone, and whether the run's errors lie beyond it.

A single-request comparison's measured value is the mean of its n emulated runs, so even an
exact model misses it by that mean's own noise, sd sigma / sqrt(n). One comparison's range of
n runs is a single estimate of sigma (one degree of freedom for n = 2), so sigma, relative to
the mean, is pooled over a class: the distinct sets of runs of one case, link, rate and metric
(the drafted and committed forms of a metric together):

    sigma^2 = mean over the class's sets of runs of R^2 / range_sq_per_variance(n)

(R the range over the mean; E[R^2] = range_sq_per_variance(n) sigma^2 for normal runs). Rows
that are the same runs' same numbers (a plain codec's drafted and committed times) are one set
of runs: pooled once, drawn once, counted as many times as the summary counts them.

Two things are reported:

- **the floor**, as percentages a reader can set beside the run's: `draws` validations of an
  exact model with normal noise of the pooled sd per row, their median mean |error| and the
  p10 / p50 / p90 of their worst. It takes the pooled sd as known; with a few sets of runs per
  class that sd is itself uncertain (and its square root biased low), so the floor describes,
  it does not test;
- **the test**: the run's largest error in units of its own row's noise sd (studentized:
  |error| / (sigma_class / sqrt n)) against the same statistic of exact models whose runs are
  drawn and whose sigma is pooled again from them, in every draw. Under normal runs the
  statistic does not depend on the true sigma, so its p (the share of exact models at least as
  far out) is calibrated whatever the class sizes: p < `BEYOND_P` says the run's errors go
  beyond the noise, a model error. The metrics of one request are drawn independently though
  their noise is shared in part, which makes exact models' largest errors larger and p, if
  anything, too large (the test conservative).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

DRAWS = 4000  # simulated validations of an exact model
SEED = 0  # fixed: the same rows give the same floor and p
BEYOND_P = 0.1  # p below this: the run's errors go beyond the emulator's noise
_RANGE_SAMPLES = 400_000  # normal samples behind range_sq_per_variance beyond n = 2
_RANGE_SEED = 12345
_DRAW_BLOCK_VALUES = 2_000_000  # normal values drawn at once (bounds the test's memory)


@lru_cache(maxsize=16)
def range_sq_per_variance(n: int) -> float:
    """E[R^2] / sigma^2 for the range R of n normal draws: 2 for n = 2 (R = |x1 - x2|), else
    a fixed-seed Monte Carlo of _RANGE_SAMPLES samples (within ~0.3%)."""
    if n < 2:
        raise ValueError(f"a range needs at least 2 values, got {n}")
    if n == 2:
        return 2.0
    x = np.random.default_rng(_RANGE_SEED).standard_normal((_RANGE_SAMPLES, n))
    return float(np.mean(np.square(x.max(axis=1) - x.min(axis=1))))


def _runs(row: dict) -> int:
    """How many runs the row's range spans (`measured_runs`, else `repeats`: rows saved before
    the runs were counted)."""
    return int(row.get("measured_runs") or row.get("repeats") or 0)


def _usable(row: dict) -> bool:
    values = [row.get(k) for k in ("measured_s", "measured_min_s", "measured_max_s", "error_pct")]
    return _runs(row) >= 2 and \
        all(isinstance(v, (int, float)) and math.isfinite(v) for v in values) and \
        row["measured_s"] > 0


def _noise_class(row: dict) -> tuple:
    """The rows whose runs' spread is pooled: one case, link, rate and metric family."""
    family = "_".join(p for p in str(row.get("metric", "")).split("_") if p != "c")
    return (row.get("case"), row.get("emulation"), row.get("bandwidth_gbps"), family)


def noise_floor(rows: Sequence[dict], draws: int = DRAWS, seed: int = SEED) -> dict | None:
    """The noise floor of the rows with repeated runs (see the module docstring): rows with
    >= 2 runs, a finite measured mean, range and error_pct; None without any.

    Returns {"compared": rows used, "run_sets": distinct sets of runs, "draws",
    "mean_abs_pct" (the floor's median mean |error|), "max_abs_pct": {"p10", "p50", "p90"}
    (of its worst), "run_mean_abs_pct" / "run_max_abs_pct" (the run's own over the same rows),
    "run_max_sd" (the run's largest error in its row's noise sd; inf where a row's class shows
    no spread and the error is not 0), "p" (the share of exact models at least that far out)
    and "beyond" (p < BEYOND_P)}."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    used = [r for r in rows if _usable(r)]
    if not used:
        return None
    sets: dict[tuple, int] = {}  # one per distinct set of runs
    set_of_row, set_class, set_runs, set_range, set_rows = [], [], [], [], []
    classes: dict[tuple, int] = {}
    for r in used:
        key = (_noise_class(r), r.get("context_tokens"), r.get("codec"),
               *(round(float(r[k]), 9) for k in ("measured_s", "measured_min_s",
                                                  "measured_max_s")))
        if key not in sets:
            sets[key] = len(sets)
            set_class.append(classes.setdefault(_noise_class(r), len(classes)))
            set_runs.append(_runs(r))
            set_range.append((r["measured_max_s"] - r["measured_min_s"]) / r["measured_s"])
            set_rows.append(0)
        set_of_row.append(sets[key])
        set_rows[sets[key]] += 1
    cls = np.array(set_class)
    n = np.array(set_runs, dtype=np.float64)
    c_n = np.array([range_sq_per_variance(int(k)) for k in set_runs])
    # [sets, classes]: each set's share of its class's mean
    pool = np.zeros((len(sets), len(classes)))
    pool[np.arange(len(sets)), cls] = 1.0
    pool /= pool.sum(axis=0, keepdims=True)
    sd_class = np.sqrt((np.square(set_range) / c_n) @ pool)  # [classes] relative
    sd_mean = sd_class[cls] / np.sqrt(n)  # [sets] the sd of each set's mean
    weight = np.array(set_rows, dtype=np.float64) / len(used)
    rng = np.random.default_rng(seed)
    # the floor: exact models' misses at the pooled sd (%), in blocks of draws
    block = max(1, _DRAW_BLOCK_VALUES // len(sets))
    means, worsts = [], []
    for start in range(0, draws, block):
        miss = 100.0 * np.abs(rng.standard_normal((min(block, draws - start), len(sets))) *
                              sd_mean)  # [draws in the block, sets]
        means.append(miss @ weight)
        worsts.append(miss.max(axis=1))
    worst = np.concatenate(worsts)
    floor_max = {f"p{q}": float(np.percentile(worst, q)) for q in (10, 50, 90)}
    # the test: the run's largest studentized error against exact models' (sigma 1, pooled
    # again from each draw's own runs)
    own = np.array([abs(float(r["error_pct"])) / 100.0 for r in used])
    scale = sd_mean[set_of_row]
    with np.errstate(divide="ignore", invalid="ignore"):
        studentized = np.where(own == 0.0, 0.0, own / scale)
    run_max_sd = float(studentized.max())
    exact_max_sd = _exact_models_max_sd(n, c_n, pool, cls, draws, rng)
    p = float((1 + np.sum(exact_max_sd >= run_max_sd)) / (1 + draws))
    return {"compared": len(used), "run_sets": len(sets), "draws": int(draws),
            "mean_abs_pct": float(np.median(np.concatenate(means))),
            "max_abs_pct": floor_max,
            "run_mean_abs_pct": 100.0 * float(own.mean()),
            "run_max_abs_pct": 100.0 * float(own.max()),
            "run_max_sd": run_max_sd, "p": p, "beyond": p < BEYOND_P}


def _exact_models_max_sd(n: np.ndarray, c_n: np.ndarray, pool: np.ndarray,
                         cls: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
    """[draws] the largest studentized miss of exact models: each set's n runs drawn N(0, 1),
    its mean's miss over its class's sd pooled from the drawn ranges, / sqrt(n). n: [sets]
    runs per set."""
    widest = int(n.max())
    absent = np.arange(widest)[None, :] >= n[:, None]  # [sets, widest] runs a set lacks
    block = max(1, _DRAW_BLOCK_VALUES // (len(n) * widest))
    out = []
    for start in range(0, draws, block):
        k = min(block, draws - start)
        x = rng.standard_normal((k, len(n), widest))
        mean = np.where(absent, 0.0, x).sum(axis=2) / n
        rng_ = np.where(absent, -np.inf, x).max(axis=2) - np.where(absent, np.inf, x).min(axis=2)
        sd_class = np.sqrt((np.square(rng_) / c_n) @ pool)  # [k, classes]
        out.append((np.abs(mean) * np.sqrt(n) / sd_class[:, cls]).max(axis=1))
    return np.concatenate(out)


def noise_floor_line(floor: dict) -> str:
    """One line for a validation's summary from noise_floor's result."""
    mx = floor["max_abs_pct"]
    verdict = "beyond the noise" if floor["beyond"] else "within the noise"
    return (f"noise floor: a model exact to the emulator's expected values would score mean "
            f"|error| {floor['mean_abs_pct']:.2f}%, worst {mx['p50']:.2f}% (p10-p90 "
            f"{mx['p10']:.2f}-{mx['p90']:.2f}%) on the {floor['compared']} comparisons with "
            f"repeated runs, from their spread alone; this run scores "
            f"{floor['run_mean_abs_pct']:.2f}% / {floor['run_max_abs_pct']:.2f}% on them, its "
            f"largest error {floor['run_max_sd']:.1f} of its row's noise sd: {verdict} "
            f"(p {floor['p']:.3g}: the share of {floor['draws']} exact models as far out)")


__all__ = ["BEYOND_P", "DRAWS", "SEED", "noise_floor", "noise_floor_line",
           "range_sq_per_variance"]
