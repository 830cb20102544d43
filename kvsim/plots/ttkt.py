"""TTKT vs k per codec (the Lynx paper's Figure 9) from a `kvsim sim` report: time to the
k-th valid token; one panel per (context, bandwidth) the report holds."""

from __future__ import annotations

from matplotlib.figure import Figure

from kvsim.plots.inputs import (
    codec_label,
    describe_sim,
    group_by_setting,
    load_report,
    many_policy_codecs,
)
from kvsim.plots.options import ORIGINS, PlotOptions
from kvsim.plots.style import codec_color, codec_marker, new_figure, tokens_label


def ttkt_field(origin: str) -> str:
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
    return "ttkt_s" if origin == "arrival" else "ttkt_from_prefill_end_s"


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    doc = load_report(opts.input, "sim")
    field = ttkt_field(opts.origin)
    rows = doc["rows"]
    missing = [r.get("codec") for r in rows if not r.get(field)]
    if missing:
        raise ValueError(f"input {opts.input}: rows {missing} have no {field!r} (TTKT per k)")
    groups = group_by_setting(rows)
    many = many_policy_codecs(rows)
    fig, axes = new_figure(5.2 * len(groups), 3.8, ncols=len(groups), sharey=True)
    series = []
    for ax, ((ctx, bw), group) in zip(axes, sorted(groups.items()), strict=True):
        for r in group:
            ks = sorted(int(k) for k in r[field])
            ts = [r[field][str(k)] if str(k) in r[field] else r[field][k] for k in ks]
            label = codec_label(r, many)
            ax.plot(ks, ts, marker=codec_marker(r["codec"]), color=codec_color(r["codec"]),
                    label=label, linewidth=1.5, markersize=5)
            series.append({"codec": label, "context_tokens": ctx, "bandwidth_gbps": bw,
                           "k": ks, "t_s": ts})
        ax.set_xscale("log", base=2)
        all_ks = sorted({k for s in series if s["context_tokens"] == ctx for k in s["k"]})
        ax.set_xticks(all_ks, [str(k) for k in all_ks])
        ax.set_xlabel("k (valid tokens)")
        ax.set_title(f"{tokens_label(ctx)} context, {bw:g} Gbps", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    origin = "request arrival" if opts.origin == "arrival" else "prefill end"
    axes[0].set_ylabel(f"TTKT (s, from {origin})")
    axes[-1].legend(fontsize=8, loc="upper left")
    cfg = doc.get("config", {})
    samples = cfg.get("samples", 1)
    fig.suptitle(opts.title or f"Time to k-th valid token: {describe_sim(cfg)}"
                 f" (mean of {samples} run(s))", fontsize=11)
    fig.tight_layout()
    return fig, {"series": series}
