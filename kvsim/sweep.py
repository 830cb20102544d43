"""Resumable sweeps: a Hydra sweeper that runs each point of a multirun once, and the tidy
table of a sweep directory.

`kvsim sweep key=a,b ...` is `kvsim sim -m hydra/sweeper=kvsim_resume
hydra/launcher=joblib ...` (kvsim/commands/sweep.py). The sweeper is a Hydra plugin, so it
lives where Hydra looks for plugins (hydra_plugins/kvsim_sweeper/). It expands the grid as
Hydra's basic sweeper does (the scenario's `hydra.sweeper.params`, then the command line: a
key given there wins), composes every point's config and hashes it (`point_key`: sha256 of
the resolved config), and launches only the points whose `points/<key>.json` is missing from
the sweep directory, through whichever Hydra launcher is configured (joblib, submitit_local
or submitit_slurm, ray). Each job, when it finishes, writes its point file and rewrites the
merged table under a file lock, so an interrupted sweep leaves every finished point and a
table of them; a rerun computes only what is missing.

Sweep directory layout:
    points/<key>.json    one finished point: overrides, resolved config, rows, wall time
    <job number>/        Hydra's job directory (.hydra/, report.json, output.txt)
    sweep.csv, sweep.parquet
                         one row per (point, codec, transfer): `point`, `overrides`,
                         `grid.<key>` per swept key, `config.<key>` per resolved config
                         value, and the simulator's row flattened (`ttkt_s.64`, ...)
    sweep.json           the sidecar: grid, points, columns, provenance
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from kvsim.report import json_safe

POINTS_DIR = "points"
TABLE_STEM = "sweep"
GRID_PREFIX = "grid."
CONFIG_PREFIX = "config."
MANIFEST = "manifest.json"


class SweepFailed(CompactHydraException):
    pass


def point_key(config: dict) -> str:
    """The identity of a point: sha256 of its resolved config (sorted JSON), 16 hex digits."""
    text = json.dumps(json_safe(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def flatten(row: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> `<key>.<sub>` columns; lists -> JSON text (one cell each)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(json_safe(value))
        else:
            out[name] = value
    return out


def _write_atomic(path: Path, text: str | bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(text, bytes):
        tmp.write_bytes(text)
    else:
        tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(sweep_dir: Path) -> Iterator[None]:
    """One writer of the merged table at a time (jobs finish in parallel processes)."""
    with open(sweep_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load_points(sweep_dir: Path, keys: list[str] | None = None) -> list[dict]:
    """The finished points of a sweep directory (those of `keys`, in that order, if given)."""
    folder = sweep_dir / POINTS_DIR
    if keys is None:
        paths = sorted(folder.glob("*.json"))
    else:
        paths = [folder / f"{k}.json" for k in keys if (folder / f"{k}.json").is_file()]
    points = []
    for p in paths:
        try:
            points.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"sweep point file {p} is unreadable ({exc}); delete it and "
                             "rerun the sweep to recompute that point") from exc
    return points


def _grid_value(config: dict, key: str, override_value: str) -> Any:
    """A swept key's value at a point: the resolved config value, or the preset name for a
    group (model=..., hardware=...)."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return override_value
        node = node[part]
    return override_value if isinstance(node, (dict, list)) else node


def build_table(points: list[dict], grid: dict[str, list[str]]):
    import pandas as pd

    rows = []
    for point in points:
        values = dict(o.split("=", 1) for o in point["overrides"] if "=" in o)
        for sim_row in point["rows"]:
            row: dict[str, Any] = {"point": point["key"],
                                   "overrides": " ".join(point["overrides"])}
            for key in grid:
                row[f"{GRID_PREFIX}{key}"] = _grid_value(point["config"], key,
                                                         values.get(key, ""))
            row.update(flatten(sim_row))
            row.update(flatten(point["config"], CONFIG_PREFIX))
            rows.append(row)
    return pd.DataFrame(rows)


def write_table(sweep_dir: Path) -> dict[str, Path]:
    """Rewrite sweep.csv / sweep.parquet / sweep.json from the finished points (call under
    the lock)."""
    from kvsim.report import provenance

    manifest = json.loads((sweep_dir / MANIFEST).read_text())
    points = load_points(sweep_dir, [p["key"] for p in manifest["points"]])
    table = build_table(points, manifest["grid"])
    paths = {"csv": sweep_dir / f"{TABLE_STEM}.csv",
             "parquet": sweep_dir / f"{TABLE_STEM}.parquet",
             "sidecar": sweep_dir / f"{TABLE_STEM}.json"}
    _write_atomic(paths["csv"], table.to_csv(index=False))
    import io

    buf = io.BytesIO()
    table.to_parquet(buf, index=False)
    _write_atomic(paths["parquet"], buf.getvalue())
    sidecar = {
        "command": "sweep",
        "arguments": manifest["arguments"],
        "grid": manifest["grid"],
        "grid_columns": [f"{GRID_PREFIX}{k}" for k in manifest["grid"]],
        "points_expected": len(manifest["points"]),
        "points_done": len(points),
        "points": [{"key": p["key"], "overrides": p["overrides"], "wall_s": p["wall_s"],
                    "job_dir": p["job_dir"]} for p in points],
        "columns": list(table.columns),
        "rows": len(table),
        "files": {"csv": str(paths["csv"]), "parquet": str(paths["parquet"])},
        "provenance": provenance(),
    }
    # the jobs ran in other processes (joblib, submitit): their data files, merged
    seen = {(f["path"], f["sha256"]): f for f in sidecar["provenance"]["data_files"]}
    for p in points:
        for f in p.get("data_files", []):
            seen.setdefault((f["path"], f["sha256"]), f)
    sidecar["provenance"]["data_files"] = sorted(seen.values(), key=lambda f: f["path"])
    _write_atomic(paths["sidecar"], json.dumps(json_safe(sidecar), indent=1) + "\n")
    return paths


def run_point(run: Callable[[Any], list[dict]], typed: Any, plain: dict,
              overrides: list[str], name: str) -> list[dict]:
    """One job of a resumable sweep (called inside the Hydra job): run the command with its
    printed output going to <job dir>/output.txt, write points/<key>.json, rewrite the merged
    table, and say how far the sweep is."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    sweep_dir = Path(hc.sweep.dir)
    job_dir = Path(hc.runtime.output_dir)
    key = point_key(plain)
    started = time.perf_counter()
    job_dir.mkdir(parents=True, exist_ok=True)
    with open(job_dir / "output.txt", "w") as out, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        rows = run(typed) or []
    wall_s = time.perf_counter() - started
    from kvsim.data_files import loaded_files

    doc = {"key": key, "overrides": overrides, "config": plain, "rows": rows,
           "wall_s": wall_s, "job_dir": str(job_dir), "command": name,
           "data_files": loaded_files()}  # what this job's process loaded (path, sha256)
    (sweep_dir / POINTS_DIR).mkdir(parents=True, exist_ok=True)
    _write_atomic(sweep_dir / POINTS_DIR / f"{key}.json", json.dumps(json_safe(doc)) + "\n")
    with _locked(sweep_dir):
        write_table(sweep_dir)
        manifest = json.loads((sweep_dir / MANIFEST).read_text())
        keys = {p["key"] for p in manifest["points"]}
        done = sum(1 for k in keys if (sweep_dir / POINTS_DIR / f"{k}.json").is_file())
    print(f"sweep: {done}/{len(keys)} points done ({wall_s:.1f} s: {' '.join(overrides)})",
          file=sys.stderr, flush=True)
    return rows


def print_summary(table_path: Path, grid: dict[str, list[str]]) -> None:
    """The merged table's headline columns, one line per (point, codec, transfer)."""
    import pandas as pd

    from kvsim.report import format_table

    if not table_path.is_file():
        return
    table = pd.read_parquet(table_path)
    if table.empty:
        return
    cols = [("point", "point", "")]
    cols += [(f"{GRID_PREFIX}{k}", k, "") for k in grid]
    cols += [(c, h, f) for c, h, f in (("codec", "codec", ""), ("transfer", "transfer", ""),
                                       ("ttft_s", "TTFT s", ".3f"),
                                       ("ttft_committed_s", "TTFT-c", ".3f"),
                                       ("ttkt_s.32", "TT32T s", ".3f"),
                                       ("ttkt_s.64", "TT64T s", ".3f")) if c in table.columns]
    rows = table.to_dict(orient="records")
    for row in rows:
        row["point"] = str(row["point"])[:8]
    print(format_table(rows, cols))
