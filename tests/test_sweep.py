"""`kvsim sweep`: grid expansion, one sim run per point, tidy table + sidecar."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvsim.cli import main
from kvsim.sweep import expand_grid, hydra_value, point_overrides, run_sweep

BASE = ["scenario=none", "model=llama-3.1-8b", "codecs=[int8,lynx]", "samples=1",
        "workload.output_tokens=64"]


def test_hydra_value_renders_plain_data():
    assert hydra_value(10) == "10"
    assert hydra_value(2.5) == "2.5"
    assert hydra_value(True) == "true"
    assert hydra_value(None) == "null"
    assert hydra_value("it's") == "'it\\'s'"
    assert hydra_value(["int8", {"preset": "lynx", "acceptance": "geometric:0.9"}]) == \
        "['int8',{preset:'lynx',acceptance:'geometric:0.9'}]"
    with pytest.raises(ValueError, match="not finite"):
        hydra_value(float("nan"))


def test_expand_grid_is_the_product_first_axis_slowest():
    points = expand_grid({"a": [1, 2], "b": ["x", "y", "z"]})
    assert len(points) == 6
    assert points[0] == {"a": 1, "b": "x"} and points[3] == {"a": 2, "b": "x"}


@pytest.mark.parametrize("grid, match", [({}, "grid is empty"), ({"a": []}, "non-empty list"),
                                         ({"a": 3}, "non-empty list"),
                                         ({"a=b": [1]}, "plain config key")])
def test_bad_grids_are_rejected(grid, match):
    with pytest.raises(ValueError, match=match):
        expand_grid(grid)


def test_grid_key_also_in_base_is_rejected():
    with pytest.raises(ValueError, match="also set by the base"):
        point_overrides(["link.bandwidth_gbps=10"], {"link.bandwidth_gbps": 25})


def test_sweep_rows_columns_and_values_follow_the_grid():
    grid = {"link.bandwidth_gbps": [10, 40], "workload.context_tokens": [2048, 4096]}
    result = run_sweep(grid, BASE, progress=False)
    t = result.table
    assert len(t) == 4 * 2  # points x codecs
    for col in ("point", "grid.link.bandwidth_gbps", "grid.workload.context_tokens", "codec",
                "transfer", "ttft_s", "ttkt_s.32", "breakdown_s.decode", "stream_bytes.anchor"):
        assert col in t.columns, col
    assert sorted(t["codec"].unique()) == ["int8", "lynx"]
    # the simulator ran with the grid's values, not the base config's
    assert (t["bandwidth_gbps"] == t["grid.link.bandwidth_gbps"]).all()
    assert (t["context_tokens"] == t["grid.workload.context_tokens"]).all()
    assert t.groupby("point").size().tolist() == [2, 2, 2, 2]
    # physics: at a fixed context, a 4x faster link gives int8 an earlier first token, and
    # twice the context moves twice the bytes
    int8 = t[t["codec"] == "int8"].set_index(["context_tokens", "bandwidth_gbps"])
    assert int8.loc[(4096, 40.0), "ttft_s"] < int8.loc[(4096, 10.0), "ttft_s"]
    ratio = int8.loc[(4096, 10.0), "total_bytes"] / int8.loc[(2048, 10.0), "total_bytes"]
    assert ratio == pytest.approx(2.0, rel=1e-3)  # twice the tokens (+ a fixed header)
    assert result.base_config["model"]["name"] == "llama-3.1-8b"


def test_grid_over_a_config_group_and_inner_sweep_is_replaced(tmp_path):
    # fig11-context has its own sweep.context_tokens list; a grid axis on the context must
    # replace it (one row per codec per point, at the grid's context)
    result = run_sweep({"workload.context_tokens": [2048], "hardware": ["h100", "a100"]},
                       ["scenario=fig11-context", "samples=1"], progress=False)
    t = result.table
    assert len(t) == 2 * 2
    assert set(t["context_tokens"]) == {2048}
    assert sorted(t["hardware"].unique()) == ["a100", "h100"]
    assert (t["hardware"] == t["grid.hardware"]).all()


def test_unknown_key_names_the_overrides():
    with pytest.raises(ValueError, match="does not compose"):
        run_sweep({"link.no_such_key": [1]}, BASE, progress=False)


def test_cli_writes_csv_parquet_and_sidecar(tmp_path, capsys):
    out = tmp_path / "s"
    rc = main(["sweep", "grid={link.bandwidth_gbps: [10,25], workload.context_tokens: [2048]}",
               "base={scenario: none, model: llama-3.1-8b, workload.output_tokens: 64}",
               "codecs=[int8,lynx]", "samples=1", "progress=false", f"out={out}",
               f"report={tmp_path / 'report.json'}"])
    assert rc == 0
    csv, parquet = pd.read_csv(f"{out}.csv"), pd.read_parquet(f"{out}.parquet")
    assert len(csv) == len(parquet) == 4
    assert list(csv.columns) == list(parquet.columns)
    assert sorted(parquet["grid.link.bandwidth_gbps"].unique()) == [10, 25]
    side = json.loads((tmp_path / "s.json").read_text())
    assert side["command"] == "sweep" and side["rows"] == 4
    assert side["grid"] == {"link.bandwidth_gbps": [10, 25], "workload.context_tokens": [2048]}
    assert side["base_config"]["model"]["name"] == "llama-3.1-8b"
    assert side["base_config"]["workload"]["output_tokens"] == 64
    assert len(side["points"]) == 2
    assert "link.bandwidth_gbps=25" in side["points"][1]["overrides"]
    assert side["provenance"]["kvsim_version"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["command"] == "sweep" and len(report["rows"]) == 4
    assert "int8" in capsys.readouterr().out


def test_cli_bad_grid_and_duplicate_codecs_are_clear(tmp_path, capsys):
    assert main(["sweep", "grid=[1,2]", f"out={tmp_path / 'x'}"]) == 1
    assert "grid must be a mapping" in capsys.readouterr().err
    assert main(["sweep", "grid={samples: [1]}", "base={codecs: [int8]}", "codecs=[lynx]",
                 f"out={tmp_path / 'x'}"]) == 1
    assert "codecs is given twice" in capsys.readouterr().err
