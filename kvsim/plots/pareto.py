"""Time against quality for one setting, from a `kvsim advise` report: every codec preset x
transfer policy it simulated at its objective time (x, seconds) and its measured vNMSE (y, log;
the cache the committed tokens come from). Filled: admissible under the floor; hollow: excluded;
the Pareto front joined by a step line; the recommendation starred; a numeric floor drawn."""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from kvsim.plots.inputs import describe_sim, load_report
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import codec_color, codec_marker, new_figure


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    doc = load_report(opts.input, "advise")
    rows = [r for r in doc["rows"] if r.get("vnmse") is not None and r["vnmse"] > 0]
    if not rows:
        raise ValueError(f"input {opts.input}: no candidate has a measured vNMSE to plot")
    objective = doc["rows"][0].get("objective", "objective")
    fig, (ax,) = new_figure(7.4, 4.6)
    seen: set[str] = set()
    for r in rows:
        codec, color = str(r["codec"]), codec_color(str(r["codec"]))
        label = codec if codec not in seen else None
        seen.add(codec)
        ax.scatter([r["objective_s"]], [r["vnmse"]], marker=codec_marker(codec), s=40,
                   facecolors=color if r["admissible"] else "none", edgecolors=color,
                   linewidths=1.2, label=label, zorder=3)
    front = sorted((r for r in rows if r.get("on_front")), key=lambda r: r["objective_s"])
    if front:
        ax.step([r["objective_s"] for r in front], [r["vnmse"] for r in front], where="post",
                color="black", linewidth=1.0, alpha=0.6, label="Pareto front", zorder=2)
    best = next((r for r in rows if r.get("recommended")), None)
    if best is not None:
        ax.scatter([best["objective_s"]], [best["vnmse"]], marker="*", s=260,
                   facecolors="none", edgecolors="black", linewidths=1.2, zorder=4,
                   label=f"recommended: {best['codec']} / {best['transfer']}")
    floor = doc.get("config", {}).get("floor")
    if isinstance(floor, (int, float)) and not isinstance(floor, bool) and floor > 0:
        ax.axhline(floor, color="gray", linestyle=":", linewidth=1.0,
                   label=f"floor: vNMSE {floor:g}")
    ax.set_yscale("log")
    lo = min(r["vnmse"] for r in rows)
    ax.set_ylim(bottom=10 ** (math.floor(math.log10(lo)) - 0.2))
    ax.set_xlabel(f"{objective} (s from request arrival)")
    ax.set_ylabel("attention-output vNMSE (all streams)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.text(0.99, 0.98, "filled: meets the floor; hollow: excluded", transform=ax.transAxes,
            ha="right", va="top", fontsize=7)
    cfg = doc.get("config", {})
    ctx = (cfg.get("workload") or {}).get("context_tokens")
    ax.set_title(opts.title or f"Time vs quality per codec and transfer policy:\n"
                 f"{describe_sim(cfg)}, {ctx} tokens, mean of {cfg.get('samples', 1)} run(s)",
                 fontsize=10)
    fig.tight_layout()
    return fig, {"points": [{k: r.get(k) for k in ("codec", "transfer", "objective_s", "vnmse",
                                                   "admissible", "on_front")} for r in rows],
                 "recommended": None if best is None else [best["codec"], best["transfer"]]}
