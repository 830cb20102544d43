"""Where the two engines made a different drafting decision on the anchor's cache.

A split-stream request drafts on the anchor until its full cache is ready. Whether that
cache lands before or after a draft step ends decides one whole draft step and a longer
verification: lynx's committed TTFT at 0.6 Gbps and 1,536 tokens came out 9-19% off where
the simulator drafted twice and the emulator once (CHANGELOG.md, 2026-12-07).
Near that boundary the emulator's own runs fall either side (one full-grid scenario had
its two runs draft once and twice), and a simulator that is a few milliseconds early or
late takes the other side. Such a row's error is a decision, not a time that is off by a
little: the summary names those scenarios, and gives the errors of every other comparison
beside the headline (which counts every row, as it is).

A single-request row carries the draft steps per request of both engines as
"accepted/proposed" (`accepted_measured`: the mean over the emulated runs;
`accepted_simulated`: the mean over the simulator's samples; 3 significant figures). A
scenario's decision differs where the proposed counts are MIN_DRAFTS_APART or more apart
and that difference is MIN_SHARE_APART or more of the larger count. At many drafts (6-13 at
0.1 Gbps) one step more or less is a few percent of the drafting window, and the two engines'
times there differ by how many drafts were accepted, which is not a decision.
"""

from __future__ import annotations

import math
from typing import Any

from kvsim.core.report import finite_number
from kvsim.fidelity.first_draft import KEYS as FIRST_DRAFT_KEYS

__all__ = ["MIN_DRAFTS_APART", "MIN_SHARE_APART", "decision_differs", "drafting_line",
           "drafting_summary", "drafts_apart_per_request", "proposed_per_request"]

MIN_DRAFTS_APART = 0.5  # draft steps per request (a mean difference over runs or samples)
MIN_SHARE_APART = 0.25  # of the larger count: 1 against 2, 1.5 against 2, 3 against 4

# one scenario's rows: its case (single, multi or prefix rows may share the rest), link, rate,
# prompt and codec
SCENARIO_KEYS = ("case", "emulation", "bandwidth_gbps", "context_tokens", "codec")


def proposed_per_request(accepted: Any) -> float:
    """The proposed (drafted) steps per request of an "accepted/proposed" field; nan where
    the field is absent or malformed (a multi-request row has none)."""
    if not isinstance(accepted, str) or accepted.count("/") != 1:
        return math.nan
    try:
        value = float(accepted.split("/")[1])
    except ValueError:
        return math.nan
    return value if math.isfinite(value) and value >= 0 else math.nan


def _counts(row: dict) -> tuple[float, float] | None:
    """(measured, simulated) draft steps per request of a single-request row; None without
    both counts, or where neither engine drafted."""
    measured = proposed_per_request(row.get("accepted_measured"))
    simulated = proposed_per_request(row.get("accepted_simulated"))
    if not (math.isfinite(measured) and math.isfinite(simulated)) or \
            measured == simulated == 0:
        return None
    return measured, simulated


def drafts_apart_per_request(row: dict) -> float:
    """Simulated minus measured draft steps per request of a single-request row (nan: no
    counts, or neither engine drafted)."""
    counts = _counts(row)
    return math.nan if counts is None else counts[1] - counts[0]


def decision_differs(row: dict) -> bool:
    """Whether a row's two engines drafted MIN_DRAFTS_APART or more steps per request apart,
    and MIN_SHARE_APART or more of the larger count."""
    counts = _counts(row)
    if counts is None:
        return False
    apart = abs(counts[1] - counts[0])
    return apart >= MIN_DRAFTS_APART and apart >= MIN_SHARE_APART * max(counts)


def drafting_summary(compared: list[dict]) -> dict:
    """Over the compared rows (each with a finite error_pct: errors.summary's), the
    scenarios that drafted (either engine), those whose drafting decision differs
    (decision_differs: each with both counts and its worst |error| %), and the mean / worst
    |error| (%) over every other row."""
    drafted: dict[tuple, list[dict]] = {}
    for r in compared:
        if _counts(r) is not None:
            drafted.setdefault(_scenario(r), []).append(r)
    differing = []
    for key, group in drafted.items():
        # the counts are the scenario's, the same on each of its rows: its first row's
        measured, simulated = _counts(group[0])
        if decision_differs(group[0]):
            differing.append({**dict(zip(SCENARIO_KEYS, key, strict=True)),
                              "drafts_per_request_measured": measured,
                              "drafts_per_request_simulated": simulated,
                              "max_abs_pct_error": max(abs(float(r["error_pct"]))
                                                       for r in group),
                              # (kvsim.fidelity.first_draft; None where the row has none)
                              **{k: finite_number(group[0].get(k)) for k in FIRST_DRAFT_KEYS},
                              # its worker's pace against the simulated one, and whether the
                              # simulation ran on it (kvsim.fidelity.worker_level)
                              "worker_level": finite_number(group[0].get("worker_level")),
                              "worker_level_from": group[0].get("worker_level_from")})
    apart = {tuple(d[k] for k in SCENARIO_KEYS) for d in differing}
    others = [abs(float(r["error_pct"])) for r in compared if _scenario(r) not in apart]
    return {"min_drafts_apart_per_request": MIN_DRAFTS_APART,
            "min_share_apart": MIN_SHARE_APART, "scenarios_drafted": len(drafted),
            "differing": differing,
            "rows_differing": sum(len(drafted[k]) for k in apart),
            "others_compared": len(others),
            "others_mean_abs_pct_error": sum(others) / len(others) if others else math.nan,
            "others_max_abs_pct_error": max(others, default=math.nan)}


def drafting_line(summary: dict) -> str | None:
    """One line on the drafting decisions (None where no scenario drafted)."""
    if not summary or not summary.get("scenarios_drafted"):
        return None
    drafted = summary["scenarios_drafted"]
    differing = summary["differing"]
    if not differing:
        return (f"drafting: the engines made the same drafting decision in all {drafted} "
                "drafted scenarios (draft steps per request less than half a step, or less "
                "than a quarter, apart)")
    worst = max(differing, key=lambda d: d["max_abs_pct_error"])
    others = (f"the other {summary['others_compared']} comparisons: mean "
              f"{summary['others_mean_abs_pct_error']:.2f}%, worst "
              f"{summary['others_max_abs_pct_error']:.2f}%" if summary["others_compared"]
              else "no other comparison")
    return (f"drafting: the engines made different drafting decisions in {len(differing)} "
            f"of {drafted} drafted scenarios (worst {worst['codec']} over {worst['emulation']} at "
            f"{worst['bandwidth_gbps']} Gbps, {worst['context_tokens']} tokens: "
            f"{worst['drafts_per_request_simulated']:.3g} draft steps per request simulated "
            f"against {worst['drafts_per_request_measured']:.3g} measured, its worst metric "
            f"{worst['max_abs_pct_error']:.2f}% off{_first_draft(worst)}"
            f"{_worker(worst)}); {others}")


def _worker(d: dict) -> str:
    """'; its on-arrival worker at X x the simulated pace' of a differing scenario
    (kvsim.fidelity.worker_level), or '' where it has no level."""
    level = d.get("worker_level")
    if level is None:
        return ""
    ran = " (simulated on it)" if d.get("worker_level_from") == "scenario" else ""
    return f"; its on-arrival worker at {level:.2f} x the simulated pace{ran}"


def _first_draft(d: dict) -> str:
    """'; anchor ready to the first draft step's end X ms measured, ...' of a differing scenario
    (kvsim.fidelity.first_draft), or '' where it has none measured and simulated."""
    measured, replayed, simulated = (d.get(k) for k in FIRST_DRAFT_KEYS)
    if measured is None or simulated is None:
        return ""
    again = "" if replayed is None else \
        f", {replayed * 1e3:.0f} replayed on the emulator's own worker"
    return (f"; anchor ready to the first draft step's end {measured * 1e3:.0f} ms "
            f"measured{again}, {simulated * 1e3:.0f} simulated")


def _scenario(row: dict) -> tuple:
    return tuple(row.get(k) for k in SCENARIO_KEYS)
