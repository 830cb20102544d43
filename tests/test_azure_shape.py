"""The Azure trace shape script (kvsim.bench.azure_shape) on generated CSVs with known answers:
quantile tables, rank correlation, arrival rate, CV and dispersion, and its --out rules."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from kvsim.bench import azure_shape
from kvsim.scenario.azure_workload import load_azure_shape_file


def _write_trace(path, seconds, context, generated):
    stamps = pd.to_datetime("2023-11-16 18:17:03.9799600") + pd.to_timedelta(seconds, unit="s")
    pd.DataFrame({"TIMESTAMP": stamps.strftime("%Y-%m-%d %H:%M:%S.%f"),
                  "ContextTokens": context, "GeneratedTokens": generated}
                 ).to_csv(path, index=False)


def test_shape_script_computes_known_quantiles_exactly(tmp_path):
    """Contexts 1..101 in shuffled order: the p-quantile is 1 + 100 p exactly; outputs
    204 - 2 * context run backwards (2..202, Spearman -1); arrivals every 0.5 s but one 10 s
    gap."""
    rng = np.random.default_rng(3)
    ctx = rng.permutation(np.arange(1, 102))
    gen = 204 - 2 * ctx
    gaps = np.full(100, 0.5)
    gaps[50] = 10.0
    seconds = np.concatenate([[0.0], np.cumsum(gaps)])
    code = tmp_path / "code.csv"
    _write_trace(code, seconds, ctx, gen)
    out = tmp_path / "out"
    assert azure_shape.main(["--code", str(code), "--out", str(out),
                             "--source-commit", "abc"]) == 0
    shape = json.loads((out / "azure-2023-code.json").read_text())
    p = np.asarray(shape["context_tokens"]["p"])
    assert p[0] == 0.0 and p[-1] == 1.0 and 0.001 in p and 0.999 in p
    np.testing.assert_allclose(shape["context_tokens"]["value"], 1 + 100 * p, rtol=0,
                               atol=1e-9)
    np.testing.assert_allclose(shape["generated_tokens"]["value"], 2 + 200 * p,
                               rtol=0, atol=1e-9)
    assert shape["rank_correlation"]["spearman"] == pytest.approx(-1.0, abs=1e-12)
    assert shape["rank_correlation"]["gaussian_copula_rho"] == pytest.approx(-1.0, abs=1e-12)
    arr = shape["arrivals"]
    assert arr["duration_s"] == pytest.approx(59.5, abs=1e-6)
    assert arr["mean_rate_per_s"] == pytest.approx(100 / 59.5, rel=1e-6)
    cv = np.std(gaps) / np.mean(gaps)
    assert arr["interarrival_s"]["cv"] == pytest.approx(cv, rel=1e-5)
    assert arr["burstiness_b"] == pytest.approx((cv - 1) / (cv + 1), rel=1e-5)
    assert shape["source"]["rows"] == 101 and shape["source"]["commit"] == "abc"
    assert shape["source"]["license"].startswith("CC-BY") and "Splitwise" in \
        shape["source"]["attribution"]
    # the file holds statistics, not the rows: no column of the input is in it
    assert "TIMESTAMP" not in (out / "azure-2023-code.json").read_text()
    # the generator reads what the script wrote
    loaded = load_azure_shape_file(out / "azure-2023-code.json")
    assert loaded.spearman == pytest.approx(-1.0) and loaded.max_generated_tokens() == 202


def test_shape_script_counts_dispersion_and_needs_out(tmp_path):
    """Two requests in every other second (t = 0.1, 0.2, 2.1, 2.2, ..., 118.2): counts per 1 s
    window are 2, 0, 2, ..., 2 (60 twos, 59 zeros): variance / mean = 2 - 120/119 exactly;
    --out is required; an existing file is kept."""
    seconds = np.repeat(np.arange(1, 120, 2), 2) + np.tile([0.1, 0.2], 60)
    conv = tmp_path / "conv.csv"
    _write_trace(conv, seconds - seconds[0] + 0.1, np.full(120, 50), np.full(120, 7))
    shape = azure_shape.measure(conv, "conv", "")
    disp = dict(zip(shape["arrivals"]["count_dispersion"]["window_s"],
                    shape["arrivals"]["count_dispersion"]["variance_over_mean"], strict=True))
    assert disp[1.0] == pytest.approx(2 - 120 / 119, rel=1e-9)
    assert disp[60.0] != disp[60.0] or disp[60.0] >= 0  # NaN (one window) or a number
    with pytest.raises(SystemExit):
        azure_shape.main(["--conv", str(conv)])
    out = tmp_path / "o"
    assert azure_shape.main(["--conv", str(conv), "--out", str(out)]) == 0
    with pytest.raises(SystemExit):
        azure_shape.main(["--conv", str(conv), "--out", str(out)])
    assert azure_shape.main(["--conv", str(conv), "--out", str(out), "--overwrite"]) == 0
