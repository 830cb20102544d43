"""Spread over samples: the interval arithmetic against hand-computed values."""

from __future__ import annotations

import math

import pytest

from kvsim.sim.spread import interval, spread_of, t_quantile


def test_t_quantiles_match_the_table():
    # two-sided 95%: t(0.975, dof) from any statistics table
    for dof, expected in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (31, 2.040)):
        assert t_quantile(0.975, dof) == pytest.approx(expected, abs=1e-3)


def test_interval_by_hand():
    # values 1, 2, 3, 4: mean 2.5, std sqrt(5/3) = 1.29099; half = 3.1824 * 1.29099 / 2
    iv = interval([1.0, 2.0, 3.0, 4.0])
    assert iv.mean == 2.5 and iv.n == 4
    assert iv.std == pytest.approx(math.sqrt(5.0 / 3.0), rel=1e-12)
    half = 3.182446305 * math.sqrt(5.0 / 3.0) / 2.0
    assert iv.ci95_low == pytest.approx(2.5 - half, rel=1e-9)
    assert iv.ci95_high == pytest.approx(2.5 + half, rel=1e-9)
    assert iv.half_width == pytest.approx(half, rel=1e-9)


def test_one_sample_has_no_spread_and_constant_samples_have_zero():
    one = interval([3.0])
    assert one.std is None and one.ci95_low is None and one.half_width is None
    same = interval([2.0, 2.0, 2.0])
    assert same.std == 0.0 and same.ci95_low == same.ci95_high == 2.0


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="no values"):
        interval([])
    with pytest.raises(ValueError, match="non-finite"):
        interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        interval([1.0, 2.0], confidence=1.0)


def test_spread_of_rows_covers_scalars_and_token_indices():
    rows = [{"ttft_s": 1.0, "ttkt_s": {1: 1.0, 32: 3.0}, "codec": "x"},
            {"ttft_s": 3.0, "ttkt_s": {1: 3.0, 32: 5.0}, "codec": "x"}]
    s = spread_of(rows)
    assert s["ttft_s"]["mean"] == 2.0 and s["ttft_s"]["std"] == pytest.approx(math.sqrt(2.0))
    assert s["ttkt_s.32"]["mean"] == 4.0
    assert "codec" not in s


def test_sim_rows_carry_the_spread_of_their_samples():
    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig
    from kvsim.sim.run import run_all

    cfg, _ = compose("sim", ["codecs=[int8,lynx]", "samples=8"], SimConfig)
    rows = {r["codec"]: r for r in run_all(cfg)[0]}
    lynx = rows["lynx"]["spread"]["ttkt_s.32"]
    assert lynx["n"] == 8 and lynx["std"] > 0  # acceptance draws differ between samples
    assert lynx["ci95_low"] < rows["lynx"]["ttkt_s"][32] < lynx["ci95_high"]
    assert lynx["mean"] == pytest.approx(rows["lynx"]["ttkt_s"][32], rel=1e-12)
    assert rows["int8"]["spread"]["ttft_s"]["std"] == 0.0  # nothing random in int8's path
    cfg, _ = compose("sim", ["codecs=[lynx]", "samples=1"], SimConfig)
    assert run_all(cfg)[0][0]["spread"]["ttft_s"]["std"] is None
