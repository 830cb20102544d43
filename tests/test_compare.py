"""`kvsim compare`: interval test on differences, row matching, config diff, and the
command on two real `kvsim sim` reports and on sweep tables."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvsim.cli.main import main
from kvsim.compare.diff import MetricDiff, compare_runs, diff_configs
from kvsim.compare.runs import Run, RunRow, load_run

KEY = ("int8", "monolithic", 2048, 1.0)


def test_difference_beyond_the_combined_intervals():
    assert MetricDiff(KEY, "ttft_s", 1.0, 1.25, 0.1, 0.1).beyond_intervals is True
    assert MetricDiff(KEY, "ttft_s", 1.0, 1.15, 0.1, 0.1).beyond_intervals is False
    assert MetricDiff(KEY, "ttft_s", 1.0, 0.75, 0.1, 0.1).beyond_intervals is True  # |diff|
    assert MetricDiff(KEY, "ttft_s", 1.0, 9.0, None, 0.1).beyond_intervals is None
    # deterministic paths (std 0): any real difference is one
    assert MetricDiff(KEY, "ttft_s", 1.0, 1.001, 0.0, 0.0).beyond_intervals is True
    assert MetricDiff(KEY, "ttft_s", 1.0, 1.0, 0.0, 0.0).beyond_intervals is False
    assert MetricDiff(KEY, "ttft_s", 1.0, 1.0 + 1e-16, 0.0, 0.0).beyond_intervals is False
    d = MetricDiff(KEY, "ttft_s", 2.0, 3.0, None, None)
    assert d.diff == 1.0 and d.relative == 0.5
    assert MetricDiff(KEY, "x", 0.0, 1.0, None, None).relative is None


def test_rows_match_by_key_and_configs_diff():
    other = ("lynx", "split_stream", 2048, 1.0)
    a = Run("a", "sim report", [RunRow(KEY, {"ttft_s": 1.0, "total_bytes": 5.0}, {}),
                                RunRow(other, {"ttft_s": 2.0}, {})],
            {"seed": 0, "link.bandwidth_gbps": 1.0, "report": "x.json"})
    b = Run("b", "sim report", [RunRow(KEY, {"ttft_s": 1.5}, {}),
                                RunRow(("int4", "monolithic", 2048, 1.0), {"ttft_s": 0.5}, {})],
            {"seed": 1, "link.bandwidth_gbps": 1.0, "report": "y.json", "samples": 2})
    cmp = compare_runs(a, b)
    assert [(d.key, d.metric, d.diff) for d in cmp.metrics] == [(KEY, "ttft_s", 0.5)]
    assert cmp.only_a == [other] and cmp.only_b == [("int4", "monolithic", 2048, 1.0)]
    # output paths are not a difference of the scenario; a missing key shows as None
    assert [(c.key, c.a, c.b) for c in cmp.config] == [("samples", None, 2), ("seed", 0, 1)]
    assert diff_configs({"a": [1, 2]}, {"a": [1, 2]}) == []
    dup = Run("d", "sweep", [RunRow(KEY, {}, {}), RunRow(KEY, {}, {})], varying=["seed"])
    with pytest.raises(ValueError, match="two rows .* varies seed"):
        compare_runs(dup, b)


def test_one_label_for_another_codec_is_not_compared():
    """Rows that print one label but stand for another codec (name or params) never match;
    rows from reports that do not say (older ones) still match by label."""
    a = Run("a", "sim report", [RunRow(KEY, {"ttft_s": 1.0}, {},
                                       {"codec_name": "lynx", "codec_params": {"bits": 2}})])
    b = Run("b", "sim report", [RunRow(KEY, {"ttft_s": 2.0}, {},
                                       {"codec_name": "lynx", "codec_params": {"bits": 4}})])
    cmp = compare_runs(a, b)
    assert cmp.metrics == [] and cmp.only_a == [KEY] and cmp.only_b == [KEY]
    old = Run("o", "sim report", [RunRow(KEY, {"ttft_s": 1.5}, {})])
    assert [d.diff for d in compare_runs(a, old).metrics] == [0.5]


def test_two_entries_that_differ_never_share_a_label():
    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig
    from kvsim.scenario.variants import variants

    cfg, _ = compose("sim", ["scenario=none", "codecs=[lynx,{preset: lynx, acceptance: "
                             "'geometric:0.5'}]"], SimConfig)
    labels = [v.spec.label for v in variants(cfg)]
    assert len(set(labels)) == 2 and all(lb.startswith("lynx [acceptance=") for lb in labels)
    assert "lynx [acceptance=geometric:0.5]" in labels
    cfg, _ = compose("sim", ["scenario=none", "codecs=[int8,int8]"], SimConfig)
    assert [v.spec.label for v in variants(cfg)] == ["int8", "int8"]  # repeats of one setting
    cfg, _ = compose("sim", ["scenario=none", "codecs=[int8,int4]"], SimConfig)
    assert [v.spec.label for v in variants(cfg)] == ["int8", "int4"]  # nothing to tell apart


SIM = ["scenario=none", "model=smollm2-135m", "hardware=h100", "link.bandwidth_gbps=1",
       "workload.context_tokens=2048", "workload.output_tokens=32", "codecs=[int8,lynx]",
       "samples=4"]


def test_compare_two_sim_reports(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["sim", *SIM, f"report={a}"]) == 0
    assert main(["sim", *SIM, "link.latency_s=0.5", f"report={b}"]) == 0
    capsys.readouterr()
    out_json = tmp_path / "cmp.json"
    assert main(["compare", str(a), str(b), f"report={out_json}"]) == 0
    out = capsys.readouterr().out
    assert "link.latency_s: 0.0001 -> 0.5" in out
    rows = json.loads(out_json.read_text())["rows"]
    by = {(r["codec"], r["metric"]): r for r in rows}
    # 0.5 s of propagation instead of 0.1 ms delays int8's first token by that, deterministically
    ttft = by[("int8", "ttft_s")]
    assert ttft["diff"] == pytest.approx(0.5 - 0.0001)
    assert ttft["half_a"] == 0.0 and ttft["beyond_ci95"] is True
    assert by[("int8", "total_bytes")]["diff"] == 0 and \
        by[("int8", "total_bytes")]["beyond_ci95"] is False
    # lynx's times are means over 4 acceptance draws: they carry intervals
    assert by[("lynx", "ttkt_s.32")]["half_a"] > 0
    # the same run against itself: nothing differs, configs equal
    assert main(["compare", str(a), str(a), "only_flagged=true"]) == 0
    out = capsys.readouterr().out
    assert "0 of" in out and "configs: no difference" in out


def test_compare_sweep_tables(tmp_path, capsys):
    base = {"codec": "int8", "transfer": "monolithic", "context_tokens": 2048,
            "bandwidth_gbps": 1.0, "ttkt_committed_s.32": 2.0,
            "spread.ttkt_committed_s.32.mean": 2.0, "spread.ttkt_committed_s.32.ci95_high": 2.1,
            "config.seed": 0, "config.link.bandwidth_gbps": 1.0}
    pd.DataFrame([base]).to_csv(tmp_path / "a.csv", index=False)
    pd.DataFrame([{**base, "ttkt_committed_s.32": 2.5, "spread.ttkt_committed_s.32.mean": 2.5,
                   "spread.ttkt_committed_s.32.ci95_high": 2.55, "config.seed": 7}]).to_csv(
        tmp_path / "b.csv", index=False)
    run = load_run(str(tmp_path / "a.csv"))
    assert run.kind == "sweep" and run.rows[0].half_widths["ttkt_committed_s.32"] == \
        pytest.approx(0.1)
    assert main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "seed: 0 -> 7" in out
    assert main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "nope.json")]) == 1
    assert "does not exist" in capsys.readouterr().err
