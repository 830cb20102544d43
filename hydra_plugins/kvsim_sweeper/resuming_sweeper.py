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
    TABLE_STEM,
    SweepFailed,
    _locked,
    _write_atomic,
    config_fingerprint,
    print_summary,
    read_marker,
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
    """Hydra's basic sweeper (same grid expansion and precedence) that launches only the jobs
    without a finished point in the sweep directory, all in one batch."""

    def sweep(self, arguments: list[str]) -> Any:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.core.utils import JobStatus
        from omegaconf import OmegaConf

        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        # the table writer's libraries, imported before any job: a Ctrl-C that lands inside
        # their first import would leave them half-imported for the final table write
        import pandas  # noqa: F401
        import pyarrow.parquet  # noqa: F401

        started = time.perf_counter()
        params = self._parse_config() + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides(params)
        jobs = [list(job) for job in self.split_arguments(overrides, None)[0]]
        grid: dict[str, list[str]] = {}
        for o in overrides:
            if o.is_sweep_override():
                grid[o.get_key_element()] = list(o.sweep_string_iterator())
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        fingerprint = config_fingerprint()
        with _locked(sweep_dir):
            manifest = {"arguments": list(arguments), "grid": grid, "jobs": jobs,
                        "fingerprint": fingerprint}
            _write_atomic(sweep_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        # done: a marker written under the same conf/ and code; otherwise the job runs, and
        # finds its point itself if its resolved config is unchanged
        markers = [read_marker(sweep_dir, job) for job in jobs]
        missing = [job for job, m in zip(jobs, markers, strict=True)
                   if m is None or m.get("fingerprint") != fingerprint]
        launcher = str(self.config.hydra.launcher.get("_target_", "?")).rsplit(".", 1)[-1]
        print(f"sweep: {len(jobs)} points in {sweep_dir} ({len(jobs) - len(missing)} already "
              f"done, {len(missing)} to run with {launcher})", file=sys.stderr, flush=True)
        results: list[Any] = []
        table = sweep_dir / f"{TABLE_STEM}.parquet"
        try:
            if missing:
                results = list(self.launcher.launch(
                    missing, initial_job_idx=_next_job_number(sweep_dir)))
        finally:  # interrupted too: the table holds every point that finished
            stale = missing or not table.is_file() or \
                table.stat().st_mtime < (sweep_dir / MANIFEST).stat().st_mtime
            if stale:
                with _locked(sweep_dir):
                    write_table(sweep_dir)
        failed = [(" ".join(r.overrides), r._return_value) for r in results
                  if r.status == JobStatus.FAILED]
        done = sum(1 for job in jobs if read_marker(sweep_dir, job) is not None)
        print_summary(table, grid)
        print(f"sweep: {done}/{len(jobs)} points in {table} (+ .csv, .json); "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        if failed:
            lines = "\n".join(f"  {ov}: {str(err).strip().splitlines()[-1] if str(err) else err}"
                              for ov, err in failed)
            raise SweepFailed(f"sweep: {len(failed)} of {len(jobs)} points failed (the "
                              f"table holds the others; rerun to retry them):\n{lines}")
        return [results]
