"""Run `kvsim sim` over the product of grid axes and write a tidy table: one row per
(grid point, codec, transfer policy), the swept values as `grid.<key>` columns, the simulator's
metrics flattened (`ttkt_s.64`, `breakdown_s.decode`, ...). Writes <out>.csv, <out>.parquet and
a sidecar <out>.json with the grid, the base overrides, the resolved base config and
provenance. Base config: `kvsim sim`'s, changed by base={scenario: ..., model: ..., ...}."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any

from kvsim.report import format_table
from kvsim.sweep import GRID_PREFIX, hydra_value, run_sweep, write_sweep

COMMAND = ("sweep",)
HELP = "run `kvsim sim` over a grid of config values -> tidy CSV/Parquet table + sidecar JSON"
CONFIG_NAME = "sweep"


@dataclass
class Config:
    # {key: [values]}: `kvsim sim` keys or groups (typed Any: Hydra then assigns the mapping,
    # dotted keys included, instead of merging it into a struct)
    grid: Any = None
    base: Any = None  # {key: value}: `kvsim sim` overrides shared by every grid point
    codecs: list[Any] | None = None  # shorthand for base.codecs
    samples: int | None = None  # shorthand for base.samples
    out: str = "results/sweep"  # <out>.csv, <out>.parquet, <out>.json
    progress: bool = True


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a mapping like {{key: value}}, got {value!r}")
    return {str(k): v for k, v in value.items()}


def base_overrides(cfg: Config) -> list[str]:
    """The `kvsim sim` overrides shared by every grid point (base + the shorthands)."""
    base = _mapping(cfg.base, "base")
    for key in ("codecs", "samples"):
        value = getattr(cfg, key)
        if value is None:
            continue
        if key in base:
            raise ValueError(f"{key} is given twice (as {key}= and in base); give it once")
        base[key] = list(value) if key == "codecs" else int(value)
    return [f"{key}={hydra_value(value)}" for key, value in base.items()]


def run(cfg: Config) -> list[dict]:
    grid = _mapping(cfg.grid, "grid")
    base = base_overrides(cfg)
    result = run_sweep(grid, base, progress=cfg.progress)
    paths = write_sweep(result, cfg.out, grid, base, asdict(cfg))
    table = result.table
    rows = table.to_dict(orient="records")
    ks = [c for c in ("ttkt_s.32", "ttkt_s.64") if c in table.columns]
    cols = [("point", "point", "d")]
    cols += [(f"{GRID_PREFIX}{k}", k, "") for k in grid]
    cols += [("codec", "codec", ""), ("transfer", "transfer", ""),
             ("context_tokens", "ctx", "d"), ("bandwidth_gbps", "Gbps", "g"),
             ("ttft_s", "TTFT s", ".3f")]
    cols += [(c, f"TT{c.split('.')[1]}T s", ".3f") for c in ks]
    print(f"sweep: {len(result.points)} point(s) x codecs -> {len(table)} rows, "
          f"{len(table.columns)} columns; base overrides {base}")
    print(format_table(rows, cols))
    for what, path in paths.items():
        print(f"wrote {what}: {path}", file=sys.stderr)
    return rows
