"""CI's fidelity gate: `kvsim validate grid=quick calibrate=true fail_on_target=true` calibrates
this machine, runs the quick scenarios emulated (real transport, real SmolLM2) and simulated,
and fails when the mean absolute error is above its target (5%). A few minutes; needs the
SmolLM2 weights (`kvsim model fetch`, done by `make test`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.model.presets import load_model_preset
from kvsim.transport.session import weights_available


@pytest.mark.slow
def test_quick_validation_meets_the_mean_error_target(tmp_path):
    if not weights_available(load_model_preset("smollm2-135m")):
        pytest.skip("SmolLM2-135M weights not fetched (kvsim model fetch)")
    run_dir = tmp_path / "run"
    rc = main(["validate", "grid=quick", "calibrate=true", "fail_on_target=true",
               f"hydra.run.dir={run_dir}"])
    doc = json.loads((Path(run_dir) / "fidelity.json").read_text())
    s = doc["summary"]
    # the gate (rc) and the numbers it is made of agree; every comparison has a number
    assert s["compared"] == len(doc["rows"]) > 0 and s["missing"] == 0
    assert all(math.isfinite(r["error_pct"]) for r in doc["rows"])
    assert {r["case"] for r in doc["rows"]} == {"single", "multi"}
    assert (rc == 0) == (s["mean_abs_pct_error"] <= s["target_mean_abs_pct"])
    assert rc == 0, f"mean |error| {s['mean_abs_pct_error']:.2f}% > {s['target_mean_abs_pct']}%"
    assert (Path(run_dir) / "fidelity.png").is_file()
    report = json.loads((Path(run_dir) / "report.json").read_text())
    assert report["mean_abs_pct_error"] == pytest.approx(s["mean_abs_pct_error"])
