"""TT<k>T vs context length and vs link bandwidth per codec (the Lynx paper's Figure 11) from a
`kvsim sweep` table. Left panel: contexts at one bandwidth; right: bandwidths at one context.
With exactly two codecs, the gap between them is written at each point. Times count from
prefill end by default (from arrival, prefill dominates and hides the codecs' differences);
the bandwidth axis is logarithmic (5 and 10 Gbps apart as 50 and 100); with samples > 1 a
band shows each mean's 95% interval (the `spread.*` columns); a codec lying on an earlier
codec's line is dashed and says so in the legend."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from kvsim.plots.inputs import codec_label, load_sweep, run_date
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import (
    codec_color,
    coincident_with,
    fitted_title,
    max_gap,
    new_figure,
    one_line_tolerance,
    policy_marker,
    tokens_label,
)
from kvsim.plots.ttkt import ttkt_axis_label, ttkt_field

_NEEDED = ("codec", "transfer", "context_tokens", "bandwidth_gbps", "model", "hardware")


def _fixed(table: pd.DataFrame, column: str, wanted: float | None) -> float:
    values = sorted(table[column].unique())
    if wanted is None:
        return values[(len(values) - 1) // 2]  # the median setting the table holds
    if not any(abs(v - wanted) < 1e-9 for v in values):
        raise ValueError(f"fixed {column} {wanted:g} is not in the sweep table "
                         f"(it holds {[float(v) for v in values]})")
    return wanted


def _panel(ax, table: pd.DataFrame, x: str, metric: str) -> list[dict]:
    """One line per series (codec, or codec with its policy): colour by codec, marker by
    transfer policy."""
    series = []
    names = list(dict.fromkeys(table["series"]))
    drawn: dict[str, list[float]] = {}
    tol_s = one_line_tolerance([[float(v) for v in table[metric]]])
    low_col, high_col = f"spread.{metric}.ci95_low", f"spread.{metric}.ci95_high"
    for name in names:
        part = table[table["series"] == name].sort_values(x)
        codec, policy = str(part["codec"].iloc[0]), str(part["transfer"].iloc[0])
        ys = [float(v) for v in part[metric]]
        under = coincident_with(ys, drawn, abs_tol=tol_s) if len(ys) > 1 else None
        color = codec_color(codec)
        shown = (f"{name} (on {under}'s line: within {max_gap(ys, drawn[under]):.2g} s)"
                 if under else name)
        ax.plot(part[x], ys, marker=policy_marker(policy), color=color, label=shown,
                linewidth=1.5, markersize=6, linestyle="--" if under else "-",
                markerfacecolor="none" if under else color)
        band = None
        if low_col in part.columns and part[low_col].notna().all():
            band = ([float(v) for v in part[low_col]], [float(v) for v in part[high_col]])
            ax.fill_between(part[x], band[0], band[1], color=color, alpha=0.2, linewidth=0)
        drawn[name] = ys
        series.append({"codec": codec, "transfer": policy, "label": name,
                       x: part[x].tolist(), metric: ys, "on_line_of": under,
                       "ci95_low": band[0] if band else None,
                       "ci95_high": band[1] if band else None})
    if len(names) == 2:  # the gap the seeds quote ("Lynx's gain over INT8")
        a, b = (table[table["series"] == n].set_index(x)[metric] for n in names)
        for xv in a.index.intersection(b.index):
            gap = float(a[xv] - b[xv])
            ax.annotate(f"{gap:+.2f} s", (xv, max(a[xv], b[xv])), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
    ax.margins(x=0.08, y=0.12)  # room for the gap labels at the ends
    ax.grid(True, alpha=0.3)
    return series


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    table, sidecar = load_sweep(opts.input)
    origin = opts.origin or "prefill_end"  # default: the part the codecs change
    metric = f"{ttkt_field(origin, opts.count)}.{opts.k}"
    missing = [c for c in (*_NEEDED, metric) if c not in table.columns]
    if missing:
        raise ValueError(f"sweep table {opts.input} lacks columns {missing} (is k={opts.k} "
                         "among the sim's metrics.ks?)")
    for col in ("model", "hardware"):
        if table[col].nunique() > 1:
            raise ValueError(f"fig11 compares codecs on one {col}; the table holds "
                             f"{sorted(table[col].unique())}")
    contexts, bandwidths = table["context_tokens"].nunique(), table["bandwidth_gbps"].nunique()
    if contexts < 2 and bandwidths < 2:
        raise ValueError("fig11 needs a sweep over workload.context_tokens or "
                         "link.bandwidth_gbps (the table holds one setting)")
    # one series per (codec, policy), named by both: the marker is the policy's
    pairs = table[["codec", "transfer"]].to_dict("records")
    every_codec = {str(p["codec"]) for p in pairs}
    labels = [codec_label(p, every_codec) for p in pairs]
    table = pd.concat([table, pd.Series(labels, index=table.index, name="series")], axis=1)
    if table.groupby(["series", "context_tokens", "bandwidth_gbps"]).size().max() > 1:
        raise ValueError("the sweep table has several rows per (codec, policy, context, "
                         "bandwidth): fig11 needs one (sweep only context and bandwidth, "
                         "and transfer)")
    panels = []
    if contexts >= 2:
        bw = _fixed(table, "bandwidth_gbps", opts.fixed_bandwidth_gbps)
        panels.append(("context_tokens", table[table["bandwidth_gbps"] == bw],
                       f"(a) vs context, {bw:g} Gbps"))
    if bandwidths >= 2:
        ctx = _fixed(table, "context_tokens", opts.fixed_context_tokens)
        panels.append(("bandwidth_gbps", table[table["context_tokens"] == ctx],
                       f"(b) vs bandwidth, {tokens_label(ctx)} context"))
    fig, axes = new_figure(5.0 * len(panels), 3.8, ncols=len(panels))
    origin_text = "request arrival" if origin == "arrival" else "prefill end"
    summary: dict = {"metric": metric, "x_scale": {}}
    for ax, (x, part, title) in zip(axes, panels, strict=True):
        summary[x] = _panel(ax, part, x, metric)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ttkt_axis_label(f"TT{opts.k}T", origin, opts.count))
        if x == "context_tokens":
            ticks = sorted(part[x].unique())
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [tokens_label(t) for t in ticks])
            ax.set_xlabel("context (tokens)")
        else:
            ticks = sorted(part[x].unique())
            ax.set_xscale("log")
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("link bandwidth (Gbps, log scale)")
        summary["x_scale"][x] = ax.get_xscale()
        names = list(dict.fromkeys(part["series"]))
        ax.legend(fontsize=8, loc="lower right" if x == "context_tokens" else "upper right",
                  title=f"labels: {names[0]} - {names[1]}" if len(names) == 2 else None,
                  title_fontsize=7)
    base = sidecar.get("base_config", {})
    hw = base.get("hardware", {})
    samples = int(table["samples"].iloc[0]) if "samples" in table.columns else 1
    # devices: the sidecar's base config, else the table's resolved config column
    devices = hw.get("devices") or (table["config.hardware.devices"].iloc[0]
                                    if "config.hardware.devices" in table.columns else "?")
    source = (f"{table['model'].iloc[0]}, {devices}x "
              f"{table['hardware'].iloc[0]}, mean of {samples} run(s)")
    # the band only where the table has the metric's spread (no spread is kept of committed
    # times from prefill end): the title promises none it does not draw
    banded = any(s["ci95_low"] for x, _, _ in panels for s in summary[x])
    spread = ", band: 95% interval" if banded else ""
    counted = "committed" if opts.count == "committed" else "drafted (as the seeds count)"
    date = run_date(sidecar)
    fig.suptitle(fitted_title(opts.title or f"{counted.capitalize()} TT{opts.k}T from "
                              f"{origin_text} per codec and transfer policy: {source}{spread}"
                              + (f" ({date})" if date else ""), fig),
                 fontsize=11)
    fig.tight_layout()
    return fig, summary
