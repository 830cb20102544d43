"""kind=survival and kind=codecs, checked on the Figure each make() returns: units on the
axes, a legend naming only what is drawn and visible (a curve on another is dashed on top
of it and named so; a curve at 0 or 1 lies inside the panel), colours by codec, the title
from the data; the codecs figure names the cache its vNMSE is relative to, draws a
zero-error codec at a tick that reads "0", and agrees with the vNMSE `kvsim advise` uses."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from figure_checks import check_figure, check_legend, legend_entries
from matplotlib.collections import PathCollection

from kvsim.cli.main import main
from kvsim.core.paths import DATA_DIR
from kvsim.plots import KINDS
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import codec_color
from kvsim.scenario.acceptance import ACCEPTANCE_DIR

LYNX_GREEDY = "smollm2-135m-lynx*greedy*"
VNMSE_TABLE = DATA_DIR / "vnmse" / "smollm2-135m-ctx1024.json"
LYNX_TABLE = DATA_DIR / "vnmse" / "smollm2-135m-ctx1024-lynx.json"
DATE = re.compile(r"20\d\d-\d\d-\d\d")


def _make(kind: str, **kw):
    return KINDS[kind].make(PlotOptions(kind=kind, **kw))


def _labelled_lines(ax):
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def _solid(line) -> bool:
    return line.get_linestyle() in ("-", "solid")


# --- survival ---------------------------------------------------------------------------


def test_survival_passes_the_figure_checks_with_a_probability_axis():
    fig, _ = _make("survival", input=str(ACCEPTANCE_DIR), match=LYNX_GREEDY)
    try:
        check_figure(fig)
        (ax,) = fig.axes
        # "P(accepted >= k)" alone has parentheses, but no unit: the unit closes the label
        assert ax.get_ylabel().endswith("(probability)"), ax.get_ylabel()
        assert ax.get_xlabel() == "k (drafted tokens accepted)"
    finally:
        plt.close(fig)


def test_survival_curve_on_another_is_dashed_on_top_and_names_it():
    """lynx-2+2+4's anchor + residual1 drafts on the same 4-bit cache as lynx's anchor: the
    two curves are equal, and both must show and be named."""
    fig, summary = _make("survival", input=str(ACCEPTANCE_DIR), match=LYNX_GREEDY)
    try:
        (ax,) = fig.axes
        lines = _labelled_lines(ax)
        pairs = [(a, b) for i, b in enumerate(lines) for a in lines[:i]
                 if np.array_equal(a.get_xydata(), b.get_xydata())]
        assert pairs, "this input has two equal curves"
        for earlier, later in pairs:
            assert not _solid(later), later.get_label()  # dashes on top show the one beneath
            assert earlier.get_linewidth() > 2 * later.get_linewidth()  # beneath: wider
            assert later.get_zorder() > earlier.get_zorder()
            assert f"on {earlier.get_label()}, the same curve" in later.get_label()
        on = {c["name"]: c["on_curve_of"] for c in summary["curves"]}
        assert on["smollm2-135m-lynx-2+2+4-s2-greedy"] == "lynx (anchor)"
        assert on["smollm2-135m-lynx-s1-greedy"] is None
    finally:
        plt.close(fig)


def test_survival_curves_at_0_and_1_lie_inside_the_panel(tmp_path):
    """A curve at 0 for every k >= 1 (no draft accepted) and one at 1 (every draft accepted,
    int8's file) lie beside the frame, not on it, and their legend entries say where."""
    zero = json.loads((ACCEPTANCE_DIR / "smollm2-135m-int4-s1-greedy.json").read_text())
    zero.update(name="none-accepted", codec="kivi-2", survival=[1.0] + [0.0] * 64)
    (tmp_path / "none-accepted.json").write_text(json.dumps(zero))
    shutil.copy(ACCEPTANCE_DIR / "smollm2-135m-int8-s1-greedy.json", tmp_path)
    fig, _ = _make("survival", input=str(tmp_path), reference=[])
    try:
        check_figure(fig)
        (ax,) = fig.axes
        y0, y1 = ax.get_ylim()
        for line in _labelled_lines(ax):
            ys = np.asarray(line.get_ydata(), float)
            assert y0 < ys.min() and ys.max() < y1, line.get_label()
        entries = legend_entries(fig)
        assert "kivi-2 (0 for every k >= 1: on the x axis)" in entries, entries
        assert "int8 (1 for every k: along the top)" in entries, entries
    finally:
        plt.close(fig)


def test_survival_colours_by_codec_and_styles_by_stream_and_decoding():
    """Every file of data/acceptance: one colour per codec (codec_color), one line style per
    (streams used, decoding) across codecs, and no two legend entries alike."""
    fig, _ = _make("survival", input=str(ACCEPTANCE_DIR))
    try:
        check_figure(fig)
        (ax,) = fig.axes
        entries = legend_entries(fig)
        assert len(entries) == len(set(entries)), entries
        measured = [ln for ln in _labelled_lines(ax) if not ln.get_label().startswith("seeds")]
        style_of: dict[str, object] = {}
        for line in measured:
            label = line.get_label()
            codec = label.split(" ", 1)[0]
            assert line.get_color() == codec_color(codec), label
            variant = re.search(r"\((?:anchor|residual\d), (greedy|sampling)\)|"
                                r"\((greedy|sampling)\)", label)
            assert variant, label  # the decoding is named when both are drawn
            if ": on " in label:  # drawn dashed on top of the curve it lies on
                continue
            streams = "2" if "residual1" in label else "1"
            key = f"{streams} {variant.group(1) or variant.group(2)}"
            style = line.get_linestyle()
            assert style_of.setdefault(key, style) == style, (label, style_of)
        assert len(set(style_of.values())) == len(style_of)  # each variant its own style
        own = [ln for ln in measured if ": on " not in ln.get_label()]
        sampling = [ln for ln in own if "sampling" in ln.get_label()]
        greedy = [ln for ln in own if "anchor, greedy" in ln.get_label()]
        assert {ln.get_linestyle() for ln in sampling}.isdisjoint(
            {ln.get_linestyle() for ln in greedy})
    finally:
        plt.close(fig)


def test_survival_title_is_the_data_with_a_date_only_where_files_carry_one(tmp_path):
    fig, _ = _make("survival", input=str(ACCEPTANCE_DIR), match=LYNX_GREEDY)
    try:
        title = fig.axes[0].get_title()
        for part in ("smollm2-135m", "1024-token contexts", "greedy", "10 run(s)"):
            assert part in title, title
        assert not DATE.search(title), title  # data/acceptance files hold no date
    finally:
        plt.close(fig)
    doc = json.loads((ACCEPTANCE_DIR / "smollm2-135m-lynx-s1-greedy.json").read_text())
    doc["provenance"] = {"created_unix_s": 1795737600.0}  # 2026-11-27 00:00 UTC
    (tmp_path / "dated.json").write_text(json.dumps(doc))
    fig, _ = _make("survival", input=str(tmp_path / "dated.json"))
    try:
        assert "measured 2026-11-27" in fig.axes[0].get_title()
    finally:
        plt.close(fig)


# --- codecs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Path:
    """A small `kvsim bench codecs` report on synthetic bf16 KV (bf16: vNMSE 0 against it)."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main(["bench", "codecs", "codecs=[bf16,int8,lynx,lynx-int8]", "kv_source=synthetic",
                 "shape.layers=1", "shape.tokens=64", "shape.q_tokens=2", "repeats=1",
                 "warmup=0", "progress=false", f"report={path}"]) == 0
    return path


def _advise_qualities():
    from kvsim.advise.rank import load_qualities
    from kvsim.scenario.config import SimConfig

    return load_qualities(list(SimConfig().vnmse_tables))


def _point(ax, codec: str) -> tuple[float, float]:
    """(bits, drawn vNMSE) of a codec's full-cache point, the collection its legend names."""
    coll = next(c for c in ax.collections
                if c.get_label() == codec or c.get_label().startswith(f"{codec}:")
                or c.get_label().startswith(f"{codec} ("))
    x, y = np.asarray(coll.get_offsets())[-1]
    return float(x), float(y)


@pytest.mark.parametrize("which", ["table", "lynx table", "bench"])
def test_codecs_figures_pass_the_figure_checks(bench, which):
    source = {"table": VNMSE_TABLE, "lynx table": LYNX_TABLE, "bench": bench}[which]
    fig, _ = _make("codecs", input=str(source))
    try:
        check_figure(fig)
        ylabel = fig.axes[0].get_ylabel()
        assert "dimensionless" in ylabel and "vs the " in ylabel, ylabel
    finally:
        plt.close(fig)


def test_codecs_table_points_are_the_vnmse_advise_uses():
    fig, summary = _make("codecs", input=str(VNMSE_TABLE))
    try:
        (ax,) = fig.axes
        qualities = _advise_qualities()
        for p in summary["points"]:
            assert _point(ax, p["codec"])[1] == pytest.approx(qualities[p["codec"]].vnmse)
        assert "float32 model cache" in ax.get_ylabel()
        assert summary["reference"] == "the float32 model cache"
    finally:
        plt.close(fig)


def test_codecs_bench_names_its_reference_and_draws_zero_at_a_0_tick(bench):
    """The bench measures bf16 against the bf16 KV it encoded (vNMSE 0); the figure says
    against what, and the point sits at a tick labelled "0", not at a value like 1e-6."""
    fig, summary = _make("codecs", input=str(bench))
    try:
        (ax,) = fig.axes
        assert "the bfloat16 synthetic KV itself" in ax.get_ylabel()
        bf16 = next(p for p in summary["points"] if p["codec"] == "bf16")
        assert bf16["vnmse"] == 0 and bf16["advise_vnmse"] is None  # synthetic: no table
        entry = next(e for e in legend_entries(fig) if e.startswith("bf16"))
        assert "vNMSE 0 vs the bfloat16 synthetic KV itself" in entry
        _, y = _point(ax, "bf16")
        fig.canvas.draw()
        labels = {float(t.get_position()[1]): t.get_text() for t in ax.get_yticklabels()}
        at = [text for pos, text in labels.items() if np.isclose(pos, y, rtol=1e-6)]
        assert at == ["0"], labels
        measured = [p["vnmse"] for p in summary["points"] if p["vnmse"] > 0]
        assert y * 10 <= min(measured)  # a whole decade below every measured value
    finally:
        plt.close(fig)


def test_codecs_bench_on_advise_capture_gives_advise_vnmse_for_a_zero_point(bench, tmp_path):
    """A bench on the capture `kvsim quality` wrote for SmolLM2-135M at 1024 tokens: advise
    ranks bf16 by its vNMSE against the float32 model cache, and the figure says that value
    beside the bench's 0."""
    doc = json.loads(bench.read_text())
    doc["config"]["kv_source"] = "results/quality/captures/smollm2-135m-ctx1024.pt"
    for row in doc["rows"]:
        row["kv_source"] = "capture"
        row["shape"]["tokens"] = 1024
    report = tmp_path / "bench_capture.json"
    report.write_text(json.dumps(doc))
    fig, summary = _make("codecs", input=str(report))
    try:
        check_figure(fig)
        advised = _advise_qualities()["bf16"].vnmse
        bf16 = next(p for p in summary["points"] if p["codec"] == "bf16")
        assert bf16["advise_vnmse"] == pytest.approx(advised)
        entry = next(e for e in legend_entries(fig) if e.startswith("bf16")).replace("\n", " ")
        assert f"advise's {advised:.3g} is vs the float32 model cache" in entry, entry
        assert "the bfloat16 capture itself" in fig.axes[0].get_ylabel()
        assert DATE.search(fig.axes[0].get_title())  # the bench report's provenance date
    finally:
        plt.close(fig)


def test_codecs_coinciding_points_are_rings_each_named_and_drawn():
    fig, summary = _make("codecs", input=str(LYNX_TABLE))
    try:
        check_legend(fig)
        (ax,) = fig.axes
        entries = legend_entries(fig)
        for p in summary["points"]:
            assert sum(e.split(" ", 1)[0].rstrip(":") == p["codec"] for e in entries) == 1
        same = {p["codec"]: p["same_point_as"] for p in summary["points"]}
        assert same["lynx-int8"] == "lynx" and same["lynx-2+2+4"] == "lynx"
        lynx = next(c for c in ax.collections if c.get_label() == "lynx")
        rings = [c for c in ax.collections if "ring: same point as lynx" in c.get_label()]
        assert len(rings) == 2
        sizes = [float(lynx.get_sizes()[0])]
        for ring in rings:
            assert ring.get_facecolors().size == 0 or ring.get_facecolors()[0][3] == 0
            assert np.allclose(ring.get_offsets()[-1], lynx.get_offsets()[-1], rtol=0.01)
            sizes.append(float(ring.get_sizes()[0]))
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)  # nested rings
        # the legend shows each ring at a point's size, not the size of the ring drawn
        handles = [h for lg in fig.legends for h in lg.legend_handles
                   if isinstance(h, PathCollection)]
        assert len({float(h.get_sizes()[0]) for h in handles}) == 1
    finally:
        plt.close(fig)
