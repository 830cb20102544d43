"""Stacked bars of the Figure-2 breakdown from a `kvsim sim` report: the critical path from
prefill end to TT<breakdown_k>T split into serialize, exposed communication, deserialize,
queueing, decode, rejected speculative tokens and verification; one bar per codec. A part
too thin to see (under 1.5% of the axis) is named with its time after the bar's total."""

from __future__ import annotations

from matplotlib.figure import Figure

from kvsim.plots.inputs import (
    codec_label,
    describe_sim,
    group_by_setting,
    load_report,
    many_policy_codecs,
)
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import new_figure, tokens_label
from kvsim.scenario.metrics import BREAKDOWN_KEYS

SLIVER_FRACTION = 0.015  # of the x axis: narrower parts are written out, not only drawn
_COLORS = {"serialize": "#8c564b", "exposed_communication": "#d62728",
           "deserialize": "#ff7f0e", "queueing": "#7f7f7f", "decode": "#2ca02c",
           "rejected_speculative": "#9467bd", "verification": "#1f77b4"}


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    doc = load_report(opts.input, "sim")
    rows = doc["rows"]
    missing = [r.get("codec") for r in rows if not r.get("breakdown_s")]
    if missing:
        raise ValueError(f"input {opts.input}: rows {missing} have no 'breakdown_s'")
    groups = group_by_setting(rows)
    many = many_policy_codecs(rows)
    n_bars = max(len(g) for g in groups.values())
    fig, axes = new_figure(6.4 * len(groups), 0.9 + 0.45 * n_bars, ncols=len(groups))
    bars = []
    ks = sorted({int(r.get("breakdown_k", 0)) for r in rows})
    for ax, ((ctx, bw), group) in zip(axes, sorted(groups.items()), strict=True):
        labels = [codec_label(r, many) for r in group]
        for key in BREAKDOWN_KEYS:  # stack in critical-path order
            left = [sum(r["breakdown_s"][k] for k in BREAKDOWN_KEYS[:BREAKDOWN_KEYS.index(key)])
                    for r in group]
            width = [r["breakdown_s"][key] for r in group]
            if max(width) <= 0:
                continue
            ax.barh(labels, width, left=left, color=_COLORS[key], height=0.6,
                    label=key.replace("_", " "))
        x_max_s = 1.15 * max(sum(r["breakdown_s"].values()) for r in group)
        for i, r in enumerate(group):
            total = sum(r["breakdown_s"][k] for k in BREAKDOWN_KEYS)
            slivers = [k for k in BREAKDOWN_KEYS
                       if 0 < r["breakdown_s"][k] < SLIVER_FRACTION * x_max_s]
            text = f" {total:.2f} s"
            if slivers:
                text += " (incl. " + ", ".join(
                    f"{k.replace('_', ' ')} {r['breakdown_s'][k] * 1e3:.2g} ms"
                    for k in slivers) + ")"
            ax.text(total, i, text, va="center", fontsize=7)
            bars.append({"codec": labels[i], "context_tokens": ctx, "bandwidth_gbps": bw,
                         "total_s": total, "slivers": slivers, **r["breakdown_s"]})
        ax.invert_yaxis()
        ax.set_xlim(0, x_max_s)
        k_text = "/".join(str(k) for k in ks)
        ax.set_xlabel(f"time from prefill end to TT{k_text}T (s)")
        ax.set_title(f"{tokens_label(ctx)} context, {bw:g} Gbps", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    # below the bars: beside them it would cover the totals written after each bar
    handles, names = axes[-1].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=7, loc="lower center", ncol=min(4, len(names)),
               bbox_to_anchor=(0.5, -0.02))
    cfg = doc.get("config", {})
    fig.suptitle(opts.title or f"Where the time to token {k_text} goes after prefill: "
                 f"{describe_sim(cfg)}, mean of {cfg.get('samples', 1)} run(s)", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig, {"bars": bars}
