"""Simulated against measured, from a `kvsim validate` report: one point per (scenario,
codec, metric), log-log, with the y = x line and the +-10% band; circles: single-request
scenarios (times from prefill end), squares: the multi-request case (TTFT percentiles)."""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from kvsim.plots.inputs import load_report
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import codec_color, new_figure


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    doc = load_report(opts.input, "validate")
    summary = doc.get("fidelity") or {}
    return draw(doc["rows"], summary), {"input": opts.input,
                                        "points": len(doc["rows"]),
                                        "mean_abs_pct_error": summary.get("mean_abs_pct_error")}


def draw(rows: list[dict], summary: dict) -> Figure:
    pts = [r for r in rows if isinstance(r.get("error_pct"), (int, float)) and
           math.isfinite(r["error_pct"])]
    if not pts:
        raise ValueError("no comparison with a finite error to plot")
    fig, (ax,) = new_figure(5.2, 4.6)
    for codec in sorted({r["codec"] for r in pts}):
        for case, marker in (("single", "o"), ("multi", "s")):
            sel = [r for r in pts if r["codec"] == codec and r["case"] == case]
            if sel:
                ax.scatter([r["measured_s"] for r in sel], [r["simulated_s"] for r in sel],
                           s=14, marker=marker, color=codec_color(codec), alpha=0.8,
                           label=f"{codec} ({case})")
    lo = min(min(r["measured_s"], r["simulated_s"]) for r in pts) * 0.8
    hi = max(max(r["measured_s"], r["simulated_s"]) for r in pts) * 1.25
    xs = [lo, hi]
    ax.plot(xs, xs, color="black", lw=0.8)
    ax.fill_between(xs, [x * 0.9 for x in xs], [x * 1.1 for x in xs], color="grey", alpha=0.2,
                    label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured (real transport), s")
    ax.set_ylabel("simulated (calibrated), s")
    ax.set_title(f"kvsim sim vs kvsim emulate: mean |error| "
                 f"{summary['mean_abs_pct_error']:.1f}%, worst "
                 f"{summary['max_abs_pct_error']:.1f}%", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return fig
