"""Load and check the files figures are made from; wrong or missing input is a ValueError
that names the file and what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kvsim.core.data_files import record_loaded
from kvsim.scenario.acceptance import ACCEPTANCE_DIR, AcceptanceModel, load_acceptance


def _existing(path: str | Path, what: str) -> Path:
    if not str(path):
        raise ValueError(f"input is empty: give input=PATH to {what}")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"input {p} does not exist (expected {what})")
    return p


def load_json(path: str | Path, what: str) -> dict:
    p = _existing(path, what)
    if p.is_dir():
        raise ValueError(f"input {p} is a directory (expected {what})")
    try:
        doc = json.loads(p.read_text())
        record_loaded(p)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"input {p} is not JSON ({exc}); expected {what}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"input {p} is not a JSON object; expected {what}")
    return doc


def run_date(doc: dict) -> str:
    """The UTC date a report was written ("2026-11-27"), from its provenance; "" if absent."""
    import datetime

    created = (doc.get("provenance") or {}).get("created_unix_s")
    if not isinstance(created, (int, float)):
        return ""
    return datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%d")


def describe_run(config: dict) -> str:
    """'<model>, <n>x <hardware>' from a resolved `kvsim sim` config (the link rate and
    context are each panel's)."""
    model = (config.get("model") or {}).get("name", "?")
    hw = config.get("hardware") or {}
    return f"{model}, {hw.get('devices', 1)}x {hw.get('name', '?')}"


def load_report(path: str | Path, command: str) -> dict:
    """A report written with `kvsim <command> report=PATH` that has rows."""
    what = f"a `kvsim {command} report=PATH` JSON report"
    doc = load_json(path, what)
    got = doc.get("command")
    if got != command:
        raise ValueError(f"input {path} is a {got!r} report, not a {command!r} one "
                         f"(expected {what})" if got else
                         f"input {path} has no 'command' field (expected {what})")
    if not doc.get("rows"):
        raise ValueError(f"input {path}: the {command!r} report has no rows")
    return doc


def load_sweep(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """A `kvsim sweep` table (.parquet / .csv) or its sidecar .json -> (table, sidecar)."""
    what = ("a `kvsim sweep` directory, or its table (sweep.parquet, sweep.csv or the "
            "sidecar sweep.json)")
    p = _existing(path, what)
    if p.is_dir():
        p = p / "sweep.parquet"
        if not p.is_file():
            raise ValueError(f"{p.parent} holds no sweep.parquet; expected {what}")
    stem = p.with_suffix("")
    sidecar_path = stem.with_suffix(".json")
    sidecar = load_json(sidecar_path, what) if sidecar_path.is_file() else {}
    if sidecar and sidecar.get("command") != "sweep":
        raise ValueError(f"{sidecar_path} is not a sweep sidecar (command "
                         f"{sidecar.get('command')!r}); expected {what}")
    if p.suffix == ".json":
        table_path = next((c for c in (stem.with_suffix(".parquet"), stem.with_suffix(".csv"))
                           if c.is_file()), None)
        if table_path is None:
            raise ValueError(f"sweep sidecar {p}: neither {stem}.parquet nor {stem}.csv exists")
    elif p.suffix in (".parquet", ".csv"):
        table_path = p
    else:
        raise ValueError(f"input {p} has suffix {p.suffix!r}; expected {what}")
    try:
        table = (pd.read_parquet(table_path) if table_path.suffix == ".parquet"
                 else pd.read_csv(table_path))
        record_loaded(table_path)
    except Exception as exc:  # pyarrow / pandas parse errors of a damaged file
        raise ValueError(f"cannot read sweep table {table_path}: {exc}") from exc
    if table.empty:
        raise ValueError(f"sweep table {table_path} has no rows")
    return table, sidecar


def load_survivals(input_path: str, match: str) -> list[AcceptanceModel]:
    """Acceptance files: a directory (files matching `match`), one file, or comma-separated
    files; default data/acceptance/."""
    what = "an acceptance file or a directory of them (data/acceptance/)"
    if not input_path:
        input_path = str(ACCEPTANCE_DIR)
    files: list[Path] = []
    for part in [s.strip() for s in input_path.split(",") if s.strip()]:
        p = _existing(part, what)
        files += sorted(p.glob(match)) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"no acceptance files match {match!r} in {input_path}")
    models = []
    for f in files:
        doc = load_json(f, what)
        if "survival" not in doc:
            raise ValueError(f"input {f} has no 'survival' curve (expected {what})")
        models.append(load_acceptance(str(f)))
    return models


def describe_sim(config: dict) -> str:
    """'<model>, <n>x<hardware>, <Gbps> Gbps' from a resolved `kvsim sim` config."""
    link = config.get("link") or {}
    bw = f"{link['bandwidth_gbps']:g}" if link.get("bandwidth_gbps") is not None else "?"
    return f"{describe_run(config)}, {bw} Gbps"


def codec_label(row: dict, labels_with_many_policies: set[str]) -> str:
    """Codec label, with the transfer policy when the same codec ran under several."""
    label = str(row.get("codec"))
    return f"{label} ({row.get('transfer')})" if label in labels_with_many_policies else label


def many_policy_codecs(rows: list[dict]) -> set[str]:
    seen: dict[str, set[str]] = {}
    for r in rows:
        seen.setdefault(str(r.get("codec")), set()).add(str(r.get("transfer")))
    return {c for c, policies in seen.items() if len(policies) > 1}


def group_by_setting(rows: list[dict]) -> dict[tuple[int, float], list[dict]]:
    """Sim rows grouped by (context_tokens, bandwidth_gbps) (a sim with an inner sweep)."""
    groups: dict[tuple[int, float], list[dict]] = {}
    for r in rows:
        key = (int(r.get("context_tokens", 0)), float(r.get("bandwidth_gbps", 0.0)))
        groups.setdefault(key, []).append(r)
    return groups
