"""kvsim's resuming sweeper, a Hydra plugin (Hydra instantiates plugins only from the
`hydra_plugins` namespace package). What it does and the sweep directory's layout:
kvsim/sweep.py."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore

from kvsim.sweep import (
    MANIFEST,
    POINTS_DIR,
    SweepFailed,
    _locked,
    _write_atomic,
    load_points,
    point_key,
    print_summary,
    write_table,
)

ConfigStore.instance().store(
    group="hydra/sweeper", name="kvsim_resume",
    node={"_target_": "hydra_plugins.kvsim_sweeper.resuming_sweeper.ResumingSweeper",
          "max_batch_size": None, "params": None},
    provider="kvsim")


def _next_job_number(sweep_dir: Path) -> int:
    numbers = [int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(numbers, default=-1) + 1


class ResumingSweeper(BasicSweeper):
    """Hydra's basic sweeper (same grid expansion and precedence) that launches only the
    points whose result is not in the sweep directory yet, all in one batch."""

    def sweep(self, arguments: list[str]) -> Any:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.core.utils import JobStatus
        from omegaconf import OmegaConf, open_dict

        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        # the table writer's libraries, imported before any job: a Ctrl-C that lands inside
        # their first import would leave them half-imported for the final table write
        import pandas  # noqa: F401
        import pyarrow.parquet  # noqa: F401
        params = self._parse_config() + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides(params)
        jobs = self.split_arguments(overrides, None)[0]
        grid: dict[str, list[str]] = {}
        for o in overrides:
            if o.is_sweep_override():
                grid[o.get_key_element()] = list(o.sweep_string_iterator())
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        started = time.perf_counter()
        points: dict[str, list[str]] = {}
        for job in jobs:
            try:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
            except Exception as exc:  # a point that does not compose: name it
                raise SweepFailed(f"sweep point {' '.join(job)} does not compose: "
                                  f"{str(exc).strip()}") from None
            with open_dict(cfg):
                del cfg["hydra"]
            points.setdefault(point_key(OmegaConf.to_container(cfg, resolve=True)), list(job))
        compose_s = time.perf_counter() - started
        with _locked(sweep_dir):
            manifest = {"arguments": list(arguments), "grid": grid,
                        "points": [{"key": k, "overrides": v} for k, v in points.items()]}
            _write_atomic(sweep_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        missing = [(k, v) for k, v in points.items()
                   if not (sweep_dir / POINTS_DIR / f"{k}.json").is_file()]
        launcher = str(self.config.hydra.launcher.get("_target_", "?")).rsplit(".", 1)[-1]
        print(f"sweep: {len(points)} points in {sweep_dir} ({len(points) - len(missing)} "
              f"already done, {len(missing)} to run with {launcher}; configs composed in "
              f"{compose_s:.1f} s)", file=sys.stderr, flush=True)
        results: list[Any] = []
        try:
            if missing:
                results = list(self.launcher.launch(
                    [v for _, v in missing], initial_job_idx=_next_job_number(sweep_dir)))
        finally:  # interrupted too: the table holds every point that finished
            with _locked(sweep_dir):
                paths = write_table(sweep_dir)
        failed = [(" ".join(r.overrides), r._return_value) for r in results
                  if r.status == JobStatus.FAILED]
        done = len(load_points(sweep_dir, list(points)))
        print_summary(paths["parquet"], grid)
        print(f"sweep: {done}/{len(points)} points in {paths['parquet']} (+ .csv, .json); "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        if failed:
            lines = "\n".join(f"  {ov}: {str(err).strip().splitlines()[-1] if str(err) else err}"
                              for ov, err in failed)
            raise SweepFailed(f"sweep: {len(failed)} of {len(points)} points failed (the "
                              f"table holds the others; rerun to retry them):\n{lines}")
        return [results]
