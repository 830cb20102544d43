"""Stacked bars of the Figure-2 breakdown from a `kvsim sim` report: the critical path from
prefill end to TT<breakdown_k>T split into serialize, exposed communication, deserialize,
queueing, decode, rejected speculative tokens and verification; one bar per codec."""

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
from kvsim.sim.metrics import BREAKDOWN_KEYS

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
        for i, r in enumerate(group):
            total = sum(r["breakdown_s"][k] for k in BREAKDOWN_KEYS)
            ax.text(total, i, f" {total:.2f} s", va="center", fontsize=8)
            bars.append({"codec": labels[i], "context_tokens": ctx, "bandwidth_gbps": bw,
                         "total_s": total, **r["breakdown_s"]})
        ax.invert_yaxis()
        ax.set_xlim(0, 1.15 * max(sum(r["breakdown_s"].values()) for r in group))
        k_text = "/".join(str(k) for k in ks)
        ax.set_xlabel(f"time from prefill end to TT{k_text}T (s)")
        ax.set_title(f"{tokens_label(ctx)} context, {bw:g} Gbps", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    cfg = doc.get("config", {})
    fig.suptitle(opts.title or f"Latency breakdown (Figure 2 style): {describe_sim(cfg)}, "
                 f"mean of {cfg.get('samples', 1)} run(s)", fontsize=10)
    fig.tight_layout()
    return fig, {"bars": bars}
