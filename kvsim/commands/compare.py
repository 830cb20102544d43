"""Two runs side by side: `kvsim compare A B` with A and B each a `kvsim sim` report
(report.json) or a `kvsim sweep` directory / table. Rows are matched by (codec, transfer,
context, bandwidth); each metric shows A, B, B - A and whether the difference is larger than
the two 95% intervals combined (runs with samples > 1); the configurations are diffed."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.compare.diff import compare_runs
from kvsim.compare.runs import load_run
from kvsim.core.report import format_table

COMMAND = ("compare",)
HELP = "two kvsim sim reports or sweep tables side by side: metric differences vs 95% intervals"
CONFIG_NAME = "compare"
POSITIONAL = ("a", "b")
_UNMATCHED_SHOWN = 8  # rows present in one run only, listed before a count of the rest


@dataclass
class Config:
    a: str = ""  # first run: a `kvsim sim` report.json, or a `kvsim sweep` dir / table
    b: str = ""  # second run, the same kinds
    # metrics compared (flat names: ttft_s, ttkt_committed_s.32, total_bytes, ...); empty:
    # TTFT / TTKT drafted and committed, TTFT from prefill end, TPOT, bytes, accepted drafts
    metrics: list[str] = field(default_factory=list)
    only_flagged: bool = False  # print only differences beyond the combined 95% intervals


def _flag(beyond: bool | None) -> str:
    return "-" if beyond is None else ("DIFFERS" if beyond else "within")


def run(cfg: Config) -> list[dict]:
    if not cfg.a or not cfg.b:
        raise ValueError("compare needs two runs: kvsim compare A B (report.json or sweep dir)")
    a, b = load_run(cfg.a), load_run(cfg.b)
    cmp = compare_runs(a, b, list(cfg.metrics) or None)
    if not cmp.metrics:
        raise ValueError(f"no rows of {cfg.a} and {cfg.b} match by (codec, transfer, context, "
                         "bandwidth) with a metric in common")
    rows = []
    for d in cmp.metrics:
        rows.append({"codec": d.key[0], "transfer": d.key[1], "context_tokens": d.key[2],
                     "bandwidth_gbps": d.key[3], "metric": d.metric, "a": d.a, "b": d.b,
                     "diff": d.diff, "relative": d.relative, "half_a": d.half_a,
                     "half_b": d.half_b, "beyond_ci95": d.beyond_intervals,
                     "flag": _flag(d.beyond_intervals)})
    shown = [r for r in rows if r["beyond_ci95"]] if cfg.only_flagged else rows
    print(f"A: {a.path} ({a.kind}, {len(a.rows)} rows)\nB: {b.path} ({b.kind}, "
          f"{len(b.rows)} rows)\ndiff = B - A; ±: 95% half-width of each mean; DIFFERS: "
          "|diff| > ±A + ±B (the intervals do not overlap); -: a run without spread")
    print(format_table(shown, [
        ("codec", "codec", ""), ("transfer", "transfer", ""), ("context_tokens", "ctx", "d"),
        ("bandwidth_gbps", "Gbps", "g"), ("metric", "metric", ""), ("a", "A", ".4g"),
        ("half_a", "±A", ".3g"), ("b", "B", ".4g"), ("half_b", "±B", ".3g"),
        ("diff", "B-A", "+.4g"), ("relative", "rel", "+.1%"), ("flag", "", "")]))
    flagged = sum(bool(r["beyond_ci95"]) for r in rows)
    print(f"{flagged} of {len(rows)} differences beyond the combined 95% intervals")
    for label, keys in (("only in A", cmp.only_a), ("only in B", cmp.only_b)):
        for k in keys[:_UNMATCHED_SHOWN]:
            print(f"{label}: codec={k[0]} transfer={k[1]} context={k[2]} bandwidth={k[3]:g}")
        if len(keys) > _UNMATCHED_SHOWN:
            print(f"{label}: ... and {len(keys) - _UNMATCHED_SHOWN} more rows")
    if cmp.config:
        print("config differences (A -> B):")
        for c in cmp.config:
            print(f"  {c.key}: {c.a!r} -> {c.b!r}")
    else:
        print("configs: no difference")
    return rows
