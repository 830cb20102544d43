"""Relative error of the simulator against the emulator, per scenario and metric.

A single-request scenario compares times from prefill end (the prefill itself is the same
real work for every codec and is reported on its own as `prefill_s`): TTFT and TT{k}T,
drafted (the seeds' count: an accepted draft counts when drafted) and committed (when
verified). A multi-request scenario compares TTFT percentiles from arrival (queueing
included); the prefix-reuse case those and the mean TTFT from prefill end.
error_pct = 100 * (simulated - measured) / measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvsim.fidelity.drafting import drafting_summary
from kvsim.fidelity.noise_floor import noise_floor
from kvsim.fidelity.statistics import beyond_spread_pct, tost


@dataclass(frozen=True)
class Metric:
    name: str  # e.g. tt32t_c
    field: str  # row key
    key: str = ""  # sub-key of a dict field (k of TTKT, or p50 / p99)


def single_metrics(ks: list[int]) -> list[Metric]:
    out = [Metric("ttft", "ttft_from_prefill_end_s")]
    out += [Metric(f"tt{k}t", "ttkt_from_prefill_end_s", str(k)) for k in ks if k > 1]
    out += [Metric("ttft_c", "ttft_committed_from_prefill_end_s")]
    out += [Metric(f"tt{k}t_c", "ttkt_committed_from_prefill_end_s", str(k)) for k in ks if k > 1]
    return out


# the keys of a comparison row that name its scenario (with codec and metric: the row)
SCENARIO_KEYS = ("case", "emulation", "bandwidth_gbps", "context_tokens", "rate_per_s")

MULTI_METRICS = [Metric("ttft_p50", "ttft_pct_s", "p50"), Metric("ttft_p99", "ttft_pct_s", "p99"),
                 Metric("ttft_c_p50", "ttft_committed_pct_s", "p50"),
                 Metric("ttft_c_p99", "ttft_committed_pct_s", "p99"),
                 Metric("tpot_p50", "tpot_pct_s", "p50"), Metric("tpot_p99", "tpot_pct_s", "p99")]

# the prefix-reuse case: the multi-request case's, and the mean TTFT from prefill end (the
# part reuse changes; both engines take the prefill from the same profile)
PREFIX_METRICS = [*MULTI_METRICS, Metric("ttft_pe", "ttft_from_prefill_end_s")]


def number(v: Any) -> float:
    """v as a float, nan when it is not a number (None: a NaN written to JSON as null)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def value(row: dict, m: Metric) -> float:
    """The metric's value in a row (nan when absent); dict keys compared as strings (a row
    read back from JSON has string keys, one built in memory int keys)."""
    v: Any = row.get(m.field)
    if m.key:
        v = {str(k): x for k, x in v.items()}.get(m.key) if isinstance(v, dict) else None
    return number(v)


def spread_pct(values: list[float]) -> float:
    """Range of repeated measurements over their mean (%): how far apart runs of the same
    scenario on this machine land (nan for fewer than two)."""
    vs = [v for v in values if math.isfinite(v)]
    if len(vs) < 2 or sum(vs) <= 0:
        return math.nan
    return 100.0 * (max(vs) - min(vs)) / (sum(vs) / len(vs))


def error_pct(measured_s: float, simulated_s: float) -> float:
    """100 * (simulated - measured) / measured; nan when either is not a usable number."""
    a, b = number(measured_s), number(simulated_s)
    return 100.0 * (b - a) / a if a > 0 and math.isfinite(b) else math.nan


def recompare(saved: list[dict], simulated: dict, metrics: list[Metric],
              scenario_update: dict) -> list[dict]:
    """`compare` against measurements saved by an earlier run: `saved` holds that run's rows
    of one (scenario, codec), one per metric (its report's `rows`); each metric's measured
    value and spread are carried over as they are, the simulated value and the error are
    this run's. scenario_update: the scenario keys the simulator gives (its accepted drafts,
    prefill and step). A metric the saved run did not compare is refused."""
    by_metric = {r["metric"]: r for r in saved}
    out = []
    for m in metrics:
        old = by_metric.get(m.name)
        if old is None:
            raise ValueError(f"the saved run compared no {m.name} for {_where(saved)} "
                             f"(it compared {', '.join(by_metric) or 'nothing'})")
        b = value(simulated, m)
        row = {k: v for k, v in old.items()
               if k not in ("simulated_s", "error_pct", "beyond_spread_pct")}
        row.update(scenario_update)
        row.update(metric=m.name, measured_s=number(old["measured_s"]), simulated_s=b,
                   error_pct=error_pct(old["measured_s"], b))
        if "measured_min_s" in old and "measured_max_s" in old:  # its runs' range was saved
            row["beyond_spread_pct"] = beyond_spread_pct(
                row["measured_s"], number(old["measured_min_s"]),
                number(old["measured_max_s"]), b)
        out.append(row)
    return out


def _where(rows: list[dict]) -> str:
    r = rows[0] if rows else {}
    return " ".join(f"{k}={r[k]}" for k in (*SCENARIO_KEYS, "codec") if k in r)


def compare(scenario: dict, measured: dict, simulated: dict, metrics: list[Metric]) -> list[dict]:
    """One row per metric: the scenario's keys, measured, simulated, error_pct; when the
    measured row is a mean over repeated requests (its `per_request` rows: the aggregate of
    `kvsim.transport.record.aggregate_rows`), also their range (measured_min_s / _max_s,
    measured_spread_pct) and how far the simulated value lies outside it
    (beyond_spread_pct, 0 inside: kvsim.fidelity.statistics)."""
    repeats = measured.get("per_request")
    out = []
    for m in metrics:
        a, b = value(measured, m), value(simulated, m)
        row = {**scenario, "metric": m.name, "measured_s": a, "simulated_s": b,
               "error_pct": error_pct(a, b)}
        runs = [v for v in (value(r, m) for r in repeats) if math.isfinite(v)] \
            if repeats else []
        spread = spread_pct(runs)
        if math.isfinite(spread):  # (percentiles over requests have no per-request value)
            row.update(measured_spread_pct=spread, measured_min_s=min(runs),
                       measured_max_s=max(runs), measured_runs=len(runs))
            row["beyond_spread_pct"] = beyond_spread_pct(a, min(runs), max(runs), b)
        out.append(row)
    return out


def step_error_pct(row: dict) -> float:
    """The decode step's error (%) of a single-request row: the simulator's step (its
    calibrated profile) against the step the emulated run measured (`tpot_measured_s`,
    `tpot_simulated_s`: mean seconds per token after the first); nan without both. TT<k>T
    for large k is mostly k steps, so this is the part of its error the host's step speed
    on the day explains (it drifts between calibration and scenario)."""
    a, b = number(row.get("tpot_measured_s")), number(row.get("tpot_simulated_s"))
    if not math.isfinite(a) or not math.isfinite(b) or a <= 0:
        return math.nan
    return 100.0 * (b - a) / a


def _step_errors(rows: list[dict]) -> list[float]:
    """|step error| (%) once per (scenario, codec) that has one."""
    seen: dict[tuple, float] = {}
    for r in rows:
        err = step_error_pct(r)
        if math.isfinite(err):
            seen[tuple(r.get(k) for k in (*SCENARIO_KEYS, "codec"))] = abs(err)
    return list(seen.values())


def summary(rows: list[dict]) -> dict:
    """mean / max absolute error (%) over the rows with a finite error, and which row is
    the worst; rows without one are counted (`missing`), never averaged in. With the
    decode steps in the rows, also the steps' mean / max absolute error (%) over the
    (scenario, codec) pairs: how far the host's step moved from its calibration."""
    finite = [r for r in rows if math.isfinite(number(r["error_pct"]))]  # (JSON: null)
    errs = [abs(r["error_pct"]) for r in finite]
    if not errs:
        return {"mean_abs_pct_error": math.nan, "max_abs_pct_error": math.nan,
                "compared": 0, "missing": len(rows)}
    steps = _step_errors(rows)
    worst = max(finite, key=lambda r: abs(r["error_pct"]))
    spreads = [r["measured_spread_pct"] for r in rows
               if math.isfinite(number(r.get("measured_spread_pct")))]
    # against the emulator's own spread, over the comparisons that have one (repeated runs):
    # a simulated value inside the range of its runs is not a model error
    beyond = [abs(number(r["beyond_spread_pct"])) for r in finite if "beyond_spread_pct" in r]
    beyond = [x for x in beyond if math.isfinite(x)]
    by_case: dict[str, list[float]] = {}
    for r in finite:
        by_case.setdefault(str(r.get("case", "")), []).append(abs(float(r["error_pct"])))
    by_metric: dict[str, list[float]] = {}
    for r in finite:
        by_metric.setdefault(str(r.get("metric")), []).append(float(r["error_pct"]))
    return {"mean_abs_pct_error": sum(errs) / len(errs), "max_abs_pct_error": max(errs),
            "compared": len(errs), "missing": len(rows) - len(errs),
            # how far repeated runs of one scenario land apart, on average
            "mean_measured_spread_pct": sum(spreads) / len(spreads) if spreads else math.nan,
            "with_spread": len(beyond),
            "inside_spread": sum(1 for x in beyond if x == 0.0),
            "model_errors": sum(1 for x in beyond if x > 0.0),
            # each case alone (single-request and multi-request compare different things)
            "by_case": {case: {"compared": len(es), "mean_abs_pct_error": sum(es) / len(es),
                               "max_abs_pct_error": max(es)} for case, es in by_case.items()},
            "mean_abs_pct_beyond_spread": sum(beyond) / len(beyond) if beyond else math.nan,
            "max_abs_pct_beyond_spread": max(beyond) if beyond else math.nan,
            # what an exact model would score from the repeated runs' spread alone
            "noise_floor": noise_floor(finite),
            # split-stream scenarios whose engines made different drafting decisions
            "drafting": drafting_summary(finite),
            "tost": {metric: tost(es) for metric, es in by_metric.items()},
            "step_mean_abs_pct_error": sum(steps) / len(steps) if steps else math.nan,
            "step_max_abs_pct_error": max(steps) if steps else math.nan,
            "worst": {k: worst[k] for k in worst if k not in ("measured_s", "simulated_s")}}


def markdown_table(rows: list[dict]) -> str:
    """One table per case (single, multi), one line per (scenario, codec): the measured and
    simulated value of its headline metric (the longest TT<k>T committed; TTFT p50), the
    decode step measured / simulated (ms, single rows that carry it) and the signed error
    (%) of every metric compared."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        cr = [r for r in rows if r["case"] == case]
        groups: dict[tuple, list[dict]] = {}
        for r in cr:
            key = (r.get("emulation"), r.get("bandwidth_gbps"), r.get("context_tokens"),
                   r.get("rate_per_s"), r["codec"])
            groups.setdefault(key, []).append(r)
        metrics = list(dict.fromkeys(r["metric"] for r in cr))
        multi = case == "multi"
        step = not multi and any("tpot_measured_s" in r for r in cr)
        lines = [f"| link | Gbps | ctx | {'req/s | ' if multi else ''}codec | measured / "
                 f"simulated s | {'step ms | ' if step else ''}"
                 + " | ".join(f"{m} %" for m in metrics) + " |",
                 "|" + "---|" * (5 + multi + step + len(metrics))]
        for (link, gbps, ctx, rate, codec), rs in groups.items():
            by = {r["metric"]: r for r in rs}
            head = by.get("ttft_p50", rs[0]) if multi or case == "prefix" else rs[-1]
            errs = [f"{by[m]['error_pct']:+.1f}" if m in by and
                    math.isfinite(number(by[m]["error_pct"])) else "" for m in metrics]
            steps = ""
            if step:
                ok = math.isfinite(step_error_pct(head))
                steps = (f"{1e3 * head['tpot_measured_s']:.1f} / "
                         f"{1e3 * head['tpot_simulated_s']:.1f} | ") if ok else " | "
            pair = f"{number(head['measured_s']):.3f} / {number(head['simulated_s']):.3f}"
            lines.append(f"| {link} | {gbps:g} | {ctx} | {f'{rate:g} | ' if multi else ''}"
                         f"{codec} | {pair} ({head['metric']}) | {steps}" + " | ".join(errs)
                         + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def distributions_table(rows: list[dict]) -> str:
    """The multi-request and prefix-reuse cases' per-request comparisons (one line per
    arrival rate, codec and metric; the prefix case has no rate: "-"): MAPE, Pearson r and
    the two-sample KS test (kvsim.fidelity.statistics)."""
    lines = ["| link | Gbps | ctx | req/s | codec | metric | pairs | MAPE % | Pearson r | "
             "KS D | KS p |", "|" + "---|" * 11]
    for r in rows:
        cells = [f"{number(r.get(k)):{fmt}}" for k, fmt in (
            ("mape_pct", ".2f"), ("pearson_r", ".3f"), ("ks_statistic", ".3f"),
            ("ks_p", ".3g"))]
        lines.append(f"| {r['emulation']} | {r['bandwidth_gbps']:g} | {r['context_tokens']} | "
                     f"{'-' if r.get('rate_per_s') is None else format(r['rate_per_s'], 'g')} | "
                     f"{r['codec']} | {r['metric']} | {r['pairs']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
