"""`kvsim bench sweep`: its argument checks, and one real round on a two-point grid."""

from __future__ import annotations

import pytest

from kvsim.commands.bench_sweep import Config, run

GRID = ["scenario=none", "model=llama-3.1-8b", "codecs=[int8]", "samples=1",
        "link.bandwidth_gbps=10,40"]


@pytest.mark.parametrize("modes, repeats, grid, match", [
    (["basic", "threads"], 1, GRID, "modes must be"),
    (["basic", "rerun"], 1, GRID, "kvsim_joblib"),
    (["rerun", "kvsim_joblib"], 1, GRID, "kvsim_joblib"),
    (["basic"], 0, GRID, "repeats"),
    (["basic"], 1, [], "grid is empty"),
])
def test_bench_sweep_refuses_what_it_cannot_measure(modes, repeats, grid, match):
    with pytest.raises(ValueError, match=match):
        run(Config(grid=grid, modes=modes, repeats=repeats))


@pytest.mark.slow
def test_bench_sweep_runs_each_mode_and_reports_ratios_to_basic(capsys):
    rows = run(Config(grid=GRID, modes=["basic", "kvsim_joblib", "rerun"], repeats=1))
    by_mode = {r["mode"]: r for r in rows}
    assert all(r["points"] == 2 for r in rows)
    assert by_mode["basic"]["ratio_to_basic"] == 1.0
    joblib = by_mode["kvsim_joblib"]
    assert joblib["ratio_to_basic"] == pytest.approx(joblib["wall_s"] / by_mode["basic"]["wall_s"])
    assert "median wall s" in capsys.readouterr().out
