"""`kvsim plot`: every kind renders from small real inputs (made here by the commands
themselves); bad input is a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvsim.cli.main import main
from kvsim.commands.plot import run
from kvsim.plots.options import PlotOptions
from kvsim.scenario.acceptance import ACCEPTANCE_DIR

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIM = ["scenario=none", "model=llama-3.1-8b", "codecs=[int8,lynx]", "samples=2",
       "workload.context_tokens=2048", "workload.output_tokens=64"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("plot_inputs")
    paths = {"sim": d / "sim.json", "sweep": d / "sweep", "bench": d / "bench.json"}
    assert main(["sim", *SIM, f"report={paths['sim']}"]) == 0
    assert main(["sweep", "workload.context_tokens=1024,2048", "link.bandwidth_gbps=10,40",
                 "scenario=none", "model=llama-3.1-8b", "workload.output_tokens=64",
                 "codecs=[int8,lynx]", "samples=1", "hydra/launcher=basic",
                 f"hydra.sweep.dir={paths['sweep']}"]) == 0
    assert main(["bench", "codecs", "codecs=[bf16,int8,lynx]", "kv_source=synthetic",
                 "shape.layers=1",
                 "shape.tokens=64", "shape.q_tokens=2", "repeats=1", "warmup=0",
                 "progress=false", f"report={paths['bench']}"]) == 0
    return paths


def _render(tmp_path: Path, **kw) -> list[Path]:
    rows = run(PlotOptions(out=str(tmp_path / "fig.png"), **kw))
    files = [Path(p) for p in rows[0]["files"]]
    for f in files:
        assert f.stat().st_size > 1000
    png = next(f for f in files if f.suffix == ".png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    return files


def test_ttkt_png_and_pdf(inputs, tmp_path):
    files = _render(tmp_path, kind="ttkt", input=str(inputs["sim"]))
    assert sorted(f.suffix for f in files) == [".pdf", ".png"]
    assert files[1].read_bytes()[:4] == b"%PDF"


def test_ttkt_series_are_the_report_values(inputs, tmp_path):
    rows = run(PlotOptions(kind="ttkt", input=str(inputs["sim"]), out=str(tmp_path / "t.png"),
                           origin="prefill_end", formats=["png"]))
    report = json.loads(inputs["sim"].read_text())["rows"]
    lynx = next(r for r in report if r["codec"] == "lynx")
    series = next(s for s in rows[0]["series"] if s["codec"] == "lynx")
    # committed by default (a drafted token counts once verified)
    assert series["t_s"] == [lynx["ttkt_committed_from_prefill_end_s"][str(k)]
                             for k in series["k"]]


def test_breakdown_bars_total_the_critical_path(inputs, tmp_path):
    _render(tmp_path, kind="breakdown", input=str(inputs["sim"]), formats=["png"])
    rows = run(PlotOptions(kind="breakdown", input=str(inputs["sim"]),
                           out=str(tmp_path / "b.png"), formats=["png"]))
    report = json.loads(inputs["sim"].read_text())["rows"]
    for bar, r in zip(rows[0]["bars"], report, strict=True):
        k = str(r["breakdown_k"])
        # end to end, as the seeds' Figure 2: from request arrival, prefill included
        assert bar["total_s"] == pytest.approx(r["ttkt_s"][k], rel=1e-9)
        assert bar["prefill"] + bar["prefill_wait"] == pytest.approx(
            r["ttkt_s"][k] - r["ttkt_from_prefill_end_s"][k], rel=1e-9)
        assert bar["prefill"] == pytest.approx(r["prefill_s"], rel=1e-6)
        assert bar["committed_s"] == r["ttkt_committed_s"][k]


@pytest.mark.parametrize("suffix", ["/sweep.parquet", "/sweep.csv", "/sweep.json", ""])
def test_fig11_from_each_sweep_file(inputs, tmp_path, suffix):
    rows = run(PlotOptions(kind="fig11", input=f"{inputs['sweep']}{suffix}", k=32,
                           out=str(tmp_path / "f.png"), formats=["png"]))
    summary = rows[0]
    # median bandwidth of [10, 40] is 10; median context of [1024, 2048] is 1024
    lynx = next(s for s in summary["context_tokens"] if s["codec"] == "lynx")
    assert lynx["context_tokens"] == [1024, 2048]
    assert len(summary["bandwidth_gbps"]) == 2


def test_fig11_fixed_value_not_in_table(inputs, tmp_path):
    with pytest.raises(ValueError, match="not in the sweep table"):
        run(PlotOptions(kind="fig11", input=f"{inputs['sweep']}/sweep.parquet", k=32,
                        fixed_bandwidth_gbps=25.0, out=str(tmp_path / "f.png")))


def test_survival_from_a_directory_subset_and_a_file(tmp_path):
    d = tmp_path / "acc"
    d.mkdir()
    for name in ("smollm2-135m-int4-s1-greedy", "smollm2-135m-kivi-2-s1-greedy"):
        shutil.copy(ACCEPTANCE_DIR / f"{name}.json", d)
    rows = run(PlotOptions(kind="survival", input=str(d), out=str(tmp_path / "s.png"),
                           formats=["png"]))
    names = [c["name"] for c in rows[0]["curves"]]
    assert names == ["smollm2-135m-int4-s1-greedy", "smollm2-135m-kivi-2-s1-greedy",
                     "seeds-fig10"]
    assert rows[0]["curves"][-1]["p_ge_10"] == pytest.approx(0.88)  # the seeds' stated point
    _render(tmp_path, kind="survival", input=str(d / "smollm2-135m-int4-s1-greedy.json"),
            formats=["png"])


def test_codecs_from_bench_report_and_vnmse_table(inputs, tmp_path):
    rows = run(PlotOptions(kind="codecs", input=str(inputs["bench"]),
                           out=str(tmp_path / "c.png"), formats=["png"]))
    points = {p["codec"]: p for p in rows[0]["points"]}
    assert set(points) == {"bf16", "int8", "lynx"}
    assert len(points["lynx"]["prefixes"]) == 1  # anchor-only point of the 2-stream codec
    vnmse = Path(__file__).resolve().parent.parent / "data/vnmse/smollm2-135m-ctx1024.json"
    _render(tmp_path, kind="codecs", input=str(vnmse), formats=["png"])


def test_bad_inputs_are_clear_errors(inputs, tmp_path):
    out = str(tmp_path / "x.png")
    with pytest.raises(ValueError, match="does not exist"):
        run(PlotOptions(kind="ttkt", input=str(tmp_path / "missing.json"), out=out))
    with pytest.raises(ValueError, match="'bench codecs' report, not a 'sim' one"):
        run(PlotOptions(kind="ttkt", input=str(inputs["bench"]), out=out))
    with pytest.raises(ValueError, match="is a 'sim' report"):
        run(PlotOptions(kind="codecs", input=str(inputs["sim"]), out=out))
    with pytest.raises(ValueError, match="expected a `kvsim sweep` directory"):
        run(PlotOptions(kind="fig11", input=str(inputs["sim"]), out=out))
    with pytest.raises(ValueError, match="no 'survival' curve"):
        run(PlotOptions(kind="survival", input=str(inputs["sim"]), out=out))
    with pytest.raises(ValueError, match="kind must be one of"):
        run(PlotOptions(kind="fig9", input=str(inputs["sim"]), out=out))
    with pytest.raises(ValueError, match="origin must be one of"):
        run(PlotOptions(kind="ttkt", input=str(inputs["sim"]), origin="decode", out=out))
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="is not JSON"):
        run(PlotOptions(kind="breakdown", input=str(bad), out=out))
    assert not Path(out).exists()


def test_fig11_needs_a_context_or_bandwidth_axis(tmp_path):
    out = tmp_path / "hw"
    assert main(["sweep", "workload.output_tokens=32,64", "scenario=none",
                 "model=llama-3.1-8b", "workload.context_tokens=1024", "codecs=[int8]",
                 "samples=1", "hydra/launcher=basic", f"hydra.sweep.dir={out}"]) == 0
    with pytest.raises(ValueError, match="needs a sweep over"):
        run(PlotOptions(kind="fig11", input=str(out / "sweep.parquet"), k=32,
                        out=str(tmp_path / "f.png")))


def test_cli_reports_missing_input(tmp_path, capsys):
    rc = main(["plot", "kind=ttkt", f"input={tmp_path / 'nope.json'}",
               f"out={tmp_path / 'x.png'}"])
    assert rc == 1
    assert "does not exist" in capsys.readouterr().err


def test_ttkt_bands_are_the_report_intervals(inputs, tmp_path):
    rows = run(PlotOptions(kind="ttkt", input=str(inputs["sim"]), out=str(tmp_path / "t.png"),
                           formats=["png"]))
    report = json.loads(inputs["sim"].read_text())["rows"]
    lynx = next(r for r in report if r["codec"] == "lynx")
    series = next(s for s in rows[0]["series"] if s["codec"] == "lynx")
    i = series["k"].index(32)  # default origin: arrival
    assert series["t_s"][i] == lynx["ttkt_s"]["32"]
    assert series["ci95_low"][i] == lynx["spread"]["ttkt_s.32"]["ci95_low"]
    assert series["ci95_high"][i] == lynx["spread"]["ttkt_s.32"]["ci95_high"]
    assert series["ci95_low"][i] <= series["t_s"][i] <= series["ci95_high"][i]


def test_coincident_series_are_named():
    from kvsim.plots.style import coincident_with

    drawn = {"lynx": [1.0, 2.0, 4.0], "int8": [1.5, 2.5, 3.5]}
    assert coincident_with([1.0, 2.001, 4.0], drawn) == "lynx"
    assert coincident_with([1.0, 2.2, 4.0], drawn) is None
    assert coincident_with([1.0, 2.0], drawn) is None  # other length: not the same line


def test_fig11_defaults_to_prefill_end_and_a_log_bandwidth_axis(inputs, tmp_path):
    rows = run(PlotOptions(kind="fig11", input=str(inputs["sweep"]), k=32,
                           out=str(tmp_path / "f.png"), formats=["png"]))
    assert rows[0]["metric"] == "ttkt_committed_from_prefill_end_s.32"
    assert rows[0]["x_scale"] == {"context_tokens": "log", "bandwidth_gbps": "log"}
    rows = run(PlotOptions(kind="fig11", input=str(inputs["sweep"]), k=32, origin="arrival",
                           count="drafted", out=str(tmp_path / "g.png"), formats=["png"]))
    assert rows[0]["metric"] == "ttkt_s.32"


def test_breakdown_names_parts_too_thin_to_see(inputs, tmp_path):
    from kvsim.plots.breakdown import SLIVER_FRACTION
    from kvsim.scenario.metrics import BREAKDOWN_KEYS

    rows = run(PlotOptions(kind="breakdown", input=str(inputs["sim"]),
                           out=str(tmp_path / "b.png"), formats=["png"]))
    from kvsim.plots.breakdown import PARTS

    bars = rows[0]["bars"]
    x_max_s = 1.45 * max(b["total_s"] for b in bars)
    for b in bars:
        thin = [k for k in PARTS if 0 < b[k] < SLIVER_FRACTION * x_max_s]
        assert b["slivers"] == thin
    assert any(b["slivers"] for b in bars)  # this input has one (lynx's verification)
    # the legend lists only parts wide enough to see in some bar, plus the committed tick
    legend = rows[0]["legend"]
    for key in BREAKDOWN_KEYS:
        visible = any(b[key] >= SLIVER_FRACTION * x_max_s for b in bars)
        assert (key.replace("_", " ") in legend) == visible, key
    assert any(name.startswith("committed TT") for name in legend)
    assert "prefill" in legend


def test_breakdown_times_are_written_in_one_style():
    from kvsim.plots.breakdown import duration_text, ordinal

    assert [duration_text(s) for s in (8.4, 0.127, 0.0034, 9.2e-6)] == [
        "8.4 s", "127 ms", "3.4 ms", "9.2 us"]
    assert [ordinal(k) for k in (1, 2, 3, 11, 12, 21, 32, 64)] == [
        "1st", "2nd", "3rd", "11th", "12th", "21st", "32nd", "64th"]


@pytest.mark.parametrize("kind", ["ttkt", "breakdown", "fig11"])
def test_sim_figures_label_units_list_only_what_is_drawn_and_hide_nothing(inputs, kind):
    """Every axis names its unit, every legend entry names a drawn series, no line lies
    unmarked under another (tests/figure_checks.py); titles carry the run's date, and the
    figure-wide title does not repeat what each panel's title says."""
    import re

    import matplotlib.pyplot as plt
    from figure_checks import check_figure

    from kvsim.plots import KINDS

    source = inputs["sweep"] if kind == "fig11" else inputs["sim"]
    fig, _ = KINDS[kind].make(PlotOptions(kind=kind, input=str(source), k=32))
    try:
        check_figure(fig)
        title = fig._suptitle.get_text()
        if kind != "fig11":
            assert re.search(r"\(20\d\d-\d\d-\d\d\)", title), title
            assert "Gbps" not in title  # each panel's title names its link rate
        if kind == "ttkt":  # the band is promised with its size, so a thin one is not missed
            assert re.search(r"at most ±[0-9.]+ s", title), title
    finally:
        plt.close(fig)


def test_codecs_figure_names_codecs_on_the_same_point(tmp_path):
    from kvsim.core.paths import DATA_DIR

    rows = run(PlotOptions(kind="codecs", input=str(DATA_DIR / "vnmse" /
                                                    "smollm2-135m-ctx1024-lynx.json"),
                           out=str(tmp_path / "c.png"), formats=["png"]))
    same = {p["codec"]: p["same_point_as"] for p in rows[0]["points"]}
    # lynx-int8 is lynx's full cache as one stream; lynx-2+2+4 ends on the same residual
    assert same["lynx-int8"] == "lynx" and same["lynx-2+2+4"] == "lynx"
    assert same["lynx"] is None and same["lynx-oscar"] is None


def test_pareto_from_an_advise_report(inputs, tmp_path):
    report = tmp_path / "advice.json"
    assert main(["advise", "scenario=none", "model=smollm2-135m", "hardware=h100",
                 "link.bandwidth_gbps=0.05", "workload.context_tokens=2048",
                 "workload.output_tokens=32", "samples=1", "codecs=[bf16,int8,int4]",
                 "transfer=[monolithic]", "floor=1e-3", f"report={report}"]) == 0
    files = _render(tmp_path, kind="pareto", input=str(report))
    rows = run(PlotOptions(kind="pareto", input=str(report), out=str(tmp_path / "p.png"),
                           formats=["png"]))
    assert rows[0]["recommended"] == ["int8", "monolithic"]
    by = {p["codec"]: p for p in rows[0]["points"]}
    assert not by["int4"]["admissible"] and by["int4"]["on_front"]
    assert len(files) == 2
    with pytest.raises(ValueError, match="is a 'sim' report, not a 'advise' one"):
        run(PlotOptions(kind="pareto", input=str(inputs["sim"]), out=str(tmp_path / "q.png")))


def test_fig11_draws_committed_times_and_one_line_per_codec_and_policy(inputs, tmp_path):
    """Committed by default, labelled so; a codec swept under two policies is two lines
    (colour by codec, marker by policy) instead of a refusal."""
    import pandas as pd

    table = pd.read_parquet(inputs["sweep"] / "sweep.parquet")
    rows = run(PlotOptions(kind="fig11", input=str(inputs["sweep"]), k=32, origin="arrival",
                           out=str(tmp_path / "c.png"), formats=["png"]))
    assert rows[0]["metric"] == "ttkt_committed_s.32"
    lynx = next(s for s in rows[0]["bandwidth_gbps"] if s["codec"] == "lynx")
    here = table[(table["codec"] == "lynx") & (table["context_tokens"] == 1024)]
    assert lynx["ttkt_committed_s.32"] == here.sort_values("bandwidth_gbps")[
        "ttkt_committed_s.32"].tolist()
    drafted = run(PlotOptions(kind="fig11", input=str(inputs["sweep"]), k=32, count="drafted",
                              out=str(tmp_path / "d.png"), formats=["png"]))
    assert drafted[0]["metric"] == "ttkt_from_prefill_end_s.32"
    # the same sweep with lynx under a second policy: one line per (codec, policy)
    other = table[table["codec"] == "lynx"].assign(transfer="layerwise")
    both = tmp_path / "both.parquet"
    pd.concat([table, other]).to_parquet(both)
    rows = run(PlotOptions(kind="fig11", input=str(both), k=32, out=str(tmp_path / "b.png"),
                           formats=["png"]))
    labels = sorted(s["label"] for s in rows[0]["context_tokens"])
    assert labels == ["int8 (layerwise)", "lynx (layerwise)", "lynx (split_stream_layerwise)"]


def test_reuse_plots_ttft_and_hit_rate_against_the_cache_capacity(tmp_path):
    """A real sweep over the decode cache's capacity on a window of the shipped trace: the
    figure draws the table's values, labels units, hides no line; a table without a capacity
    axis is refused."""
    import matplotlib.pyplot as plt
    import pandas as pd
    from figure_checks import check_figure

    from kvsim.plots import KINDS

    sweep = tmp_path / "sweep"
    assert main(["sweep", "prefix_cache.decode_capacity_gb=0,2,30", "scenario=none",
                 "workload=mooncake-conversation", "workload.trace_duration_s=60",
                 "prefix_cache.enabled=true", "workload.routing=least_loaded,kv_aware",
                 "link=25g", "codecs=[int8]", "granularity=layer", "samples=1",
                 "min_samples=1", "hydra/launcher=basic", f"hydra.sweep.dir={sweep}"]) == 0
    table = pd.read_parquet(sweep / "sweep.parquet")
    fig, summary = KINDS["reuse"].make(PlotOptions(kind="reuse", input=str(sweep)))
    try:
        check_figure(fig)
    finally:
        plt.close(fig)
    for s in summary["series"]:
        part = table[table["config.workload.routing"] == s["routing"]].sort_values(
            "config.prefix_cache.decode_capacity_gb")
        assert s["capacity_gb"] == [0.0, 2.0, 30.0]
        assert s["ttft_p50_s"] == part["ttft_committed_pct_s.p50"].tolist()
        assert s["hit_rate"] == part["prefix_hit_rate"].tolist()
        assert s["hit_rate"][0] == 0.0 and s["hit_rate"][2] >= s["hit_rate"][1] > 0.0
    _render(tmp_path, kind="reuse", input=str(sweep))
    flat = tmp_path / "one.parquet"
    table[table["config.prefix_cache.decode_capacity_gb"] == 2.0].to_parquet(flat)
    with pytest.raises(ValueError, match="one capacity"):
        run(PlotOptions(kind="reuse", input=str(flat), out=str(tmp_path / "x.png")))
