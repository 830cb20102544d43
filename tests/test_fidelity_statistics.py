"""The validation's statistics beside its mean and worst errors (kvsim.fidelity.statistics),
checked against values computed by hand."""

from __future__ import annotations

import math

import pytest

from kvsim.fidelity import errors
from kvsim.fidelity.statistics import beyond_spread_pct, per_request, tost


def test_a_simulated_value_inside_the_runs_range_is_noise_not_error():
    # runs 2.7 .. 3.3 s, mean 3.0 s
    assert beyond_spread_pct(3.0, 2.7, 3.3, 3.0) == 0.0
    assert beyond_spread_pct(3.0, 2.7, 3.3, 3.3) == 0.0
    assert beyond_spread_pct(3.0, 2.7, 3.3, 3.6) == pytest.approx(10.0)  # 0.3 / 3.0
    assert beyond_spread_pct(3.0, 2.7, 3.3, 2.4) == pytest.approx(-10.0)
    assert math.isnan(beyond_spread_pct(3.0, 2.7, 3.3, math.nan))
    assert math.isnan(beyond_spread_pct(0.0, 0.0, 0.0, 1.0))


def test_tost_of_two_errors_by_hand():
    """errors 1 % and 3 %: mean 2, sd sqrt(2), se 1, one degree of freedom (Student's t with
    one degree of freedom is the Cauchy law: sf(x) = 1/2 - atan(x) / pi)."""
    t = tost([1.0, 3.0], margin_pct=5.0, alpha=0.05)
    p_low = 0.5 - math.atan((2.0 + 5.0) / 1.0) / math.pi  # H0: mean <= -5
    p_high = 0.5 - math.atan((5.0 - 2.0) / 1.0) / math.pi  # H0: mean >= +5
    assert t["n"] == 2 and t["mean_error_pct"] == pytest.approx(2.0)
    assert t["p"] == pytest.approx(max(p_low, p_high))  # 0.1024
    assert t["equivalent"] is False  # two comparisons cannot show it at 5 %
    half = math.tan(math.pi * (0.95 - 0.5))  # the t quantile at 0.95, df 1
    assert t["interval_pct"] == pytest.approx([2.0 - half, 2.0 + half])


def test_tost_shows_equivalence_of_many_small_errors_and_not_of_a_bias():
    small = [1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.5, -1.5]
    assert tost(small)["equivalent"] is True
    biased = [6.0, 7.0, 6.5, 7.5, 6.2, 6.8]  # tightly around +6.7 %: outside the margin
    t = tost(biased)
    assert t["equivalent"] is False and t["interval_pct"][0] > 5.0
    same = tost([2.0, 2.0, 2.0])  # no scatter: the interval is the point
    assert same["equivalent"] is True and same["interval_pct"] == [2.0, 2.0]
    one = tost([1.0, math.nan])  # one finite error: no test
    assert one["n"] == 1 and math.isnan(one["p"]) and one["equivalent"] is False


def test_per_request_mape_pearson_and_ks():
    out = per_request([1.0, 2.0, 3.0, 4.0], [1.1, 1.8, 3.3, 4.0])
    assert out["mape_pct"] == pytest.approx(100 * (0.1 + 0.1 + 0.1 + 0.0) / 4)
    assert out["pairs"] == 4 and out["missing"] == 0
    linear = per_request([1.0, 2.0, 3.0], [2.5, 4.5, 6.5])  # simulated = 2 x measured + 0.5
    assert linear["pearson_r"] == pytest.approx(1.0)
    apart = per_request([1.0, 2.0, 3.0], [10.0, 11.0, 12.0])  # no overlap at all
    assert apart["ks_statistic"] == pytest.approx(1.0)
    same = per_request([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same["ks_statistic"] == 0.0 and same["ks_p"] == pytest.approx(1.0)
    flat = per_request([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])  # a constant side: no r
    assert math.isnan(flat["pearson_r"])
    gap = per_request([1.0, math.nan, 2.0], [1.0, 5.0, 2.0])
    assert (gap["pairs"], gap["missing"]) == (2, 1) and gap["mape_pct"] == 0.0
    offset = per_request([1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5])  # a constant +0.5 s:
    assert offset["pearson_r"] == pytest.approx(1.0)  # r cannot see it ...
    assert offset["mape_pct"] == pytest.approx(100 * (0.5 + 0.25 + 0.5 / 3 + 0.125) / 4)
    with pytest.raises(ValueError, match="same requests"):
        per_request([1.0], [1.0, 2.0])


def test_compare_keeps_the_runs_range_and_the_summary_counts_model_errors():
    m = errors.Metric("tt32t", "ttkt_from_prefill_end_s", "32")
    per = [{"ttkt_from_prefill_end_s": {"32": v}} for v in (2.7, 3.0, 3.3)]
    measured = {"ttkt_from_prefill_end_s": {"32": 3.0}, "per_request": per}
    inside, = errors.compare({}, measured, {"ttkt_from_prefill_end_s": {"32": 3.2}}, [m])
    outside, = errors.compare({}, measured, {"ttkt_from_prefill_end_s": {"32": 3.6}}, [m])
    assert (inside["measured_min_s"], inside["measured_max_s"]) == (2.7, 3.3)
    assert inside["beyond_spread_pct"] == 0.0
    assert outside["beyond_spread_pct"] == pytest.approx(10.0)
    lone = {"metric": "ttft", "error_pct": -4.0, "measured_s": 1.0, "simulated_s": 0.96}
    s = errors.summary([{**inside, "case": "single"}, {**outside, "case": "single"},
                        {**lone, "case": "multi"}])
    # over the rows with repeated runs only (the lone row has no spread to be inside)
    assert (s["with_spread"], s["inside_spread"], s["model_errors"]) == (2, 1, 1)
    assert s["mean_abs_pct_beyond_spread"] == pytest.approx((0.0 + 10.0) / 2)
    assert s["max_abs_pct_beyond_spread"] == pytest.approx(10.0)
    assert s["by_case"]["multi"] == {"compared": 1, "mean_abs_pct_error": 4.0,
                                     "max_abs_pct_error": 4.0}
    assert s["by_case"]["single"]["compared"] == 2
    assert set(s["tost"]) == {"tt32t", "ttft"} and s["tost"]["tt32t"]["n"] == 2
    # the noise floor: the two single rows are one set of three runs (measured_runs), the
    # lone row has none
    assert inside["measured_runs"] == 3
    assert (s["noise_floor"]["compared"], s["noise_floor"]["run_sets"]) == (2, 1)


def test_recompare_measures_the_new_value_against_the_saved_range():
    m = errors.Metric("ttft", "ttft_from_prefill_end_s")
    saved = [{"metric": "ttft", "measured_s": 2.0, "simulated_s": 9.0, "error_pct": 350.0,
              "measured_min_s": 1.8, "measured_max_s": 2.2, "beyond_spread_pct": 340.0}]
    row, = errors.recompare(saved, {"ttft_from_prefill_end_s": 2.4}, [m], {})
    assert row["error_pct"] == pytest.approx(20.0)
    assert row["beyond_spread_pct"] == pytest.approx(10.0)  # (2.4 - 2.2) / 2.0
