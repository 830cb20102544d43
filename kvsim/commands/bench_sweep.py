"""Sweep speed: one grid swept with Hydra's basic launcher (sequential, in one process), with
Hydra's joblib launcher, with `kvsim sweep`'s default (`kvsim_joblib`: joblib, the shared job
context sent once per worker), and again over the default's finished directory (a resume
with nothing left to do). Each mode is a fresh `kvsim sweep` process with its own temporary
sweep directory. The modes run in turn `repeats` times (interleaved, so a slow spell of a
shared machine hits every mode alike); each repeat's ratio is to its own basic run, and the
table reports the median wall seconds and the median of those ratios."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.core.report import format_table
from kvsim.transport.children import popen

COMMAND = ("bench", "sweep")
HELP = ("sweep speed: basic vs Hydra's joblib vs kvsim's default launcher vs a resume of a "
        "finished sweep (median ratios over interleaved repeats)")
CONFIG_NAME = "bench_sweep"
RERUN = "rerun"  # the default launcher again over its finished directory
MODES = ("basic", "joblib", "kvsim_joblib", RERUN)


@dataclass
class Config:
    grid: list[str] = field(default_factory=list)  # `kvsim sweep` arguments (key=a,b axes)
    modes: list[str] = field(default_factory=lambda: list(MODES))  # of MODES, run in order
    repeats: int = 3  # rounds over the modes; medians reported
    timeout_s: float = 1800.0  # per mode


def _sweep(args: list[str], sweep_dir: Path, launcher: str, timeout_s: float) -> float:
    cmd = [sys.executable, "-m", "kvsim", "sweep", *args, f"hydra/launcher={launcher}",
           f"hydra.sweep.dir={sweep_dir}"]
    started = time.perf_counter()
    with popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
               env={**os.environ}) as proc:  # popen: the sweep ends if this process dies
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            raise TimeoutError(f"`{' '.join(cmd)}` ran past timeout_s={timeout_s:g}") from exc
    if proc.returncode != 0:
        raise ValueError(f"`{' '.join(cmd)}` failed:\n{stderr[-2000:]}")
    return time.perf_counter() - started


def run(cfg: Config) -> list[dict]:
    unknown = sorted(set(cfg.modes) - set(MODES))
    if unknown or not cfg.modes:
        raise ValueError(f"modes must be a non-empty list of {MODES}, got {cfg.modes}")
    if RERUN in cfg.modes and (
            "kvsim_joblib" not in cfg.modes
            or cfg.modes.index(RERUN) < cfg.modes.index("kvsim_joblib")):
        raise ValueError(f"{RERUN} resumes the kvsim_joblib mode's directory: list "
                         "kvsim_joblib before it")
    if cfg.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {cfg.repeats}")
    if not cfg.grid:
        raise ValueError("grid is empty: give the `kvsim sweep` arguments, e.g. "
                         "'grid=[\"link.bandwidth_gbps=10,25\"]'")
    walls: dict[str, list[float]] = {m: [] for m in cfg.modes}
    ratios: dict[str, list[float]] = {m: [] for m in cfg.modes}
    points: dict[str, int] = {}
    for repeat in range(cfg.repeats):
        with tempfile.TemporaryDirectory(prefix="kvsim-bench-sweep-") as tmp:
            for mode in cfg.modes:
                launcher = "kvsim_joblib" if mode == RERUN else mode
                sweep_dir = Path(tmp) / launcher
                print(f"bench sweep: repeat {repeat + 1}/{cfg.repeats}, {mode} ...",
                      file=sys.stderr, flush=True)
                walls[mode].append(_sweep(list(cfg.grid), sweep_dir, launcher, cfg.timeout_s))
                points[mode] = len(list((sweep_dir / "points").glob("*.json")))
        if "basic" in cfg.modes:
            for mode in cfg.modes:
                ratios[mode].append(walls[mode][-1] / walls["basic"][-1])
    rows = []
    for mode in cfg.modes:
        ratio = statistics.median(ratios[mode]) if ratios[mode] else None
        rows.append({"mode": mode, "launcher": "kvsim_joblib" if mode == RERUN else mode,
                     "points": points[mode], "repeats": cfg.repeats,
                     "wall_s": statistics.median(walls[mode]), "wall_s_all": walls[mode],
                     "ratio_to_basic": ratio, "ratios_to_basic": ratios[mode],
                     "speedup_vs_basic": 1 / ratio if ratio else None,
                     "cores": os.cpu_count()})
    print(format_table(rows, [("mode", "mode", ""), ("points", "points", "d"),
                              ("wall_s", "median wall s", ".1f"),
                              ("ratio_to_basic", "/basic", ".3f"),
                              ("speedup_vs_basic", "speedup", ".2f"),
                              ("cores", "cores", "d")]))
    for row in rows:
        print(f"  {row['mode']}: wall s {', '.join(f'{w:.1f}' for w in row['wall_s_all'])}"
              + (f"; /basic {', '.join(f'{r:.3f}' for r in row['ratios_to_basic'])}"
                 if row["ratios_to_basic"] else ""))
    return rows
