"""Sweep speed: one grid swept with Hydra's basic launcher (sequential, in one process), with
`kvsim sweep`'s default joblib launcher (every core), and again over the joblib run's finished
directory (a resume with nothing left to do). Each mode is a fresh `kvsim sweep` process with
its own temporary sweep directory; wall seconds and the ratio to the basic mode of the same
invocation are reported."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.report import format_table

COMMAND = ("bench", "sweep")
HELP = "sweep speed: basic vs joblib launcher vs a resume over a finished sweep (ratios)"
CONFIG_NAME = "bench_sweep"
MODES = ("basic", "joblib", "joblib-rerun")


@dataclass
class Config:
    grid: list[str] = field(default_factory=list)  # `kvsim sweep` arguments (key=a,b axes)
    modes: list[str] = field(default_factory=lambda: list(MODES))  # basic|joblib|joblib-rerun
    timeout_s: float = 1800.0  # per mode


def _sweep(args: list[str], sweep_dir: Path, launcher: str, timeout_s: float) -> float:
    cmd = [sys.executable, "-m", "kvsim", "sweep", *args, f"hydra/launcher={launcher}",
           f"hydra.sweep.dir={sweep_dir}"]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ})
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"`{' '.join(cmd)}` ran past timeout_s={timeout_s:g}") from exc
    if proc.returncode != 0:
        raise ValueError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - started


def run(cfg: Config) -> list[dict]:
    unknown = sorted(set(cfg.modes) - set(MODES))
    if unknown or not cfg.modes:
        raise ValueError(f"modes must be a non-empty list of {MODES}, got {cfg.modes}")
    if "joblib-rerun" in cfg.modes and "joblib" not in cfg.modes:
        raise ValueError("joblib-rerun resumes the joblib mode's directory: list joblib too")
    if not cfg.grid:
        raise ValueError("grid is empty: give the `kvsim sweep` arguments, e.g. "
                         "'grid=[\"link.bandwidth_gbps=10,25\"]'")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvsim-bench-sweep-") as tmp:
        dirs = {"basic": Path(tmp) / "basic", "joblib": Path(tmp) / "joblib",
                "joblib-rerun": Path(tmp) / "joblib"}
        for mode in cfg.modes:
            launcher = "basic" if mode == "basic" else "joblib"
            print(f"bench sweep: {mode} ...", file=sys.stderr, flush=True)
            wall_s = _sweep(list(cfg.grid), dirs[mode], launcher, cfg.timeout_s)
            points = len(list((dirs[mode] / "points").glob("*.json")))
            rows.append({"mode": mode, "launcher": launcher, "points": points,
                         "wall_s": wall_s, "cores": os.cpu_count()})
    basic = next((r["wall_s"] for r in rows if r["mode"] == "basic"), None)
    for r in rows:
        r["ratio_to_basic"] = r["wall_s"] / basic if basic else None
        r["speedup_vs_basic"] = basic / r["wall_s"] if basic else None
    print(format_table(rows, [("mode", "mode", ""), ("points", "points", "d"),
                              ("wall_s", "wall s", ".1f"), ("ratio_to_basic", "/basic", ".3f"),
                              ("speedup_vs_basic", "speedup", ".2f"),
                              ("cores", "cores", "d")]))
    return rows
