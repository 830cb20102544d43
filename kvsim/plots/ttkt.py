"""TTKT vs k per codec (the Lynx paper's Figure 9) from a `kvsim sim` report: time to the
k-th valid token; one panel per (context, bandwidth) the report holds. With samples > 1 a
band shows each mean's 95% interval (the row's `spread`); a codec whose line lies on an
earlier one is drawn dashed and says so in the legend."""

from __future__ import annotations

from matplotlib.figure import Figure

from kvsim.plots.inputs import (
    codec_label,
    describe_run,
    group_by_setting,
    load_report,
    many_policy_codecs,
    run_date,
)
from kvsim.plots.options import COUNTS, ORIGINS, PlotOptions
from kvsim.plots.style import (
    codec_color,
    codec_marker,
    coincident_with,
    fitted_title,
    interval_band,
    max_gap,
    new_figure,
    one_line_tolerance,
    tokens_label,
)


def ttkt_field(origin: str, count: str = "committed") -> str:
    """The row metric of TTKT counted from origin, committed or drafted."""
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
    if count not in COUNTS:
        raise ValueError(f"count must be one of {COUNTS}, got {count!r}")
    committed = "_committed" if count == "committed" else ""
    return f"ttkt{committed}_s" if origin == "arrival" else \
        f"ttkt{committed}_from_prefill_end_s"


def ttkt_axis_label(token: str, origin: str, count: str) -> str:
    """'committed TT64T (s, from prefill end)' / 'drafted TTKT (s, from request arrival)'
    (drafted: as the seeds count, which the titles say)."""
    where = "request arrival" if origin == "arrival" else "prefill end"
    return f"{count} {token} (s, from {where})"


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    doc = load_report(opts.input, "sim")
    origin = opts.origin or "arrival"  # default: the wait the user sees
    field = ttkt_field(origin, opts.count)
    rows = doc["rows"]
    missing = [r.get("codec") for r in rows if not r.get(field)]
    if missing:
        raise ValueError(f"input {opts.input}: rows {missing} have no {field!r} (TTKT per k)")
    groups = group_by_setting(rows)
    many = many_policy_codecs(rows)
    fig, axes = new_figure(5.4 * len(groups) + 2.4, 4.0, ncols=len(groups), sharey=True)
    series = []
    for ax, ((ctx, bw), group) in zip(axes, sorted(groups.items()), strict=True):
        drawn: dict[str, list[float]] = {}
        tol_s = one_line_tolerance([list(r[field].values()) for r in group])
        for r in group:
            ks = sorted(int(k) for k in r[field])
            ts = [r[field][str(k)] if str(k) in r[field] else r[field][k] for k in ks]
            label = codec_label(r, many)
            under = coincident_with(ts, drawn, abs_tol=tol_s)
            color = codec_color(r["codec"])
            shown = (f"{label} (on {under}'s line: within {max_gap(ts, drawn[under]):.2g} s)"
                     if under else label)
            ax.plot(ks, ts, marker=codec_marker(r["codec"]), color=color, label=shown,
                    linewidth=1.5, markersize=5, linestyle="--" if under else "-",
                    markerfacecolor="none" if under else color)
            band = interval_band(r.get("spread") or {}, [f"{field}.{k}" for k in ks])
            if band is not None:
                ax.fill_between(ks, band[0], band[1], color=color, alpha=0.2, linewidth=0)
            drawn[label] = ts
            series.append({"codec": label, "context_tokens": ctx, "bandwidth_gbps": bw,
                           "k": ks, "t_s": ts, "on_line_of": under,
                           "ci95_low": band[0] if band else None,
                           "ci95_high": band[1] if band else None})
        ax.set_xscale("log", base=2)
        all_ks = sorted({k for s in series if s["context_tokens"] == ctx for k in s["k"]})
        ax.set_xticks(all_ks, [str(k) for k in all_ks])
        ax.set_xlabel("k (the k-th token, log scale)")
        ax.set_title(f"{tokens_label(ctx)} context, {bw:g} Gbps", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel(ttkt_axis_label("TTKT", origin, opts.count))
    # beside the panels, not over the lines
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                    borderaxespad=0.0)
    cfg = doc.get("config", {})
    samples = max(int(r.get("samples") or 1) for r in rows)  # runs averaged (the config's
    # `samples` is before min_samples raised it)
    widest = max((h - lo for s in series if s["ci95_low"]
                  for lo, h in zip(s["ci95_low"], s["ci95_high"], strict=True)), default=None)
    spread = (f"; band: 95% interval of the mean, at most ±{widest / 2:.2g} s"
              if widest is not None else "")
    date = run_date(doc)
    counted = "committed" if opts.count == "committed" else "drafted (as the seeds count)"
    fig.suptitle(fitted_title(opts.title or f"Time to the k-th {counted} token: "
                              f"{describe_run(cfg)}, mean of {samples} run(s){spread}"
                              + (f" ({date})" if date else ""), fig), fontsize=10)
    fig.tight_layout()
    return fig, {"series": series}
