"""The pareto and fidelity figures, checked on the matplotlib Figure each kind's make()
returns: units on every axis, legend entries only for what is drawn (tests/figure_checks.py),
the objective named in words, the transfer policy as marker shape and the codec as colour,
a compact legend, and the run's date in the title."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from figure_checks import check_figure, legend_entries
from matplotlib.colors import to_rgba
from matplotlib.markers import MarkerStyle

from kvsim.cli.main import main
from kvsim.core.paths import DATA_DIR
from kvsim.plots import KINDS
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import codec_color, policy_marker

# lynx-int8 sends lynx's full cache as one stream: the same point as lynx under layerwise and
# monolithic, so the figure must ring it rather than hide it
ADVISE = ["advise", "scenario=none", "model=smollm2-135m", "hardware=h100",
          "workload.context_tokens=2048", "workload.output_tokens=32",
          "codecs=[int8,int4,lynx,lynx-int8]", "min_samples=2", "floor=1e-3"]
FIDELITY_REPORTS = sorted((DATA_DIR / "fidelity").glob("*/report.json"))
SECONDS_IN_PARENS = re.compile(r"\([^)]*\bs\b[^)]*\)")  # "(s, from request arrival)"


@pytest.fixture(scope="module")
def advise_report(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pareto") / "advise.json"
    assert main([*ADVISE, f"report={path}"]) == 0
    return path


@pytest.fixture(scope="module")
def pareto(advise_report):
    """(figure, summary, report) of the small advise run."""
    fig, summary = KINDS["pareto"].make(PlotOptions(kind="pareto", input=str(advise_report)))
    yield fig, summary, json.loads(advise_report.read_text())
    plt.close(fig)


def _utc_date(doc: dict) -> str:
    created = doc["provenance"]["created_unix_s"]
    return datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%d")


def _marker_path(marker: str) -> np.ndarray:
    style = MarkerStyle(marker)
    return style.get_path().transformed(style.get_transform()).vertices


def _same_shape(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.allclose(a, b)


def _point_style(ax, x: float, y: float) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """(marker vertices, edge RGBA, area) of every scatter point drawn at (x, y), to 0.1%."""
    found = []
    for coll in ax.collections:
        offsets = np.asarray(coll.get_offsets())
        if not len(offsets) or not coll.get_paths():
            continue
        edges, sizes = coll.get_edgecolors(), coll.get_sizes()
        for i, (px, py) in enumerate(offsets):
            if np.isclose(px, x, rtol=1e-3) and np.isclose(py, y, rtol=1e-3):
                found.append((coll.get_paths()[i % len(coll.get_paths())].vertices,
                              edges[i % len(edges)], float(sizes[i % len(sizes)])))
    return found


def test_pareto_passes_the_figure_checks_and_names_the_objective_in_words(pareto):
    fig, summary, doc = pareto
    check_figure(fig)
    ax = fig.axes[0]
    objective = doc["config"]["objective"]
    assert objective == "ttkt_committed_s.32"
    xlabel = ax.get_xlabel()
    assert objective not in xlabel and "ttkt_committed" not in xlabel
    assert xlabel.startswith("committed TT32T") and "from request arrival" in xlabel
    assert SECONDS_IN_PARENS.search(xlabel), xlabel
    assert re.search(r"\(.*dimensionless.*\)", ax.get_ylabel()), ax.get_ylabel()
    assert summary["objective"] == objective


def test_pareto_marks_the_policy_by_shape_and_the_codec_by_colour(pareto):
    fig, _, doc = pareto
    ax = fig.axes[0]
    rows = [r for r in doc["rows"] if r.get("vnmse")]
    lynx = [r for r in rows if r["codec"] == "lynx"]
    assert len({r["transfer"] for r in lynx}) >= 3  # one codec under several policies
    shapes = []
    for r in rows:
        styles = _point_style(ax, r["objective_s"], r["vnmse"])
        mine = [s for s in styles if np.allclose(s[1], to_rgba(codec_color(r["codec"])))]
        assert mine, f"{r['codec']}/{r['transfer']} not drawn in its codec's colour"
        assert any(_same_shape(v, _marker_path(policy_marker(r["transfer"])))
                   for v, _, _ in mine), f"{r['codec']}/{r['transfer']}: not its marker"
        if r["codec"] == "lynx":
            shapes.append(mine[0][0])
    # the same codec under different policies: different shapes
    assert not any(_same_shape(a, b) for i, a in enumerate(shapes) for b in shapes[:i])


def test_pareto_legend_is_one_entry_per_codec_and_policy_plus_three_marks(pareto):
    fig, summary, doc = pareto
    entries = legend_entries(fig)
    codecs = {p["codec"] for p in summary["points"]}
    policies = {p["transfer"] for p in summary["points"]}
    assert len(entries) == len(set(entries))
    assert len(entries) <= len(codecs) + len(policies) + 3, entries
    for policy in policies:
        assert policy in entries, (policy, entries)
    for codec in codecs:
        assert sum(e == codec or e.startswith(f"{codec} (") for e in entries) == 1, entries
    assert "Pareto front" in entries
    assert any(e.startswith("recommended: ") for e in entries)
    assert "floor: vNMSE 0.001" in entries
    best = next(r for r in doc["rows"] if r.get("recommended"))
    assert summary["recommended"] == [best["codec"], best["transfer"]]


def test_pareto_rings_a_codec_on_another_codecs_point(pareto):
    """lynx-int8 and lynx under one policy: the same (time, vNMSE); the later is a larger
    ring around the first, and its legend entry says whose point it is on."""
    fig, summary, _ = pareto
    same = {(p["codec"], p["transfer"]): p["same_point_as"] for p in summary["points"]}
    # the first of the two in the report's ranking is the point, the other its ring
    pair = {same[("lynx-int8", "layerwise")], same[("lynx", "layerwise")]}
    assert pair in ({None, "lynx"}, {None, "lynx-int8"}), pair
    ringed = "lynx-int8" if same[("lynx-int8", "layerwise")] else "lynx"
    base = "lynx" if ringed == "lynx-int8" else "lynx-int8"
    ring = next(p for p in summary["points"]
                if p["codec"] == ringed and p["transfer"] == "layerwise")
    sizes = sorted(s for _, _, s in _point_style(fig.axes[0], ring["objective_s"],
                                                 ring["vnmse"]))
    assert len(sizes) >= 2 and sizes[-1] > 1.5 * sizes[0]
    assert f"{ringed} (rings: same point as {base})" in legend_entries(fig)


def test_pareto_title_carries_the_setting_and_the_run_date(pareto):
    fig, summary, doc = pareto
    title = fig.axes[0].get_title()
    assert _utc_date(doc) in title and summary["date"] == _utc_date(doc)
    assert "smollm2-135m" in title and "2K-token context" in title
    # advise raised samples=1 to min_samples=2: the title says what the rows averaged
    assert {r["samples"] for r in doc["rows"]} == {2} and "mean of 2 run(s)" in title


@pytest.mark.parametrize("report", FIDELITY_REPORTS, ids=lambda p: p.parent.name)
def test_fidelity_is_dated_labels_seconds_and_lists_only_what_is_drawn(report):
    doc = json.loads(report.read_text())
    fig, summary = KINDS["fidelity"].make(PlotOptions(kind="fidelity", input=str(report)))
    try:
        check_figure(fig)
        ax = fig.axes[0]
        for label in (ax.get_xlabel(), ax.get_ylabel()):
            assert SECONDS_IN_PARENS.search(label), label
        title = ax.get_title()
        created = datetime.datetime.fromtimestamp(doc["provenance"]["created_unix_s"],
                                                  datetime.UTC)
        # the date and time of day: two runs of one day (2026-11-25) stay apart
        assert created.strftime("%Y-%m-%d %H:%M UTC") in title, title
        assert summary["run"] in title
        assert f"{doc['fidelity']['mean_abs_pct_error']:.2f}%" in title
        assert f"{doc['fidelity']['max_abs_pct_error']:.2f}%" in title
        entries = legend_entries(fig)
        series = {(r["codec"], r["case"]) for r in doc["rows"]}
        assert {f"{c} ({case})" for c, case in series} <= set(entries)
        assert "y = x (no error)" in entries
    finally:
        plt.close(fig)


def test_fidelity_colours_by_codec_and_marks_the_case():
    report = DATA_DIR / "fidelity" / "2026-11-25" / "report.json"
    fig, _ = KINDS["fidelity"].make(PlotOptions(kind="fidelity", input=str(report)))
    try:
        by_label = {c.get_label(): c for c in fig.axes[0].collections}
        single, multi = by_label["lynx (single)"], by_label["lynx (multi)"]
        assert not _same_shape(single.get_paths()[0].vertices, multi.get_paths()[0].vertices)
        for codec in ("bf16", "int8", "int4", "lynx"):
            face = by_label[f"{codec} (single)"].get_facecolors()[0]
            assert np.allclose(face[:3], to_rgba(codec_color(codec))[:3]), codec
        # the legend says what each case's times are measured from
        legend_title = fig.axes[0].get_legend().get_title().get_text()
        assert "from prefill end" in legend_title and "from arrival" in legend_title
        assert not fig.axes[0].xaxis.get_label().get_text().endswith(", s")
    finally:
        plt.close(fig)


def test_fidelity_date_falls_back_to_the_directory_and_lists_only_drawn_cases(tmp_path):
    """Without provenance: the date the input's directory is named after, else 'unknown';
    a report with single-request rows only has no multi-request legend entry."""
    doc = json.loads((DATA_DIR / "fidelity" / "2026-11-25" / "report.json").read_text())
    doc.pop("provenance")
    doc["rows"] = [r for r in doc["rows"] if r["case"] == "single"]
    dated = tmp_path / "2026-11-30-rerun" / "report.json"
    undated = tmp_path / "latest" / "report.json"
    for path in (dated, undated):
        path.parent.mkdir()
        path.write_text(json.dumps(doc))
    for path, words in ((dated, "run ended 2026-11-30"), (undated, "run date unknown")):
        fig, _ = KINDS["fidelity"].make(PlotOptions(kind="fidelity", input=str(path)))
        try:
            check_figure(fig)
            assert words in fig.axes[0].get_title()
            entries = legend_entries(fig)
            assert not any("multi" in e for e in entries), entries
            legend_title = fig.axes[0].get_legend().get_title().get_text()
            assert "multi" not in legend_title
        finally:
            plt.close(fig)
