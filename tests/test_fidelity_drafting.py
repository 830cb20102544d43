"""The summary's drafting decisions: scenarios whose engines drafted a different number of
steps on the anchor, named apart from the rest (kvsim.fidelity.drafting)."""

import json
import math
from pathlib import Path

import pytest

from kvsim.fidelity import errors
from kvsim.fidelity.drafting import (
    DRAFTS_APART,
    drafting_line,
    drafting_summary,
    drafts_apart,
    proposed,
)

ROOT = Path(__file__).resolve().parents[1]


def _row(codec, rate, metric, error_pct, accepted_measured="0/0", accepted_simulated="0/0",
         emulation="tc", ctx=1536):
    return {"case": "single", "emulation": emulation, "bandwidth_gbps": rate,
            "context_tokens": ctx, "codec": codec, "metric": metric, "measured_s": 1.0,
            "simulated_s": 1.0 + error_pct / 100, "error_pct": error_pct,
            "accepted_measured": accepted_measured, "accepted_simulated": accepted_simulated}


def test_the_proposed_count_is_read_from_the_accepted_field():
    assert proposed("1.88/2") == 2.0
    assert proposed("0/0") == 0.0
    for bad in (None, "", "2", "1/x", "1/2/3", "1/-1", "1/nan", 3):
        assert math.isnan(proposed(bad)), bad


def test_neither_engine_drafting_is_no_drafting_scenario():
    assert math.isnan(drafts_apart(_row("int8", 0.6, "ttft", 2.0)))
    assert drafts_apart(_row("lynx", 0.6, "ttft", 2.0, "1/1", "1.88/2")) == 1.0
    assert drafts_apart(_row("lynx", 0.6, "ttft", 2.0, "5.5/5.5", "5/5")) == -0.5
    # a multi-request row carries no counts
    assert math.isnan(drafts_apart({"case": "multi", "error_pct": 3.0}))


def test_scenarios_drafted_apart_are_named_and_the_rest_scored_without_them():
    rows = [
        # lynx at 0.6 Gbps: 2 simulated against 1 measured, both metrics
        _row("lynx", 0.6, "ttft", -10.0, "1/1", "1.88/2"),
        _row("lynx", 0.6, "ttft_c", 15.0, "1/1", "1.88/2"),
        # lynx at 0.2 Gbps: within half a step (5.25 against 5.5)
        _row("lynx", 0.2, "ttft", -3.0, "5.5/5.5", "5.25/5.25"),
        _row("lynx", 0.2, "ttft_c", 1.0, "5.5/5.5", "5.25/5.25"),
        # int8 never drafts
        _row("int8", 0.6, "ttft", 2.0),
        _row("int8", 0.6, "ttft_c", -4.0),
        {"case": "multi", "emulation": "token_bucket", "bandwidth_gbps": 0.6,
         "context_tokens": 768, "codec": "lynx", "metric": "ttft_p50", "error_pct": 6.0},
    ]
    s = drafting_summary(rows)
    assert s["scenarios_drafted"] == 2
    assert s["rows_differing"] == 2
    assert [(d["codec"], d["bandwidth_gbps"], d["drafts_measured"], d["drafts_simulated"],
             d["max_abs_pct_error"]) for d in s["differing"]] == [("lynx", 0.6, 1.0, 2.0, 15.0)]
    assert s["others_compared"] == 5
    assert s["others_mean_abs_pct_error"] == pytest.approx((3 + 1 + 2 + 4 + 6) / 5)
    assert s["others_max_abs_pct_error"] == 6.0
    line = drafting_line(s)
    assert "1 of 2 drafted scenarios" in line and "2 simulated against 1 measured" in line
    assert "up to 15.00%" in line and "other 5 comparisons: mean 3.20%, worst 6.00%" in line


def test_the_threshold_is_half_a_step_per_request():
    at = _row("lynx", 0.6, "ttft", 1.0, "1/1", f"{1 + DRAFTS_APART}/{1 + DRAFTS_APART}")
    below = _row("lynx", 0.2, "ttft", 1.0, "1/1", "1.4/1.4")
    s = drafting_summary([at, below])
    assert [d["bandwidth_gbps"] for d in s["differing"]] == [0.6]


def test_no_drafted_scenario_gives_no_line_and_agreeing_ones_say_so():
    assert drafting_line(drafting_summary([_row("int8", 0.6, "ttft", 2.0)])) is None
    line = drafting_line(drafting_summary([_row("lynx", 0.6, "ttft", 2.0, "2/2", "2/2")]))
    assert line.endswith("in every drafted scenario (1)")


def test_the_summary_carries_it():
    rows = [_row("lynx", 0.6, "ttft_c", 15.0, "1/1", "2/2"), _row("int8", 0.6, "ttft", 2.0)]
    assert errors.summary(rows)["drafting"]["rows_differing"] == 1


def test_the_shipped_heldout_run_names_its_worst_row_a_drafting_decision():
    rows = json.loads((ROOT / "data/fidelity/2026-12-07-heldout/report.json").read_text())["rows"]
    s = drafting_summary(rows)
    worst = max(s["differing"], key=lambda d: d["max_abs_pct_error"])
    assert (worst["emulation"], worst["bandwidth_gbps"], worst["codec"]) == ("tc", 0.6, "lynx")
    assert (worst["drafts_measured"], worst["drafts_simulated"]) == (1.0, 2.0)
    # the run's worst row is that scenario's
    assert worst["max_abs_pct_error"] == pytest.approx(
        max(abs(r["error_pct"]) for r in rows if r["error_pct"] is not None))
    # the rest, counted here from the rows themselves
    apart = {(d["emulation"], d["bandwidth_gbps"], d["context_tokens"], d["codec"])
             for d in s["differing"]}
    rest = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None and
            (r["emulation"], r["bandwidth_gbps"], r["context_tokens"], r["codec"]) not in apart]
    assert s["others_compared"] == len(rest) == len(rows) - s["rows_differing"]
    assert s["others_max_abs_pct_error"] == pytest.approx(max(rest))
    assert s["others_max_abs_pct_error"] < 8.0 < worst["max_abs_pct_error"]
