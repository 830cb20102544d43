"""A run to compare, from a `kvsim sim` report (report.json) or a `kvsim sweep` table
(directory, sweep.parquet / .csv / sidecar .json), as rows keyed by (codec, transfer,
context_tokens, bandwidth_gbps) with flat metrics (`ttkt_s.32`), their 95% half-widths
where the run had several samples, and the configuration as flat `a.b` keys."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

KEY_FIELDS = ("codec", "transfer", "context_tokens", "bandwidth_gbps")
# scalar metrics compared by default (every ttkt_committed_s.K / ttkt_s.K is added); committed
# times first, the time a user sees a verified token, then drafted ones (the seeds' count)
SCALARS = ("ttft_committed_s", "ttft_s", "ttft_from_prefill_end_s", "tpot_s", "total_bytes",
           "accepted_tokens")
DICT_METRICS = ("ttkt_committed_s", "ttkt_s")

RowKey = tuple[str, str, int, float]
# what a codec label stands for: rows of one label but another codec are not compared
# (a different acceptance model is a condition of the run, compared like any other)
SETTING_FIELDS = ("codec_name", "codec_params")


@dataclass
class RunRow:
    key: RowKey
    metrics: dict[str, float]  # flat name -> mean value (seconds, bytes or tokens)
    half_widths: dict[str, float]  # flat name -> half-width of the 95% interval of the mean
    # what the codec label stands for, where the row says (SETTING_FIELDS): two rows with
    # one label but another codec are not compared
    setting: dict[str, object] = field(default_factory=dict)


@dataclass
class Run:
    path: str
    kind: str  # "sim report" | "sweep"
    rows: list[RunRow]
    config: dict[str, object] = field(default_factory=dict)  # flat keys; a sweep's constants
    varying: list[str] = field(default_factory=list)  # a sweep's keys that vary by point


def flatten(tree: object, prefix: str = "") -> dict[str, object]:
    """{'link': {'bandwidth_gbps': 10}} -> {'link.bandwidth_gbps': 10}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, object] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _key(row: dict, where: str) -> RowKey:
    missing = [f for f in KEY_FIELDS if f not in row]
    if missing:
        raise ValueError(f"{where}: a row has no {', '.join(missing)} (expected rows of "
                         "`kvsim sim` or `kvsim sweep`)")
    return (str(row["codec"]), str(row["transfer"]), int(row["context_tokens"]),
            float(row["bandwidth_gbps"]))


def row_from_report(row: dict, where: str) -> RunRow:
    metrics: dict[str, float] = {}
    for name in SCALARS:
        v = _number(row.get(name))
        if v is not None:
            metrics[name] = v
    for name in DICT_METRICS:
        for k, v in (row.get(name) or {}).items():
            if _number(v) is not None:
                metrics[f"{name}.{k}"] = float(v)
    halves = {}
    for name, iv in (row.get("spread") or {}).items():
        high, mean = _number((iv or {}).get("ci95_high")), _number((iv or {}).get("mean"))
        if high is not None and mean is not None:
            halves[name] = high - mean
    setting = {k: row[k] for k in SETTING_FIELDS if row.get(k) is not None}
    return RunRow(_key(row, where), metrics, halves, setting)


def row_from_sweep(row: dict, where: str) -> RunRow:
    metrics: dict[str, float] = {}
    halves: dict[str, float] = {}
    for col, v in row.items():
        num = _number(v)
        if num is None:
            continue
        name = str(col)
        if name in SCALARS or name.split(".", 1)[0] in DICT_METRICS and "." in name:
            metrics[name] = num
        elif name.startswith("spread.") and name.endswith(".ci95_high"):
            metric = name[len("spread."):-len(".ci95_high")]
            mean = _number(row.get(f"spread.{metric}.mean"))
            if mean is not None:
                halves[metric] = num - mean
    setting = {k: row[k] for k in SETTING_FIELDS if row.get(k) is not None}
    return RunRow(_key(row, where), metrics, halves, setting)


def load_run(path: str) -> Run:
    """A `kvsim sim` report or a `kvsim sweep` directory / table."""
    p = Path(path)
    if not str(path) or not p.exists():
        raise ValueError(f"{path!r} does not exist (expected a `kvsim sim` report.json or a "
                         "`kvsim sweep` directory / table)")
    if p.is_file() and p.suffix == ".json":
        doc = json.loads(p.read_text())
        if isinstance(doc, dict) and doc.get("command") == "sim":
            if not doc.get("rows"):
                raise ValueError(f"{path}: the sim report has no rows")
            return Run(str(path), "sim report",
                       [row_from_report(r, str(path)) for r in doc["rows"]],
                       flatten(doc.get("config") or {}))
        if not (isinstance(doc, dict) and doc.get("command") == "sweep"):
            got = doc.get("command") if isinstance(doc, dict) else None
            raise ValueError(f"{path} is {'a ' + repr(got) + ' report' if got else 'not a report'}"
                             "; expected a `kvsim sim` report or a `kvsim sweep` table")
    from kvsim.plots.inputs import load_sweep

    table, _ = load_sweep(p)
    records = table.to_dict("records")
    if not records:
        raise ValueError(f"{path}: the sweep table has no rows")
    config_cols = [c for c in table.columns if str(c).startswith("config.")]
    constant, varying = {}, []
    for c in config_cols:
        values = {json.dumps(v, default=str) for v in table[c].tolist()}
        if len(values) == 1:
            constant[c[len("config."):]] = records[0][c]
        else:
            varying.append(c[len("config."):])
    return Run(str(path), "sweep", [row_from_sweep(r, str(path)) for r in records],
               constant, sorted(varying))
