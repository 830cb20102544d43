"""Time against quality for one setting, from a `kvsim advise` report: every codec preset x
transfer policy it simulated at its objective time (x, seconds from request arrival) and its
measured vNMSE (y, log; the cache the committed tokens come from). Colour: the codec (a thin
line joins one codec's candidates, which share its vNMSE); marker shape: the transfer policy.
Filled: admissible under the floor; hollow: excluded. A candidate at the same point as one
drawn before (lynx, lynx-int8 and lynx-2+2+4 send the same full cache) is a larger ring
around it, its codec's line dashed. The Pareto front is a step line, the recommendation
starred, a numeric floor dotted."""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvsim.plots.inputs import describe_sim, load_report, run_date
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import codec_color, new_figure, policy_marker, tokens_label
from kvsim.scenario.objective import objective_words
from kvsim.scenario.policy import POLICIES

MARKER_AREA_PT2 = 42.0  # a candidate's marker (points^2)
# two candidates closer than these read as one point: x within this share of the x span,
# vNMSE within this ratio
SAME_POINT_X_SHARE = 0.005
SAME_POINT_Y_RATIO = 1.02


def objective_axis_label(objective: str) -> str:
    """'ttkt_committed_s.32' -> 'committed TT32T (s, from request arrival)' (advise's
    objectives are times from arrival)."""
    return f"{objective_words(objective)} (s, from request arrival)"


def _same_point(a: tuple[float, float], b: tuple[float, float], x_tol_s: float) -> bool:
    """Whether two (objective_s, vNMSE) points read as one."""
    return (abs(a[0] - b[0]) <= x_tol_s
            and max(a[1], b[1]) <= SAME_POINT_Y_RATIO * min(a[1], b[1]))


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    doc = load_report(opts.input, "advise")
    rows = [r for r in doc["rows"] if r.get("vnmse") is not None and r["vnmse"] > 0]
    if not rows:
        raise ValueError(f"input {opts.input}: no candidate has a measured vNMSE to plot")
    cfg = doc.get("config", {})
    objective = cfg.get("objective") or doc["rows"][0].get("objective")
    if not objective:
        raise ValueError(f"input {opts.input}: the advise report names no objective")
    fig, (ax,) = new_figure(10.0, 5.0)

    # codecs in the report's order (its ranking): the first codec at a point is drawn
    # filled / hollow, later ones as rings around it
    codecs = list(dict.fromkeys(str(r["codec"]) for r in rows))
    drawn_policies = {str(r["transfer"]) for r in rows}
    policies = [p for p in POLICIES if p in drawn_policies] + sorted(drawn_policies -
                                                                      set(POLICIES))
    x_min = min(r["objective_s"] for r in rows)
    x_max = max(r["objective_s"] for r in rows)
    x_tol_s = SAME_POINT_X_SHARE * max(x_max - x_min, 1e-9)
    drawn: list[tuple[tuple[float, float], str]] = []  # (point, codec) of base markers
    rings_at: dict[tuple[float, float], int] = {}  # base point -> rings around it so far
    by_policy: dict[str, dict[str, list]] = {
        p: {"x": [], "y": [], "s": [], "face": [], "edge": []} for p in policies}
    points, codec_handles = [], []
    for codec in codecs:
        color = codec_color(codec)
        mine = sorted((r for r in rows if str(r["codec"]) == codec),
                      key=lambda r: r["objective_s"])
        under: list[str] = []
        for r in mine:
            point = (float(r["objective_s"]), float(r["vnmse"]))
            base = next(((p, c) for p, c in drawn if _same_point(point, p, x_tol_s)), None)
            series = by_policy[str(r["transfer"])]
            series["x"].append(point[0])
            series["y"].append(point[1])
            series["edge"].append(color)
            if base is None:
                drawn.append((point, codec))
                series["s"].append(MARKER_AREA_PT2)
                # hollow: white inside, so the codec's line does not run through it
                series["face"].append(color if r["admissible"] else "white")
            else:
                rings_at[base[0]] = rings_at.get(base[0], 0) + 1
                series["s"].append(MARKER_AREA_PT2 * (1 + 0.7 * rings_at[base[0]]) ** 2)
                series["face"].append("none")
                under.append(base[1])
            points.append({k: r.get(k) for k in ("codec", "transfer", "objective_s", "vnmse",
                                                 "admissible", "on_front")}
                          | {"same_point_as": None if base is None else base[1]})
        label = codec
        if under:
            label = f"{codec} (rings: same point as {', '.join(dict.fromkeys(under))})"
        style = "--" if under else "-"
        ax.plot([r["objective_s"] for r in mine], [r["vnmse"] for r in mine], color=color,
                linewidth=1.0, alpha=0.55, zorder=1, label=label, linestyle=style)
        # the legend's key: the same colour and style, at full strength
        codec_handles.append(Line2D([], [], color=color, linewidth=2.2, linestyle=style,
                                    label=label))
    policy_handles = []
    for policy in policies:
        s = by_policy[policy]
        ax.scatter(s["x"], s["y"], marker=policy_marker(policy), s=s["s"],
                   facecolors=s["face"], edgecolors=s["edge"], linewidths=1.2, label=policy,
                   zorder=3)
        policy_handles.append(Line2D([], [], marker=policy_marker(policy), linestyle="none",
                                     color="0.25", markersize=6.5, label=policy))
    marks = []
    front = sorted((r for r in rows if r.get("on_front")), key=lambda r: r["objective_s"])
    if front:
        (step,) = ax.step([r["objective_s"] for r in front], [r["vnmse"] for r in front],
                          where="post", color="black", linewidth=1.0, alpha=0.6,
                          label="Pareto front", zorder=2)
        marks.append(step)
    best = next((r for r in rows if r.get("recommended")), None)
    if best is not None:
        marks.append(ax.scatter([best["objective_s"]], [best["vnmse"]], marker="*", s=260,
                                facecolors="none", edgecolors="black", linewidths=1.2,
                                zorder=4,
                                label=f"recommended: {best['codec']} / {best['transfer']}"))
    span_s = x_max - x_min
    pad_s = 0.04 * span_s if span_s > 0 else max(0.05 * abs(x_max), 1e-3)
    ax.set_xlim(x_min - pad_s, x_max + pad_s)
    floor = cfg.get("floor")
    if isinstance(floor, (int, float)) and not isinstance(floor, bool) and floor > 0:
        # across the panel in data coordinates (an axhline's x is in axes fractions)
        (floor_line,) = ax.plot([x_min - pad_s, x_max + pad_s], [floor, floor], color="gray",
                                linestyle=":", linewidth=1.0, label=f"floor: vNMSE {floor:g}")
        marks.append(floor_line)
    ax.set_yscale("log")
    lo = min(r["vnmse"] for r in rows)
    ax.set_ylim(bottom=10 ** (math.floor(math.log10(lo)) - 0.2))
    ax.set_xlabel(objective_axis_label(str(objective)))
    ax.set_ylabel("attention-output vNMSE (all streams, dimensionless)")
    ax.grid(True, which="major", alpha=0.3)
    ctx = (cfg.get("workload") or {}).get("context_tokens")
    context = f"{tokens_label(ctx)}-token context" if isinstance(ctx, (int, float)) else \
        "context ?"
    # runs averaged per candidate: the rows' own count (advise raises samples to min_samples
    # where acceptance draws decide), else the configured one
    counts = sorted({int(r["samples"]) for r in rows if isinstance(r.get("samples"), int)})
    runs = (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}" if counts
            else f"{cfg.get('samples', 1)}")
    date = run_date(doc)
    ax.set_title(opts.title or f"Time vs quality per codec and transfer policy:\n"
                 f"{describe_sim(cfg)}, {context}, mean of {runs} run(s)"
                 + (f", run of {date}" if date else ""), fontsize=10)
    # beside the panel: markers (policies) and the marks above, colours (codecs) below
    fig.subplots_adjust(left=0.08, right=0.64, bottom=0.11, top=0.87)
    ax.legend(handles=policy_handles + marks, fontsize=7, title_fontsize=7, alignment="left",
              title="marker: transfer policy\n(filled: meets the floor; hollow: excluded)",
              loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.legend(handles=codec_handles, fontsize=7, title="colour: codec", title_fontsize=7,
               alignment="left", ncol=2 if len(codec_handles) <= 16 else 3,
               loc="lower left", bbox_to_anchor=(1.02, 0.0),
               bbox_transform=ax.transAxes, borderaxespad=0.0)
    return fig, {"objective": objective, "date": date, "points": points,
                 "recommended": None if best is None else [best["codec"], best["transfer"]]}
