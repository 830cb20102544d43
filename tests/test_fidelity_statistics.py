"""The validation's statistics beside its mean and worst errors (kvsim.fidelity.statistics),
checked against values computed by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvsim.core.paths import DATA_DIR
from kvsim.fidelity import errors
from kvsim.fidelity.statistics import (
    beyond_spread_pct,
    noise_floor,
    noise_floor_line,
    per_request,
    range_sq_per_variance,
    tost,
)


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


def test_recompare_measures_the_new_value_against_the_saved_range():
    m = errors.Metric("ttft", "ttft_from_prefill_end_s")
    saved = [{"metric": "ttft", "measured_s": 2.0, "simulated_s": 9.0, "error_pct": 350.0,
              "measured_min_s": 1.8, "measured_max_s": 2.2, "beyond_spread_pct": 340.0}]
    row, = errors.recompare(saved, {"ttft_from_prefill_end_s": 2.4}, [m], {})
    assert row["error_pct"] == pytest.approx(20.0)
    assert row["beyond_spread_pct"] == pytest.approx(10.0)  # (2.4 - 2.2) / 2.0


def _repeated_row(runs: list[float], metric: str = "ttft", rate: float = 1.0,
                  codec: str = "int8", ctx: int = 1024, simulated_s: float = 1.0) -> dict:
    mean = sum(runs) / len(runs)
    return {"case": "single", "emulation": "token_bucket", "bandwidth_gbps": rate,
            "context_tokens": ctx, "codec": codec, "metric": metric, "repeats": len(runs),
            "measured_s": mean, "measured_min_s": min(runs), "measured_max_s": max(runs),
            "simulated_s": simulated_s, "error_pct": 100.0 * (simulated_s - mean) / mean}


def test_the_range_of_normal_draws_against_their_variance():
    """E[R^2] = 2 sigma^2 for two draws; 3.655 and 5.013 for three and four (the quality-
    control tables' d2^2 + d3^2: 1.693^2 + 0.888^2, 2.059^2 + 0.880^2)."""
    assert range_sq_per_variance(2) == 2.0
    assert range_sq_per_variance(3) == pytest.approx(1.693 ** 2 + 0.888 ** 2, rel=0.01)
    assert range_sq_per_variance(4) == pytest.approx(2.059 ** 2 + 0.880 ** 2, rel=0.01)
    with pytest.raises(ValueError, match="at least 2"):
        range_sq_per_variance(1)


def test_the_noise_floor_of_runs_with_known_noise():
    """Two classes of 150 rows (two rates), each row two runs of relative sd 2% and 6% about
    1 s: an exact model misses each row's mean by N(0, sd / sqrt 2), so its mean |error| is
    the average of sd / sqrt 2 * sqrt(2 / pi), 2.26%, and its worst that of 300 such misses
    (simulated here independently of the floor's own draws); the floor, which sees only each
    row's two runs, finds both within the error of 150 ranges per class."""
    rng = np.random.default_rng(7)
    rows = [_repeated_row(list(1.0 + sd * rng.standard_normal(2)), rate=rate, ctx=i)
            for rate, sd in ((0.1, 0.02), (1.0, 0.06)) for i in range(150)]
    floor = noise_floor(rows)
    expected_mean = 100 * (0.02 + 0.06) / 2 / math.sqrt(2) * math.sqrt(2 / math.pi)
    assert floor["compared"] == 300 and floor["draws"] == 4000
    assert floor["mean_abs_pct"] == pytest.approx(expected_mean, rel=0.15)
    sds = np.repeat([0.02, 0.06], 150) / math.sqrt(2)
    worst = 100 * np.abs(np.random.default_rng(8).standard_normal((4000, 300)) * sds).max(1)
    for q in (10, 50, 90):
        assert floor["max_abs_pct"][f"p{q}"] == pytest.approx(np.percentile(worst, q),
                                                              rel=0.15)
    assert noise_floor(rows) == floor  # a fixed seed: the same rows, the same floor


def test_the_noise_floor_draws_once_for_the_same_runs_and_ignores_rows_without_repeats():
    """A plain codec's drafted and committed TTFT are the same two runs' same numbers: one
    draw for both, so the worst of the two is their common miss, the mean |error| of each
    draw is it too, and the two medians agree; a row of one run has no spread and is left
    out, and without any repeated row there is no floor."""
    drafted = _repeated_row([0.95, 1.05], metric="ttft", simulated_s=1.1)
    committed = {**drafted, "metric": "ttft_c"}
    lone = {**_repeated_row([1.0]), "measured_min_s": 1.0, "measured_max_s": 1.0}
    floor = noise_floor([drafted, committed, lone])
    assert floor["compared"] == 2
    assert floor["mean_abs_pct"] == pytest.approx(floor["max_abs_pct"]["p50"])
    # sd of the mean: range 0.1 / sqrt 2 (one class, one pair) / sqrt 2; median |N| = 0.674
    assert floor["max_abs_pct"]["p50"] == pytest.approx(100 * 0.05 * 0.6745, rel=0.05)
    assert floor["run_max_abs_pct"] == pytest.approx(10.0)
    assert not floor["run_max_within_p90"]  # 10% against a floor's p90 of ~8%
    assert "its worst beyond the floor's p90" in noise_floor_line(floor)
    assert noise_floor([lone]) is None and noise_floor([]) is None
    quiet = noise_floor([_repeated_row([1.0, 1.0], simulated_s=1.0)])
    assert quiet["max_abs_pct"] == {"p10": 0.0, "p50": 0.0, "p90": 0.0}
    assert quiet["run_max_within_p90"]
    assert errors.summary([drafted, committed])["noise_floor"] == \
        noise_floor([drafted, committed])


@pytest.mark.parametrize(("name", "mean_pct", "worst_p10_p50_p90", "run_pct", "within"), [
    ("2026-11-30-full-tc-host", 0.84, (3.17, 3.92, 5.05), (2.24, 5.84), False),
    ("2026-11-30-heldout-tc-host-2", 0.63, (1.87, 2.60, 3.88), (1.74, 6.78), False),
    ("2026-12-06-full-4", 1.33, (6.83, 8.65, 11.26), (2.20, 8.70), True),
    ("2026-12-06-heldout-3", 3.73, (11.44, 15.67, 21.54), (3.54, 9.72), True)])
def test_the_shipped_runs_noise_floors(name, mean_pct, worst_p10_p50_p90, run_pct, within):
    """data/fidelity/<name>: the noise floor of its comparisons with repeated runs, as the
    Fidelity page gives it. On 2026-11-30 the runs' worst rows lay beyond what their runs'
    spread alone would give; on 2026-12-06 (a noisier host) within it."""
    report = json.loads((DATA_DIR / "fidelity" / name / "report.json").read_text())
    floor = noise_floor(report["rows"])
    assert floor["mean_abs_pct"] == pytest.approx(mean_pct, abs=0.005)
    assert [floor["max_abs_pct"][q] for q in ("p10", "p50", "p90")] == \
        pytest.approx(list(worst_p10_p50_p90), abs=0.005)
    assert (floor["run_mean_abs_pct"], floor["run_max_abs_pct"]) == \
        pytest.approx(run_pct, abs=0.005)
    assert floor["run_max_within_p90"] is within
