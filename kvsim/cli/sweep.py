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
table of them; a rerun computes only what is missing. With the joblib launcher, its worker
processes start, and load what a job loads (`prepare_worker`: Hydra's plugins, the command's
`prepare()`, the table writer), while the parent writes the manifest; the launcher then
reuses them.

Which points are done is known without composing anything when nothing that shapes a resolved
config changed: every finished job leaves `jobs/<job id>.json` (job id: sha256 of its
overrides) naming its point key and the fingerprint of conf/ and kvsim's code it ran with; a
rerun with the same fingerprint reads those markers, launches nothing that is done and
composes nothing. With another fingerprint every job is launched again, and a job whose
resolved config hashes to an existing point returns that point without running (the
resolved config, not the command line, decides).

Sweep directory layout:
    points/<key>.json    one finished point: overrides, resolved config, rows, wall time
    jobs/<job id>.json   a job's marker: its overrides, point key and fingerprint
    host-checks/         the host check of a measured profile read on another host, made
                         by the first job that needs it and read by the rest (one probe
                         and one factor per sweep: kvsim.calibrate.host_probe.shared_checks)
    <job number>/        Hydra's job directory (.hydra/, report.json, output.txt)
    sweep.csv, sweep.parquet
                         one row per (job, codec, transfer): `point`, `overrides`,
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
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from kvsim.core.report import json_safe

POINTS_DIR = "points"
HOST_CHECKS_DIR = "host-checks"  # the sweep's one check per measured profile (host_probe)
JOBS_DIR = "jobs"
TABLE_EVERY_S = 10.0  # a finishing job rewrites the merged table when it is older than this
TABLE_STEM = "sweep"
GRID_PREFIX = "grid."
CONFIG_PREFIX = "config."
MANIFEST = "manifest.json"
TABLE_IMPORTS = ("pandas", "pyarrow.parquet")  # the merged table's writer (write_table)


class SweepFailed(CompactHydraException):
    pass


# Ctrl-C while a point runs raises KeyboardInterrupt wherever the interpreter is; raised inside
# a finalizer (a suspended simulator process closed by the garbage collector, a __del__)
# Python prints it and carries on, and the sweep would run its remaining points. While a
# sweep launches its jobs, a latch keeps the signal, so that the next point refuses to start.
_interrupted = False


def _latch_interrupt(signum: int, frame: Any) -> None:
    global _interrupted
    _interrupted = True
    signal.default_int_handler(signum, frame)  # KeyboardInterrupt here, as without the latch


@contextlib.contextmanager
def interrupt_latch() -> Iterator[None]:
    """While the sweeper launches its jobs: SIGINT is remembered as well as raised (in the
    main thread, where Python's own handler is in place; elsewhere nothing changes)."""
    global _interrupted
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    _interrupted = False
    try:
        signal.signal(signal.SIGINT, _latch_interrupt)
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _interrupted = False  # this sweep's; a later one in this process starts afresh


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt when SIGINT arrived during an earlier point of this sweep,
    whether or not it stopped that point (interrupt_latch)."""
    if _interrupted:
        raise KeyboardInterrupt


def prepare_worker(module: str, prepare: str | None) -> int:
    """A sweep worker's warm-up (hydra_plugins/kvsim_sweeper), done once before its first job
    arrives: what every job does first (Hydra's plugin discovery), the command's module and
    its `prepare()` (what its first run loads), the merged table's writer; returns the pid."""
    import importlib

    from hydra.core.plugins import Plugins

    Plugins.instance()
    mod = importlib.import_module(module)
    if prepare is not None:
        getattr(mod, prepare)()
    for name in TABLE_IMPORTS:
        importlib.import_module(name)
    return os.getpid()


DISPLAY_KEYS = ("wide",)  # config keys that change what is printed, not a point's result


def point_key(config: dict) -> str:
    """The identity of a point: sha256 of its resolved config (sorted JSON) without the
    display-only keys, 16 hex digits."""
    kept = {k: v for k, v in config.items() if k not in DISPLAY_KEYS}
    text = json.dumps(json_safe(kept), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def job_id(overrides: list[str]) -> str:
    """A job's identity on the command line: sha256 of its overrides, 16 hex digits."""
    return hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:16]


def config_fingerprint() -> str:
    """sha256 over conf/ and kvsim's code: what, with the overrides, decides a resolved config
    (presets, schema defaults). Equal fingerprints let a rerun trust its job markers."""
    from kvsim.core.paths import CONF_DIR

    digest = hashlib.sha256()
    code = Path(__file__).resolve().parents[1]  # the kvsim package
    for root, pattern in ((CONF_DIR, "*.yaml"), (code, "*.py")):
        for path in sorted(root.rglob(pattern)):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def read_marker(sweep_dir: Path, overrides: list[str]) -> dict | None:
    path = sweep_dir / JOBS_DIR / f"{job_id(overrides)}.json"
    try:
        marker = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    point = sweep_dir / POINTS_DIR / f"{marker.get('key')}.json"
    return marker if point.is_file() else None


def write_marker(sweep_dir: Path, overrides: list[str], key: str, fingerprint: str) -> None:
    (sweep_dir / JOBS_DIR).mkdir(parents=True, exist_ok=True)
    _write_atomic(sweep_dir / JOBS_DIR / f"{job_id(overrides)}.json",
                  json.dumps({"overrides": overrides, "key": key,
                              "fingerprint": fingerprint}) + "\n")


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
def _locked(sweep_dir: Path, wait: bool = True) -> Iterator[bool]:
    """One writer of the merged table at a time (jobs finish in parallel processes); with
    wait=False, yields False at once when another process holds the lock."""
    with open(sweep_dir / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load_points(sweep_dir: Path, keys: list[str]) -> list[dict]:
    """The finished points of a sweep directory among `keys`, in that order."""
    folder = sweep_dir / POINTS_DIR
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
    """One row per (point, codec, transfer); a point is {key, overrides, config, rows}."""
    import pandas as pd

    rows = []
    for point in points:
        values = dict(o.split("=", 1) for o in point["overrides"] if "=" in o)
        head: dict[str, Any] = {"point": point["key"],
                                "overrides": " ".join(point["overrides"])}
        for key in grid:
            head[f"{GRID_PREFIX}{key}"] = _grid_value(point["config"], key,
                                                      values.get(key, ""))
        config = flatten(point["config"], CONFIG_PREFIX)  # the same for each of its rows
        for sim_row in point["rows"]:
            rows.append({**head, **flatten(sim_row), **config})
    return pd.DataFrame(rows)


def done_points(sweep_dir: Path, jobs: list[list[str]]) -> list[dict]:
    """The finished points of these jobs, in job order, each with the job's overrides."""
    out, cache = [], {}
    for overrides in jobs:
        marker = read_marker(sweep_dir, overrides)
        if marker is None:
            continue
        key = marker["key"]
        if key not in cache:
            cache[key] = load_points(sweep_dir, [key])[0]
        out.append({**cache[key], "overrides": list(overrides)})
    return out


def write_table(sweep_dir: Path) -> dict[str, Path]:
    """Rewrite sweep.csv / sweep.parquet / sweep.json from the finished jobs of the manifest
    (call under the lock)."""
    import io

    from kvsim.core.report import provenance

    manifest = json.loads((sweep_dir / MANIFEST).read_text())
    points = done_points(sweep_dir, manifest["jobs"])
    table = build_table(points, manifest["grid"])
    paths = {"csv": sweep_dir / f"{TABLE_STEM}.csv",
             "parquet": sweep_dir / f"{TABLE_STEM}.parquet",
             "sidecar": sweep_dir / f"{TABLE_STEM}.json"}
    _write_atomic(paths["csv"], table.to_csv(index=False))
    buf = io.BytesIO()
    table.to_parquet(buf, index=False)
    _write_atomic(paths["parquet"], buf.getvalue())
    sidecar = {
        "command": "sweep",
        "arguments": manifest["arguments"],
        "grid": manifest["grid"],
        "grid_columns": [f"{GRID_PREFIX}{k}" for k in manifest["grid"]],
        "points_expected": len(manifest["jobs"]),
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
    """One job of a resumable sweep (called inside the Hydra job): unless its resolved
    config's point exists, run the command with its printed output going to <job
    dir>/output.txt and write points/<key>.json; leave the job's marker; rewrite the merged
    table when it is older than TABLE_EVERY_S; say how far the sweep is. A Ctrl-C that an
    earlier point swallowed stops the sweep here (stop_if_interrupted)."""
    from hydra.core.hydra_config import HydraConfig

    stop_if_interrupted()
    hc = HydraConfig.get()
    sweep_dir = Path(hc.sweep.dir)
    job_dir = Path(hc.runtime.output_dir)
    key = point_key(plain)
    manifest = json.loads((sweep_dir / MANIFEST).read_text())
    started = time.perf_counter()
    existing = sweep_dir / POINTS_DIR / f"{key}.json"
    if existing.is_file():  # the same resolved config, run before (another grid, other code)
        rows = load_points(sweep_dir, [key])[0]["rows"]
        write_marker(sweep_dir, overrides, key, manifest["fingerprint"])
        how = "reused"
    else:
        from kvsim.calibrate.host_probe import shared_checks
        from kvsim.core.data_files import loaded_files

        job_dir.mkdir(parents=True, exist_ok=True)
        # a host check (a measured profile on another host) made once for the sweep
        with open(job_dir / "output.txt", "w") as out, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(out), shared_checks(sweep_dir / HOST_CHECKS_DIR):
            rows = run(typed) or []
        doc = {"key": key, "overrides": overrides, "config": plain, "rows": rows,
               "wall_s": time.perf_counter() - started, "job_dir": str(job_dir),
               "command": name,
               "data_files": loaded_files()}  # what this job's process loaded (path, sha256)
        # the marker first: a marker counts only once its point exists (read_marker), so an
        # interrupt between the two writes never leaves a point that the table leaves out
        write_marker(sweep_dir, overrides, key, manifest["fingerprint"])
        (sweep_dir / POINTS_DIR).mkdir(parents=True, exist_ok=True)
        _write_atomic(existing, json.dumps(json_safe(doc)) + "\n")
        how = f"{time.perf_counter() - started:.1f} s"
    table = sweep_dir / f"{TABLE_STEM}.parquet"
    if not table.is_file() or time.time() - table.stat().st_mtime > TABLE_EVERY_S:
        with _locked(sweep_dir, wait=False) as mine:
            if mine:
                write_table(sweep_dir)
    done = sum(1 for job in manifest["jobs"]
               if (sweep_dir / JOBS_DIR / f"{job_id(job)}.json").is_file())
    print(f"sweep: {done}/{len(manifest['jobs'])} points done ({how}: {' '.join(overrides)})",
          file=sys.stderr, flush=True)
    return rows


def newest_input_mtime(sweep_dir: Path) -> float:
    """The latest modification time of what the merged table is made of: the manifest and
    every point. A table older than this is stale."""
    paths = [sweep_dir / MANIFEST, *(sweep_dir / POINTS_DIR).glob("*.json")]
    return max((p.stat().st_mtime for p in paths if p.is_file()), default=0.0)


def print_summary(table_path: Path, grid: dict[str, list[str]]) -> None:
    """The merged table's headline columns, one line per (point, codec, transfer): committed
    times, then drafted ones (as the seeds count), in seconds from request arrival. Read from
    the table's CSV twin with the standard library: a rerun of a finished sweep, which only
    prints this, need not import pandas."""
    import csv

    from kvsim.core.report import format_table

    csv_path = table_path.with_suffix(".csv")
    if not csv_path.is_file():
        return
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    cols = [("point", "point", "")]
    cols += [(f"{GRID_PREFIX}{k}", k, "") for k in grid]
    # committed times first (the time a user sees a verified token), as `kvsim sim` prints
    cols += [(c, h, f) for c, h, f in (("codec", "codec", ""), ("transfer", "transfer", ""),
                                       ("ttft_committed_s", "TTFT\ns", ".3f"),
                                       ("ttkt_committed_s.32", "TT32T\ns", ".3f"),
                                       ("ttkt_committed_s.64", "TT64T\ns", ".3f"),
                                       ("ttkt_s.32", "drafted\nTT32T s", ".3f"),
                                       ("ttkt_s.64", "drafted\nTT64T s", ".3f"))
             if c in rows[0]]
    # the row `kvsim sim` picked at each point, as advise would; with codecs or transfer among
    # the grid's keys each point picks among its own rows only, so none is marked
    swept_choice = sorted({"codecs", "transfer"} & set(grid))
    if "pick" in rows[0] and not swept_choice:
        cols.append(("pick_mark", "pick", ""))
        for row in rows:
            row["pick_mark"] = "*" if row["pick"] == "True" else ""
    numeric = [c for c, _, f in cols if f]
    for row in rows:
        row["point"] = row["point"][:8]
        for c in numeric:  # an empty cell (a metric a row lacks) stays empty
            row[c] = float(row[c]) if row[c] not in ("", None) else None
    print(format_table(rows, cols))
    if swept_choice:
        print(f"no pick marked: {', '.join(swept_choice)} swept, each point picks among its "
              "own rows; `kvsim advise` ranks codecs and policies of one setting together")
