"""TTFT against the decode instances' prefix cache capacity, per codec (and routing), from a
`kvsim sweep` table over `prefix_cache.decode_capacity_gb` on a trace with prefix blocks.
Left: committed TTFT p50 and p99 (s, from arrival: the first token once verified); right:
the decode-side block hit rate. A point with the cache
off (`prefix_cache.enabled=false`) is drawn at capacity 0 as what it is: no reuse."""

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
)

CAPACITY = "config.prefix_cache.decode_capacity_gb"
ENABLED = "config.prefix_cache.enabled"
ROUTING = "config.workload.routing"
P50, P99 = "ttft_committed_pct_s.p50", "ttft_committed_pct_s.p99"
_NEEDED = ("codec", "transfer", "model", "hardware", P50, P99, ENABLED, CAPACITY)
_ROUTING_STYLE = {"least_loaded": "-", "round_robin": ":", "kv_aware": "--"}


def _capacity_gb(table: pd.DataFrame) -> pd.Series:
    """Each row's decode cache (GB): 0 with the cache off; a null capacity (all memory beside
    the weights) as the memory it stood for is not in the table: refused."""
    on = table[ENABLED].astype(bool)
    if table.loc[on, CAPACITY].isna().any():
        raise ValueError("reuse plots capacity on its x axis: sweep explicit "
                         "prefix_cache.decode_capacity_gb values (null means all memory "
                         "beside the weights, which the table does not give in GB)")
    return table[CAPACITY].where(on, 0.0).astype(float)


def _line(ax, drawn: dict[str, list[float]], tol: float, x: list[float], ys: list[float],
          label: str, **style) -> None:
    """One series; one lying on an earlier one of the panel is hollow and says so."""
    under = coincident_with(ys, drawn, abs_tol=tol)
    if under:
        label = f"{label} (on {under}'s line: within {max_gap(ys, drawn[under]):.2g})"
        style["markerfacecolor"] = "none"
    ax.plot(x, ys, label=label, **style)
    drawn[label] = ys


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    table, sidecar = load_sweep(opts.input)
    missing = [c for c in _NEEDED if c not in table.columns]
    if missing:
        raise ValueError(f"sweep table {opts.input} lacks columns {missing}: reuse needs a "
                         "`kvsim sweep` of multi-request runs over "
                         "prefix_cache.decode_capacity_gb")
    for col in ("model", "hardware"):
        if table[col].nunique() > 1:
            raise ValueError(f"reuse compares codecs on one {col}; the table holds "
                             f"{sorted(table[col].unique())}")
    table = table.assign(capacity_gb=_capacity_gb(table))
    if table["capacity_gb"].nunique() < 2:
        raise ValueError("reuse needs a sweep over prefix_cache.decode_capacity_gb (the table "
                         "holds one capacity)")
    routing = table[ROUTING].fillna("least_loaded") if ROUTING in table.columns else \
        pd.Series("least_loaded", index=table.index)
    pairs = table[["codec", "transfer"]].to_dict("records")
    every = {str(p["codec"]) for p in pairs}
    labels = [codec_label(p, every) for p in pairs]
    table = table.assign(series=labels, routing=routing.astype(str))
    if table.groupby(["series", "routing", "capacity_gb"]).size().max() > 1:
        raise ValueError("the sweep table has several rows per (codec, routing, capacity): "
                         "sweep only the capacity (and the routing, codecs)")
    fig, (ax_t, ax_h) = new_figure(10.0, 3.9, ncols=2)
    series = []
    groups = list(table.groupby(["series", "routing"], sort=False))
    hit_of = {key: (part["prefix_hit_rate"].fillna(0.0) if "prefix_hit_rate" in part
                    else pd.Series(0.0, index=part.index)) for key, part in groups}
    tol_hit = one_line_tolerance([[100 * h for h in hit_of[key]] for key, _ in groups])
    drawn_t: dict[str, list[float]] = {}
    drawn_h: dict[str, list[float]] = {}
    for (name, route), part in groups:
        order = part["capacity_gb"].argsort().to_numpy()
        part = part.iloc[order]
        codec = str(part["codec"].iloc[0])
        style = {"color": codec_color(codec), "linestyle": _ROUTING_STYLE.get(route, "-")}
        x = part["capacity_gb"].tolist()
        p50, p99 = part[P50].tolist(), part[P99].tolist()
        hit = hit_of[(name, route)].iloc[order].tolist()
        label = f"{name}, {route}"
        _line(ax_t, drawn_t, 0.0, x, p50, f"{label}: p50", marker="o", **style)
        _line(ax_t, drawn_t, 0.0, x, p99, f"{label}: p99", marker="^", alpha=0.6, **style)
        _line(ax_h, drawn_h, tol_hit, x, [100 * h for h in hit], label, marker="o", **style)
        series.append({"codec": codec, "transfer": str(part["transfer"].iloc[0]),
                       "routing": route, "capacity_gb": x, "ttft_p50_s": p50,
                       "ttft_p99_s": p99, "hit_rate": hit})
    ax_t.set_yscale("log")
    ax_t.set_xlabel("prefix cache per decode instance (GB)")
    ax_t.set_ylabel("committed TTFT from arrival (s, log scale)")
    ax_t.set_title("(a) committed TTFT p50 (o) and p99 (^)", fontsize=10)
    ax_h.set_xlabel("prefix cache per decode instance (GB)")
    ax_h.set_ylabel("blocks reused on the decode side (%)")
    ax_h.set_title("(b) decode-side block hit rate", fontsize=10)
    for ax in (ax_t, ax_h):
        ax.grid(True, alpha=0.3)
    ax_t.legend(fontsize=7)
    ax_h.legend(fontsize=7)
    base = sidecar.get("base_config", {})
    workload = base.get("workload", {})
    trace = workload.get("trace_path") or (table["config.workload.trace_path"].iloc[0]
                                           if "config.workload.trace_path" in table.columns
                                           else "?")
    date = run_date(sidecar)
    bw = sorted(table["bandwidth_gbps"].unique()) if "bandwidth_gbps" in table else []
    shared = "config.link.sharing" in table and (table["config.link.sharing"] == "shared").all()
    nodes = ""
    if {"config.workload.prefill_nodes", "config.workload.decode_nodes"} <= set(table.columns):
        nodes = (f", {table['config.workload.prefill_nodes'].iloc[0]} prefill + "
                 f"{table['config.workload.decode_nodes'].iloc[0]} decode instances")
    fig.suptitle(fitted_title(opts.title or (
        f"Prefix reuse on {trace}: {table['model'].iloc[0]} on {table['hardware'].iloc[0]}"
        f"{nodes}, {', '.join(f'{b:g}' for b in bw)} Gbps"
        f"{' (one link shared)' if shared else ''}" + (f" ({date})" if date else "")), fig),
        fontsize=11)
    fig.tight_layout()
    return fig, {"series": series}
