"""Where the two engines drafted a different number of steps on the anchor's cache.

A split-stream request drafts on the anchor until its full cache is ready. Whether that
cache lands before or after a draft step ends decides one whole draft step and a longer
verification: 10-25% of a committed TTFT at one or two drafts (CHANGELOG.md, 2026-12-07).
Near that boundary the emulator's own runs fall either side (one full-grid scenario had
its two runs draft once and twice), and a simulator that is a few milliseconds early or
late takes the other side. Such a row's error is a decision, not a time that is off by a
little: the summary names those rows, and gives the errors of the rest beside the
headline (which counts every row, as it is).

A single-request row carries the drafts per request of both engines as "accepted/proposed"
(`accepted_measured`: the mean over the emulated runs; `accepted_simulated`: the mean over
the simulator's samples). The drafting differs where the proposed counts are
DRAFTS_APART or more apart.
"""

from __future__ import annotations

import math
from typing import Any

DRAFTS_APART = 0.5  # draft steps per request: half the runs (or samples) took another side

SCENARIO = ("emulation", "bandwidth_gbps", "context_tokens", "codec")


def proposed(accepted: Any) -> float:
    """The proposed (drafted) steps per request of an "accepted/proposed" field; nan where
    the field is absent or malformed (a multi-request row has none)."""
    if not isinstance(accepted, str) or accepted.count("/") != 1:
        return math.nan
    try:
        value = float(accepted.split("/")[1])
    except ValueError:
        return math.nan
    return value if math.isfinite(value) and value >= 0 else math.nan


def drafts_apart(row: dict) -> float:
    """Simulated minus measured drafts per request of a single-request row (nan: no counts,
    or neither engine drafted)."""
    measured = proposed(row.get("accepted_measured"))
    simulated = proposed(row.get("accepted_simulated"))
    if not (math.isfinite(measured) and math.isfinite(simulated)) or \
            measured == simulated == 0:
        return math.nan
    return simulated - measured


def drafting_summary(rows: list[dict]) -> dict:
    """The scenarios that drafted (either engine), those whose draft counts are
    DRAFTS_APART or more apart (each with both counts and its worst |error|), and the mean /
    worst |error| (%) over every other compared row."""
    drafted: dict[tuple, list[dict]] = {}
    for r in rows:
        if math.isfinite(drafts_apart(r)):
            drafted.setdefault(tuple(r.get(k) for k in SCENARIO), []).append(r)
    differing = []
    for key, group in drafted.items():
        apart = drafts_apart(group[0])
        if abs(apart) >= DRAFTS_APART:
            errs = [abs(float(r["error_pct"])) for r in group if _finite(r.get("error_pct"))]
            differing.append({**dict(zip(SCENARIO, key, strict=True)),
                              "drafts_measured": proposed(group[0].get("accepted_measured")),
                              "drafts_simulated": proposed(group[0].get("accepted_simulated")),
                              "max_abs_pct_error": max(errs, default=math.nan)})
    apart_keys = {tuple(d[k] for k in SCENARIO) for d in differing}
    others = [abs(float(r["error_pct"])) for r in rows if _finite(r.get("error_pct"))
              and tuple(r.get(k) for k in SCENARIO) not in apart_keys]
    return {"drafts_apart": DRAFTS_APART, "scenarios_drafted": len(drafted),
            "differing": differing,
            "rows_differing": sum(len(drafted[k]) for k in apart_keys),
            "others_compared": len(others),
            "others_mean_abs_pct_error": sum(others) / len(others) if others else math.nan,
            "others_max_abs_pct_error": max(others, default=math.nan)}


def drafting_line(summary: dict) -> str | None:
    """One line on the drafting decisions (None where no scenario drafted)."""
    if not summary or not summary.get("scenarios_drafted"):
        return None
    differing = summary["differing"]
    if not differing:
        return (f"drafting: the engines drafted within {summary['drafts_apart']:g} step per "
                f"request of each other in every drafted scenario "
                f"({summary['scenarios_drafted']})")
    worst = max(differing, key=lambda d: _or_zero(d["max_abs_pct_error"]))
    return (f"drafting: {len(differing)} of {summary['scenarios_drafted']} drafted scenarios "
            f"drafted {summary['drafts_apart']:g} step per request or more apart (worst "
            f"{worst['codec']} over {worst['emulation']} at {worst['bandwidth_gbps']:g} Gbps, "
            f"{worst['context_tokens']} tokens: {worst['drafts_simulated']:.3g} simulated "
            f"against {worst['drafts_measured']:.3g} measured, up to "
            f"{worst['max_abs_pct_error']:.2f}%); the other {summary['others_compared']} "
            f"comparisons: mean {summary['others_mean_abs_pct_error']:.2f}%, worst "
            f"{summary['others_max_abs_pct_error']:.2f}%")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _or_zero(v: float) -> float:
    return v if math.isfinite(v) else 0.0
