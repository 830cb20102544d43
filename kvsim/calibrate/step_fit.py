"""Step curves fitted over context, not read point by point.

A decode step (or a verification pass) reads the weights once and the cache once, so its
time is a fixed part plus a part in proportion to the context. Timed on a shared host, one
context's median can land tens of percent off that line (a calibration on 2026-11-25 gave
129 ms at 256 tokens, 113 at 1,024, 132 at 1,536, 199 at 2,048), and read point by point the
curve is then neither monotone nor a good guess between its points. The calibration keeps
its medians (`measured`) and gives the simulator the least-squares line through them,
non-decreasing in context (a negative slope is noise: the line is then flat at the mean),
with the residual that says how far the medians lie from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fit_step_line(context_tokens: Sequence[float], s: Sequence[float]) -> dict:
    """The line s = fixed_s + s_per_token * context through the points, with s_per_token >= 0
    (least squares; flat at the mean where the unconstrained slope is negative, or with one
    context). Returns fixed_s, s_per_token, the fitted times at the contexts (`s`), and the
    residual: rms and worst |measured - fitted| / fitted (%)."""
    x = np.asarray(context_tokens, dtype=np.float64)
    y = np.asarray(s, dtype=np.float64)
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"a step fit needs one time per context, got {x.size} contexts and "
                         f"{y.size} times")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ValueError(f"step times must be finite and > 0 s, got {list(y)}")
    slope = 0.0
    if np.unique(x).size > 1:
        slope = float(np.polyfit(x, y, 1)[0])
    if slope <= 0.0:
        slope, fixed = 0.0, float(y.mean())
    else:
        fixed = float(y.mean() - slope * x.mean())
        if fixed <= 0.0:  # a line through the origin or below: keep times positive
            slope = float(np.dot(x, y) / np.dot(x, x))
            fixed = 0.0
    fitted = fixed + slope * x
    rel = 100.0 * (y - fitted) / fitted
    return {"fixed_s": fixed, "s_per_token": slope, "s": [float(v) for v in fitted],
            "residual_rms_pct": float(np.sqrt(np.mean(rel ** 2))),
            "residual_max_pct": float(np.max(np.abs(rel)))}


def fitted_curve(curve: dict) -> dict:
    """A profile curve over contexts ({"context_tokens": [...], "s": [...]}, or a verification
    curve whose "s" holds one row per context over its drafted counts) with its times
    replaced by their fitted lines (one per drafted count); the medians are kept under
    `measured` (those already there are kept: a curve scaled after its first fit is fitted
    again, its medians stay the measured ones) and each line under `fit`."""
    at = curve["context_tokens"]
    rows = curve["s"]
    if not isinstance(at, list) or len(at) < 2:
        return curve  # one context: nothing to fit
    if rows and isinstance(rows[0], list):  # verification: [context][drafted]
        columns = [fit_step_line(at, [row[j] for row in rows]) for j in range(len(rows[0]))]
        fitted = [[col["s"][i] for col in columns] for i in range(len(at))]
        fits = [{k: v for k, v in col.items() if k != "s"} for col in columns]
    else:
        line = fit_step_line(at, rows)
        fitted, fits = line["s"], {k: v for k, v in line.items() if k != "s"}
    return {**curve, "s": fitted, "measured": curve.get("measured", rows), "fit": fits}
