"""Simulated against measured, from a `kvsim validate` report: one point per (scenario,
codec, metric), log-log, with the y = x line and the +-10% band; colour: the codec; circles:
single-request scenarios (times from prefill end), squares: the multi-request case, diamonds:
the prefix-reuse case (both TTFT and TPOT percentiles, TTFT from arrival). The title names
when the run ended (the report's provenance) and its error summary."""

from __future__ import annotations

import datetime
import math
import re
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from kvsim.plots.inputs import load_report
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import codec_color, new_figure

# per case: (marker, marker area in points^2, edge colour, where its times are measured
# from); the few multi-request squares larger and dark-edged, so they show among the
# single-request circles; the prefix-reuse case's diamonds likewise
CASES = {"single": ("o", 18.0, "white", "prefill end"),
         "multi": ("s", 30.0, "black", "arrival"),
         "prefix": ("D", 30.0, "black", "arrival")}
DATED_DIRECTORY = re.compile(r"(\d{4}-\d{2}-\d{2})\b")  # "2026-11-25", "2026-11-25-additive"


def run_stamp(doc: dict, path: str | Path) -> str:
    """When the run was measured: the UTC time its report was written ("2026-11-25 03:32
    UTC", provenance.created_unix_s), else the date its directory is named after
    (data/fidelity/2026-11-25/report.json), else ""."""
    created = (doc.get("provenance") or {}).get("created_unix_s")
    if isinstance(created, (int, float)) and not isinstance(created, bool) and \
            math.isfinite(created):
        when = datetime.datetime.fromtimestamp(created, datetime.UTC)
        return when.strftime("%Y-%m-%d %H:%M UTC")
    dated = DATED_DIRECTORY.match(Path(path).parent.name)
    return dated.group(1) if dated else ""


def metric_words(rows: list[dict]) -> str:
    """The metrics of rows, drafted and committed alike: 'TTFT / TT32T / TT64T'
    (metric names tt32t, tt32t_c, ttft_p50 ...)."""
    names = dict.fromkeys(str(r.get("metric", "?")).replace("_c", "") for r in rows)
    return " / ".join(n.replace("_", " ").upper().replace(" P", " p") for n in names)


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    doc = load_report(opts.input, "validate")
    summary = doc.get("fidelity") or {}
    stamp = run_stamp(doc, opts.input)
    model = ((doc.get("config") or {}).get("model") or {}).get("name", "")
    fig = draw(doc["rows"], summary, stamp=stamp, model=model, title=opts.title)
    return fig, {"input": opts.input, "run": stamp, "points": len(doc["rows"]),
                 "mean_abs_pct_error": summary.get("mean_abs_pct_error")}


def draw(rows: list[dict], summary: dict, stamp: str | None = None, model: str = "",
         title: str = "") -> Figure:
    """The figure of `rows` (a validate report's). stamp: when the run ended; None:
    now (`kvsim validate` draws it as the run ends); "": unknown, and the title says so."""
    pts = [r for r in rows if isinstance(r.get("error_pct"), (int, float)) and
           math.isfinite(r["error_pct"])]
    if not pts:
        raise ValueError("no comparison with a finite error to plot")
    if stamp is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    fig, (ax,) = new_figure(5.6, 5.0)
    lo = min(min(r["measured_s"], r["simulated_s"]) for r in pts) * 0.8
    hi = max(max(r["measured_s"], r["simulated_s"]) for r in pts) * 1.25
    xs = [lo, hi]
    ax.fill_between(xs, [x * 0.9 for x in xs], [x * 1.1 for x in xs], color="grey", alpha=0.2,
                    linewidth=0, label="±10% of measured", zorder=1)
    ax.plot(xs, xs, color="black", lw=0.8, label="y = x (no error)", zorder=2)
    for codec in sorted({str(r["codec"]) for r in pts}):
        for case, (marker, area_pt2, edge, _) in CASES.items():
            sel = [r for r in pts if str(r["codec"]) == codec and r.get("case") == case]
            if sel:  # a legend entry only for a series with points
                ax.scatter([r["measured_s"] for r in sel], [r["simulated_s"] for r in sel],
                           s=area_pt2, marker=marker, facecolors=codec_color(codec),
                           edgecolors=edge, linewidths=0.5, alpha=0.9,
                           zorder=3 if case == "single" else 4, label=f"{codec} ({case})")
    others = sorted({str(r.get("case")) for r in pts} - set(CASES))
    for case in others:  # a case this figure has no marker for: drawn, and said so
        sel = [r for r in pts if str(r.get("case")) == case]
        ax.scatter([r["measured_s"] for r in sel], [r["simulated_s"] for r in sel], s=18,
                   marker="x", color="0.3", zorder=3, label=f"case {case}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    # seconds written out (0.2, 0.5, 1, 2, 5 ...) rather than powers of ten
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)))
             for m in (1, 2, 5) if lo <= m * 10.0 ** e <= hi]
    if len(ticks) >= 2:  # else (under a decade between 1-2-5 steps) matplotlib's own
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(FixedLocator(ticks))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured time (real transport, s, log scale)")
    ax.set_ylabel("simulated time (calibrated, s, log scale)")
    ax.grid(True, which="major", alpha=0.3)
    run = f"run ended {stamp}" if stamp else "run date unknown"
    # the report's summary; one without it: the same from the rows drawn
    abs_pct = [abs(r["error_pct"]) for r in pts]
    mean_pct = summary.get("mean_abs_pct_error", sum(abs_pct) / len(abs_pct))
    max_pct = summary.get("max_abs_pct_error", max(abs_pct))
    ax.set_title(title or f"kvsim sim vs kvsim emulate{', ' + model if model else ''}, {run}:"
                 f"\nmean |error| {mean_pct:.2f}%, worst {max_pct:.2f}% over {len(pts)} "
                 "comparisons", fontsize=9)
    origins = [f"{case}: {metric_words([r for r in pts if r.get('case') == case])} "
               f"from {CASES[case][3]}" for case in CASES if any(r.get("case") == case
                                                                 for r in pts)]
    ax.legend(fontsize=7, loc="upper left", title_fontsize=7, alignment="left",
              title="\n".join(origins) or None)
    fig.tight_layout()
    return fig
