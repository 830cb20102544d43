"""The noise floor of a validation (kvsim.fidelity.noise_floor): its floor against noise of a
known size, its test's calibration on exact models and its power on a wrong one, and the
shipped runs' figures as the Fidelity page gives them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvsim.core.paths import DATA_DIR
from kvsim.fidelity import errors
from kvsim.fidelity.noise_floor import noise_floor, noise_floor_line, range_sq_per_variance


def _row(runs: list[float], simulated_s: float, metric: str = "ttft", rate: float = 1.0,
         codec: str = "int8", ctx: int = 1024) -> dict:
    mean = sum(runs) / len(runs)
    return {"case": "single", "emulation": "token_bucket", "bandwidth_gbps": rate,
            "context_tokens": ctx, "codec": codec, "metric": metric, "repeats": len(runs),
            "measured_s": mean, "measured_min_s": min(runs), "measured_max_s": max(runs),
            "simulated_s": simulated_s, "error_pct": 100.0 * (simulated_s - mean) / mean}


def _exact_validation(rng: np.random.Generator, sds: tuple[float, ...], sets: int,
                      runs: int = 2) -> list[dict]:
    """Rows of an exact model: each class (a rate) `sets` rows whose `runs` runs are drawn
    N(1, sd) about the simulated 1 s."""
    return [_row(list(1.0 + sd * rng.standard_normal(runs)), 1.0, rate=float(k), ctx=i)
            for k, sd in enumerate(sds) for i in range(sets)]


def test_the_range_of_normal_draws_against_their_variance():
    """E[R^2] = 2 sigma^2 for two draws; 3.655 and 5.013 for three and four (the quality-
    control tables' d2^2 + d3^2: 1.693^2 + 0.888^2, 2.059^2 + 0.880^2)."""
    assert range_sq_per_variance(2) == 2.0
    assert range_sq_per_variance(3) == pytest.approx(1.693 ** 2 + 0.888 ** 2, rel=0.01)
    assert range_sq_per_variance(4) == pytest.approx(2.059 ** 2 + 0.880 ** 2, rel=0.01)
    with pytest.raises(ValueError, match="at least 2"):
        range_sq_per_variance(1)


def test_the_floor_of_runs_with_known_noise():
    """Two classes of 150 rows (two rates), two runs each of relative sd 2% and 6% about 1 s:
    an exact model misses each row's mean by N(0, sd / sqrt 2), so its mean |error| is the
    average of sd / sqrt 2 * sqrt(2 / pi), 2.26%, and its worst that of 300 such misses
    (simulated here apart from the floor's own draws); the floor, which sees only each row's
    two runs, finds both within the error of 150 ranges per class (sd 6%, here 7% low)."""
    rows = _exact_validation(np.random.default_rng(7), (0.02, 0.06), 150)
    floor = noise_floor(rows)
    expected_mean = 100 * (0.02 + 0.06) / 2 / math.sqrt(2) * math.sqrt(2 / math.pi)
    assert (floor["compared"], floor["run_sets"], floor["draws"]) == (300, 300, 4000)
    assert floor["mean_abs_pct"] == pytest.approx(expected_mean, rel=0.1)
    sds = np.repeat([0.02, 0.06], 150) / math.sqrt(2)
    worst = 100 * np.abs(np.random.default_rng(8).standard_normal((4000, 300)) * sds).max(1)
    for q in (10, 50, 90):
        assert floor["max_abs_pct"][f"p{q}"] == pytest.approx(np.percentile(worst, q),
                                                              rel=0.1)
    assert noise_floor(rows) == floor  # a fixed seed: the same rows, the same figures


def test_each_class_keeps_its_own_spread():
    """Ten rows whose runs agree (rate 0.1) and ten two runs 10% apart (rate 1: sd of the
    mean 0.05): the floor's mean |error| is half of 0.05 * sqrt(2 / pi), 2.0%, where one sd
    pooled over the twenty would give 2.8%."""
    rows = [_row([1.0, 1.0], 1.0, rate=0.1, ctx=i) for i in range(10)] + \
        [_row([0.95, 1.05], 1.0, rate=1.0, ctx=i) for i in range(10)]
    floor = noise_floor(rows)
    assert floor["mean_abs_pct"] == pytest.approx(100 * 0.05 * math.sqrt(2 / math.pi) / 2,
                                                  rel=0.05)


def test_the_same_runs_are_one_set_and_rows_without_runs_are_left_out():
    """A plain codec's drafted and committed TTFT are the same two runs' same numbers: one
    set, pooled and drawn once, so the floor's worst is their common miss and the mean
    |error| of every draw is that miss too (the two medians agree); a row of one run, or
    without a finite error, is left out, and without any repeated row there is no floor."""
    drafted = _row([0.95, 1.05], 1.1, metric="ttft")
    committed = {**drafted, "metric": "ttft_c"}
    lone = _row([1.0], 1.0)
    blind = {**_row([0.9, 1.1], 1.0, ctx=7), "error_pct": math.nan}
    floor = noise_floor([drafted, committed, lone, blind])
    assert (floor["compared"], floor["run_sets"]) == (2, 1)
    assert floor["mean_abs_pct"] == pytest.approx(floor["max_abs_pct"]["p50"])
    # the sd of the mean: range 0.1 / sqrt 2 / sqrt 2; the median of |N(0, 1)| 0.6745
    assert floor["max_abs_pct"]["p50"] == pytest.approx(100 * 0.05 * 0.6745, rel=0.05)
    assert floor["run_max_abs_pct"] == pytest.approx(10.0)
    assert floor["run_max_sd"] == pytest.approx(2.0)  # 0.1 / 0.05
    assert noise_floor([lone, blind]) is None and noise_floor([]) is None
    assert errors.summary([drafted, committed])["noise_floor"] == \
        noise_floor([drafted, committed])
    with pytest.raises(ValueError, match="draws"):
        noise_floor([drafted], draws=0)


def test_the_test_is_calibrated_on_exact_models_whatever_the_class_sizes():
    """200 validations of an exact model, three classes (sd 1%, 3%, 8%) of three sets of two
    runs each (the held-out grid's shape): p < 0.1 in about one in ten of them. Taking each
    class's sd as known instead puts the run's worst beyond the floor's p90 in 30% of these
    validations, not 10%."""
    rng = np.random.default_rng(11)
    ps = [noise_floor(_exact_validation(rng, (0.01, 0.03, 0.08), 3), draws=500)["p"]
          for _ in range(200)]
    beyond = sum(p < 0.1 for p in ps) / len(ps)
    assert 0.05 <= beyond <= 0.16
    assert 0.4 <= float(np.median(ps)) <= 0.6  # p is uniform under an exact model
    floors = [noise_floor(_exact_validation(rng, (0.01, 0.03, 0.08), 3), draws=500)
              for _ in range(200)]
    plug_in = sum(f["run_max_abs_pct"] > f["max_abs_pct"]["p90"] for f in floors) / 200
    assert plug_in > 0.2  # why the test studentizes


def test_a_model_error_beyond_the_noise_is_found():
    """Runs of sd 1% and one row simulated 20% early: tens of its row's noise sd, beyond
    every exact model; the line says so. A class whose runs agree exactly puts any error at an
    infinite distance."""
    rows = _exact_validation(np.random.default_rng(3), (0.01,), 8)
    rows[0] = _row([0.995, 1.005], 0.8, rate=0.0, ctx=0)  # (in the class of the others)
    floor = noise_floor(rows, draws=1000)
    assert floor["beyond"] and floor["p"] == pytest.approx(1 / 1001)
    assert floor["run_max_sd"] > 20
    assert "beyond the noise" in noise_floor_line(floor)
    quiet = noise_floor([_row([1.0, 1.0], 1.01), _row([2.0, 2.0], 2.0, ctx=2)])
    assert quiet["max_abs_pct"] == {"p10": 0.0, "p50": 0.0, "p90": 0.0}
    assert math.isinf(quiet["run_max_sd"]) and quiet["beyond"]


@pytest.mark.parametrize(("name", "floor_mean_pct", "floor_worst_pct", "run_pct", "p"), [
    ("2026-11-30-full-tc-host", 0.86, (3.2, 4.0, 5.2), (2.24, 5.84), 0.001),
    ("2026-11-30-heldout-tc-host-2", 0.66, (2.1, 3.0, 4.5), (1.74, 6.78), 0.127),
    ("2026-12-06-full-4", 1.38, (7.1, 8.9, 11.5), (2.20, 8.70), 0.0452),
    ("2026-12-06-heldout-3", 3.74, (11.4, 15.7, 21.5), (3.54, 9.72), 0.226),
    ("2026-12-06-heldout-4", 1.26, (3.6, 4.8, 6.8), (2.76, 7.53), 0.0585),
    ("2026-12-07-full", 1.09, (3.84, 4.73, 6.13), (1.91, 6.61), 0.0207),
    ("2026-12-07-heldout", 1.08, (3.65, 6.09, 9.66), (2.19, 15.05), 0.012),
    ("2026-12-07-full-busy", 1.23, (7.04, 10.11, 14.09), (2.18, 22.97), 0.0305),
    ("2026-12-07-default", 1.43, (5.54, 6.85, 8.85), (2.55, 13.80), 0.00475)])
def test_the_shipped_runs_noise_floors(name, floor_mean_pct, floor_worst_pct, run_pct, p):
    """data/fidelity/<name>: the noise floor of its comparisons with repeated runs as the
    Fidelity page gives it (its rounding; p depends on the draws' exact layout, which is
    fixed by the seed)."""
    report = json.loads((DATA_DIR / "fidelity" / name / "report.json").read_text())
    floor = noise_floor(report["rows"])
    assert floor["mean_abs_pct"] == pytest.approx(floor_mean_pct, abs=0.005)
    assert [floor["max_abs_pct"][q] for q in ("p10", "p50", "p90")] == \
        pytest.approx(list(floor_worst_pct), abs=0.05)
    assert (floor["run_mean_abs_pct"], floor["run_max_abs_pct"]) == \
        pytest.approx(run_pct, abs=0.005)
    assert floor["p"] == pytest.approx(p, rel=0.01)
    assert floor["beyond"] is (p < 0.1)
