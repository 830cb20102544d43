"""The summary's drafting decisions: scenarios whose engines drafted a different number of
steps on the anchor, named apart from the rest (kvsim.fidelity.drafting)."""

import json
import math
from pathlib import Path

import pytest

from kvsim.fidelity import errors
from kvsim.fidelity.drafting import (
    MIN_DRAFTS_APART,
    MIN_SHARE_APART,
    decision_differs,
    drafting_line,
    drafting_summary,
    drafts_apart_per_request,
    proposed_per_request,
)

ROOT = Path(__file__).resolve().parents[1]


def _row(codec, rate, metric, error_pct, accepted_measured="0/0", accepted_simulated="0/0",
         emulation="tc", ctx=1536, case="single"):
    return {"case": case, "emulation": emulation, "bandwidth_gbps": rate,
            "context_tokens": ctx, "codec": codec, "metric": metric, "measured_s": 1.0,
            "simulated_s": 1.0 + (error_pct or 0.0) / 100, "error_pct": error_pct,
            "accepted_measured": accepted_measured, "accepted_simulated": accepted_simulated}


def test_the_proposed_count_is_read_from_the_accepted_field():
    assert proposed_per_request("1.88/2") == 2.0
    assert proposed_per_request("0/0") == 0.0
    for bad in (None, "", "2", "1/x", "1/2/3", "1/-1", "1/nan", 3):
        assert math.isnan(proposed_per_request(bad)), bad


def test_neither_engine_drafting_is_no_drafting_scenario():
    assert math.isnan(drafts_apart_per_request(_row("int8", 0.6, "ttft", 2.0)))
    assert drafts_apart_per_request(_row("lynx", 0.6, "ttft", 2.0, "1/1", "1.88/2")) == 1.0
    assert drafts_apart_per_request(_row("lynx", 0.6, "ttft", 2.0, "5.5/5.5", "5/5")) == -0.5
    # a multi-request row carries no counts
    assert math.isnan(drafts_apart_per_request({"case": "multi", "error_pct": 3.0}))


def test_a_decision_is_half_a_step_and_a_quarter_of_the_larger_count():
    assert (MIN_DRAFTS_APART, MIN_SHARE_APART) == (0.5, 0.25)

    def differs(measured, simulated):
        return decision_differs(_row("lynx", 0.6, "ttft", 1.0, f"0/{measured}",
                                     f"0/{simulated}"))

    assert differs(1, 2) and differs(2, 1)  # either side
    assert differs(1.5, 2) and differs(2, 1.5)  # half a step, a quarter of 2
    assert differs(3, 4)
    assert not differs(1, 1.4)  # under half a step
    assert not differs(12.5, 12) and not differs(5.5, 5)  # a few percent of many drafts
    assert not differs(0, 0)


def test_scenarios_that_decided_apart_are_named_and_the_rest_scored_without_them():
    rows = [
        # lynx at 0.6 Gbps: 2 simulated against 1 measured, both metrics
        _row("lynx", 0.6, "ttft", -10.0, "1/1", "1.88/2"),
        _row("lynx", 0.6, "ttft_c", 15.0, "1/1", "1.88/2"),
        # lynx at 0.2 Gbps: 5.25 against 5.5, the same decision
        _row("lynx", 0.2, "ttft", -3.0, "5.5/5.5", "5.25/5.25"),
        _row("lynx", 0.2, "ttft_c", 1.0, "5.5/5.5", "5.25/5.25"),
        # int8 never drafts
        _row("int8", 0.6, "ttft", 2.0),
        _row("int8", 0.6, "ttft_c", -4.0),
        # a multi-request row with the same link, rate, prompt and codec as the lynx
        # scenario that decided apart: another case, so among the others
        {"case": "multi", "emulation": "tc", "bandwidth_gbps": 0.6, "context_tokens": 1536,
         "codec": "lynx", "metric": "ttft_p50", "error_pct": 6.0},
        # a row without an error is counted nowhere (errors.summary's `missing`)
        _row("lynx", 0.6, "tt32t", None, "1/1", "1.88/2"),
    ]
    s = errors.summary(rows)["drafting"]  # over the compared rows: the null error is not
    assert s["scenarios_drafted"] == 2
    assert s["rows_differing"] == 2
    assert [(d["case"], d["codec"], d["bandwidth_gbps"], d["drafts_per_request_measured"],
             d["drafts_per_request_simulated"], d["max_abs_pct_error"])
            for d in s["differing"]] == [("single", "lynx", 0.6, 1.0, 2.0, 15.0)]
    assert s["others_compared"] == 5
    assert s["rows_differing"] + s["others_compared"] == errors.summary(rows)["compared"]
    assert s["others_mean_abs_pct_error"] == pytest.approx((3 + 1 + 2 + 4 + 6) / 5)
    assert s["others_max_abs_pct_error"] == 6.0
    line = drafting_line(s)
    assert "different drafting decisions in 1 of 2 drafted scenarios" in line
    assert "lynx over tc at 0.6 Gbps, 1536 tokens" in line
    assert "2 draft steps per request simulated against 1 measured" in line
    assert "its worst metric 15.00% off" in line
    assert line.endswith("the other 5 comparisons: mean 3.20%, worst 6.00%")


def test_the_lines_with_nothing_apart_and_with_nothing_else():
    assert drafting_line(drafting_summary([_row("int8", 0.6, "ttft", 2.0)])) is None
    same = drafting_line(drafting_summary([_row("lynx", 0.6, "ttft", 2.0, "2/2", "2/2")]))
    assert same.startswith("drafting: the engines made the same drafting decision in all 1 ")
    alone = drafting_summary([_row("lynx", 0.6, "ttft", 9.0, "1/1", "2/2")])
    assert alone["others_compared"] == 0 and math.isnan(alone["others_mean_abs_pct_error"])
    assert drafting_line(alone).endswith("; no other comparison")


def test_the_summary_carries_it_and_validate_prints_it(capsys):
    from kvsim.fidelity.validation import _print

    rows = [_row("lynx", 0.6, "ttft_c", 15.0, "1/1", "2/2"), _row("int8", 0.6, "ttft", 2.0)]
    summary = errors.summary(rows)
    assert summary["drafting"]["rows_differing"] == 1
    _print(rows, {**summary, "target_mean_abs_pct": 5.0, "target_max_abs_pct": 10.0,
                  "met_mean": True, "met_max": False}, [])
    assert "drafting: the engines made different drafting decisions in 1 of 1" in \
        capsys.readouterr().out


@pytest.mark.parametrize(("name", "drafted", "differing", "others"), [
    # (emulation, Gbps, measured, simulated, worst |error| %) of each differing scenario;
    # the others' count, mean and worst |error| %
    ("2026-12-07-heldout", 4, [("token_bucket", 0.6, 1.5, 2.0, 8.97),
                               ("tc", 0.6, 1.0, 2.0, 15.05)], (96, 1.21, 4.64)),
    ("2026-12-07-full", 12, [], (324, 1.80, 6.61)),
    ("2026-12-07-full-busy", 12, [("token_bucket", 0.3, 1.5, 2.0, 4.94)], (318, 2.00, 22.97)),
    ("2026-12-07-default", 12, [], (324, 2.36, 13.80))])
def test_the_shipped_runs_drafting_decisions(name, drafted, differing, others):
    """data/fidelity/<name>: the drafting decisions as its README and the Fidelity page give
    them; the others counted here from the rows themselves."""
    rows = json.loads((ROOT / "data" / "fidelity" / name / "report.json").read_text())["rows"]
    s = errors.summary(rows)["drafting"]
    assert s["scenarios_drafted"] == drafted
    assert [(d["emulation"], d["bandwidth_gbps"], d["drafts_per_request_measured"],
             d["drafts_per_request_simulated"], round(d["max_abs_pct_error"], 2))
            for d in s["differing"]] == differing
    apart = {(d["emulation"], d["bandwidth_gbps"], d["context_tokens"], d["codec"])
             for d in s["differing"]}
    rest = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None and (
        r["case"] != "single" or
        (r["emulation"], r["bandwidth_gbps"], r["context_tokens"], r["codec"]) not in apart)]
    assert s["others_compared"] == len(rest) == others[0]
    assert s["others_mean_abs_pct_error"] == pytest.approx(others[1], abs=0.005)
    assert s["others_max_abs_pct_error"] == pytest.approx(max(rest))
    assert round(s["others_max_abs_pct_error"], 2) == others[2]


def test_the_shipped_heldout_runs_worst_row_is_a_drafting_decision():
    rows = json.loads((ROOT / "data/fidelity/2026-12-07-heldout/report.json").read_text())[
        "rows"]
    worst = max(errors.summary(rows)["drafting"]["differing"],
                key=lambda d: d["max_abs_pct_error"])
    assert (worst["emulation"], worst["bandwidth_gbps"], worst["codec"]) == ("tc", 0.6, "lynx")
    assert worst["max_abs_pct_error"] == pytest.approx(
        max(abs(r["error_pct"]) for r in rows if r["error_pct"] is not None))
