"""Grid sweeps over `kvsim sim`: expand grid axes into points, compose one sim config per point
(Hydra, through kvsim.cli.compose), run the simulator in-process, and collect a tidy table with
one row per (grid point, codec, transfer policy).

Columns: `point` (grid point index), `grid.<key>` for every swept key (the value given on the
command line), then the simulator's row with nested dicts flattened to `<key>.<sub>` (e.g.
`ttkt_s.64`, `breakdown_s.decode`, `stream_bytes.anchor`). Written as <out>.csv and
<out>.parquet, with a sidecar <out>.json holding the grid, the base overrides, the resolved base
sim config, each point's overrides and provenance.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvsim.config.sim import SimConfig
from kvsim.report import json_safe, provenance

GRID_PREFIX = "grid."
# grid keys that replace the simulator's own inner sweep list of the same quantity
_INNER_SWEEP = {"workload.context_tokens": "sweep.context_tokens",
                "link.bandwidth_gbps": "sweep.bandwidth_gbps"}


@dataclass
class GridPoint:
    index: int
    values: dict[str, Any]  # swept key -> value at this point
    overrides: list[str]  # the `kvsim sim` overrides that make this point (base + grid)


@dataclass
class SweepResult:
    table: pd.DataFrame
    points: list[GridPoint]
    base_config: dict
    files: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0


def hydra_value(value: Any) -> str:
    """Render plain data as a Hydra override value (numbers, bools, null, quoted strings,
    lists, dicts), so that values given as data round-trip into `key=value` overrides."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"grid value {value!r} is not finite")
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace("'", "\\'")
        return f"'{escaped}'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"cannot express {value!r} ({type(value).__name__}) as a Hydra override")


def expand_grid(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Cartesian product of the axes, first axis slowest; every axis needs >= 1 value."""
    if not grid:
        raise ValueError("grid is empty: give at least one axis, e.g. "
                         "'grid={link.bandwidth_gbps: [10,25,50]}'")
    for key, values in grid.items():
        if not isinstance(values, (list, tuple)) or len(values) == 0:
            raise ValueError(f"grid axis {key!r} must be a non-empty list of values, "
                             f"got {values!r}")
        if not key or key.startswith(("+", "~")) or "=" in key:
            raise ValueError(f"grid axis {key!r} must be a plain config key such as "
                             "link.bandwidth_gbps or a group name such as model")
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True))
            for combo in itertools.product(*(grid[k] for k in keys))]


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def point_overrides(base: list[str], values: dict[str, Any]) -> list[str]:
    """Base overrides + one `key=value` per swept key; a swept key must not also be fixed in
    the base (which value wins would be unclear)."""
    fixed = {_override_key(o) for o in base}
    clash = sorted(fixed & set(values))
    if clash:
        raise ValueError(f"grid axes {clash} are also set by the base overrides; "
                         "set each key in one place")
    out = list(base)
    for key, value in values.items():
        out.append(f"{key}={hydra_value(value)}")
        inner = _INNER_SWEEP.get(key)
        if inner and inner not in fixed:  # the grid value must not be replaced by a
            out.append(f"{inner}=[]")  # scenario's inner sweep list
    return out


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


def compose_sim(overrides: list[str]) -> tuple[SimConfig, dict]:
    """Typed and plain `kvsim sim` config for these overrides (Hydra lives in kvsim.cli)."""
    from kvsim.cli import compose

    try:
        return compose("sim", overrides, SimConfig)
    except Exception as exc:  # Hydra / OmegaConf errors: name the overrides that failed
        cause = f" ({str(exc.__cause__).strip().splitlines()[0]})" if exc.__cause__ else ""
        raise ValueError(f"sim config with overrides {overrides} does not compose: "
                         f"{str(exc).strip()}{cause}") from exc


def run_sweep(grid: dict[str, list[Any]], base: list[str], progress: bool = True) -> SweepResult:
    """Run `kvsim sim` at every grid point; one table row per (point, codec, transfer)."""
    from kvsim.sim.run import run_all

    started = time.perf_counter()
    combos = expand_grid(grid)
    points = [GridPoint(i, values, point_overrides(base, values))
              for i, values in enumerate(combos)]
    base_cfg, base_plain = compose_sim(list(base))
    if base_cfg.trace_path:
        raise ValueError("trace_path is set: a sweep would overwrite one trace per point; "
                         "trace single runs with `kvsim sim trace_path=...`")
    configs = [compose_sim(p.overrides)[0] for p in points]  # fail before running anything
    from tqdm import tqdm

    rows: list[dict[str, Any]] = []
    for point, cfg in tqdm(list(zip(points, configs, strict=True)), desc="sweep", unit="point",
                           disable=not progress):
        sim_rows, _ = run_all(cfg, progress=False)
        for sim_row in sim_rows:
            row: dict[str, Any] = {"point": point.index}
            row.update({f"{GRID_PREFIX}{k}": v for k, v in point.values.items()})
            row.update(flatten(sim_row))
            rows.append(row)
    table = pd.DataFrame(rows)
    return SweepResult(table, points, base_plain, wall_s=time.perf_counter() - started)


def output_paths(out: str | Path) -> dict[str, Path]:
    """<out>.csv, <out>.parquet and the sidecar <out>.json (a given suffix is dropped)."""
    out = Path(out)
    if out.suffix in (".csv", ".parquet", ".json"):
        out = out.with_suffix("")
    if not out.name:
        raise ValueError("out must name a file stem, e.g. out=results/sweep1")
    return {"csv": out.with_suffix(".csv"), "parquet": out.with_suffix(".parquet"),
            "sidecar": out.with_suffix(".json")}


def write_sweep(result: SweepResult, out: str | Path, grid: dict, base: list[str],
                sweep_config: dict) -> dict[str, Path]:
    paths = output_paths(out)
    paths["csv"].parent.mkdir(parents=True, exist_ok=True)
    result.table.to_csv(paths["csv"], index=False)
    result.table.to_parquet(paths["parquet"], index=False)
    sidecar = {
        "command": "sweep",
        "sweep_config": sweep_config,
        "grid": grid,
        "base_overrides": base,
        "base_config": result.base_config,
        "points": [{"point": p.index, "values": p.values, "overrides": p.overrides}
                   for p in result.points],
        "grid_columns": [f"{GRID_PREFIX}{k}" for k in grid],
        "columns": list(result.table.columns),
        "rows": len(result.table),
        "files": {"csv": str(paths["csv"]), "parquet": str(paths["parquet"])},
        "provenance": provenance(),
        "wall_s": result.wall_s,
    }
    paths["sidecar"].write_text(json.dumps(json_safe(sidecar), indent=1) + "\n")
    result.files = {k: str(v) for k, v in paths.items()}
    return paths


__all__ = ["GridPoint", "SweepResult", "hydra_value", "expand_grid", "point_overrides",
           "flatten", "compose_sim", "run_sweep", "output_paths", "write_sweep", "GRID_PREFIX"]
