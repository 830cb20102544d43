"""Stacked bars of the time to the k-th token from request arrival (the Lynx paper's Figure 2)
from a `kvsim sim` report, one bar per codec: the wait for a prefill slot, prefill, then the
critical path from prefill end split into serialize, exposed communication, deserialize,
queueing, decode, rejected speculative tokens and verification. The bar ends at the drafted
TT<k>T (the critical path counts a token when drafted); a tick marks the committed TT<k>T. A
part too thin to see (under 1.5% of the axis) is named with its time after the bar's total,
and only parts that show somewhere are in the legend."""

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
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import fitted_title, new_figure, tokens_label
from kvsim.scenario.metrics import BREAKDOWN_KEYS

SLIVER_FRACTION = 0.015  # of the x axis: narrower parts are written out, not only drawn
PARTS = ("prefill_wait", "prefill", *BREAKDOWN_KEYS)  # stacking order, from arrival
# colour-blind-safe (Okabe & Ito; greys for the prefill the codecs do not change)
_COLORS = {"prefill_wait": "#DDDDDD", "prefill": "#999999", "serialize": "#E69F00",
           "exposed_communication": "#D55E00", "deserialize": "#F0E442",
           "queueing": "#56B4E9", "decode": "#009E73", "rejected_speculative": "#CC79A7",
           "verification": "#0072B2"}


def duration_text(seconds: float) -> str:
    """At least 2 significant figures, no exponent, in the largest unit below the value:
    8.4 s, 127 ms, 48 ms, 9.2 us."""
    scale, unit = next(((s, u) for s, u in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"))
                        if seconds >= s), (1e-9, "ns"))
    value = seconds / scale
    return f"{value:.0f} {unit}" if value >= 10 else f"{value:.2g} {unit}"


def ordinal(k: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 21st, 32nd."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def parts_s(row: dict) -> dict[str, float]:
    """Seconds of each part of the drafted TT<k>T from arrival (k = row's breakdown_k): the
    prefill wait, prefill (arrival to prefill end, less the wait) and the breakdown."""
    k = str(row["breakdown_k"])
    drafted = row["ttkt_s"]
    from_pe = row["ttkt_from_prefill_end_s"]
    to_prefill_end = (drafted.get(k, drafted.get(int(k))) - from_pe.get(k, from_pe.get(int(k))))
    wait = float(row.get("prefill_wait_s") or 0.0)
    return {"prefill_wait": wait, "prefill": to_prefill_end - wait,
            **{key: float(row["breakdown_s"][key]) for key in BREAKDOWN_KEYS}}


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    doc = load_report(opts.input, "sim")
    rows = doc["rows"]
    missing = [r.get("codec") for r in rows if not r.get("breakdown_s")]
    if missing:
        raise ValueError(f"input {opts.input}: rows {missing} have no 'breakdown_s'")
    groups = group_by_setting(rows)
    many = many_policy_codecs(rows)
    n_bars = max(len(g) for g in groups.values())
    fig, axes = new_figure(7.0 * len(groups), 1.4 + 0.45 * n_bars, ncols=len(groups))
    bars = []
    ks = sorted({int(r.get("breakdown_k", 0)) for r in rows})
    k_text = "/".join(str(k) for k in ks)
    shown: dict[str, object] = {}  # part -> a bar drawn wide enough to see (legend handle)
    committed_handle = None
    committed_name = f"committed TT{k_text}T (bar end: drafted)"
    for ax, ((ctx, bw), group) in zip(axes, sorted(groups.items()), strict=True):
        labels = [codec_label(r, many) for r in group]
        parts = [parts_s(r) for r in group]
        x_max_s = 1.45 * max(sum(p.values()) for p in parts)  # room for the totals' text
        for key in PARTS:
            left = [sum(p[q] for q in PARTS[:PARTS.index(key)]) for p in parts]
            width = [p[key] for p in parts]
            if max(width) <= 0:
                continue
            drawn = ax.barh(labels, width, left=left, color=_COLORS[key], height=0.6,
                            edgecolor="white", linewidth=0.4, label=key.replace("_", " "))
            if max(width) >= SLIVER_FRACTION * x_max_s:
                shown.setdefault(key, drawn)
        for i, (r, p) in enumerate(zip(group, parts, strict=True)):
            total = sum(p.values())
            slivers = [q for q in PARTS if 0 < p[q] < SLIVER_FRACTION * x_max_s]
            text = f" {duration_text(total)}"
            if slivers:
                text += " (incl. " + ", ".join(f"{q.replace('_', ' ')} {duration_text(p[q])}"
                                              for q in slivers) + ")"
            ax.text(total, i, text, va="center", fontsize=7)
            committed = r.get("ttkt_committed_s") or {}
            c_s = committed.get(str(r["breakdown_k"]), committed.get(r["breakdown_k"]))
            if c_s is not None:
                committed_handle = ax.plot([c_s], [i], marker="|", markersize=16,
                                           markeredgewidth=2.0, color="black",
                                           linestyle="none", label=committed_name)[0]
            bars.append({"codec": labels[i], "context_tokens": ctx, "bandwidth_gbps": bw,
                         "total_s": total, "committed_s": c_s, "slivers": slivers, **p})
        ax.invert_yaxis()
        ax.set_xlim(0, x_max_s)
        ax.set_xlabel("time from request arrival to the "
                      f"{'/'.join(ordinal(k) for k in ks)} token (s)")
        ax.set_title(f"{tokens_label(ctx)} context, {bw:g} Gbps", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    # below the bars: beside them it would cover the totals written after each bar; only
    # parts wide enough to see somewhere (the rest are named after the bars)
    handles = [shown[key] for key in PARTS if key in shown]
    names = [key.replace("_", " ") for key in PARTS if key in shown]
    if committed_handle is not None:
        handles.append(committed_handle)
        names.append(committed_name)
    fig.legend(handles, names, fontsize=7, loc="lower center", ncol=min(4, len(names)),
               bbox_to_anchor=(0.5, -0.02))
    cfg = doc.get("config", {})
    date = run_date(doc)
    fig.suptitle(fitted_title(
        opts.title or f"Where the time to token {k_text} goes, from request arrival: "
        f"{describe_run(cfg)}, mean of {max(int(r.get('samples') or 1) for r in rows)} run(s)"
        + (f" ({date})" if date else ""), fig), fontsize=10)
    rows_of_legend = -(-len(names) // min(4, len(names)))
    fig.tight_layout(rect=(0, 0.06 + 0.05 * rows_of_legend, 1, 1))
    return fig, {"bars": bars, "legend": names}
