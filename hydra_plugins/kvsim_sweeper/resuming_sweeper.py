"""kvsim's resuming sweeper, a Hydra plugin (Hydra instantiates plugins only from the
`hydra_plugins` namespace package). What it does and the sweep directory's layout:
kvsim/cli/sweep.py."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore

from hydra_plugins.kvsim_sweeper.shared_context_launcher import parallel_kwargs
from kvsim.cli.sweep import (
    MANIFEST,
    TABLE_STEM,
    SweepFailed,
    _locked,
    _write_atomic,
    config_fingerprint,
    interrupt_latch,
    newest_input_mtime,
    prepare_worker,
    print_summary,
    read_marker,
    write_table,
)

ConfigStore.instance().store(
    group="hydra/sweeper", name="kvsim_resume",
    node={"_target_": "hydra_plugins.kvsim_sweeper.resuming_sweeper.ResumingSweeper",
          "max_batch_size": None, "params": None},
    provider="kvsim")


class _Warming:
    """Warm-up tasks running on the joblib launcher's worker processes; `wait()` before the
    launcher's own Parallel call (dropping them unfinished would make joblib kill the workers)."""

    def __init__(self, outputs: Any) -> None:
        self._outputs = outputs

    def wait(self) -> list[int]:
        """The warmed workers' process ids (none if the warm-up failed)."""
        try:
            return list(self._outputs)
        except Exception as exc:  # a warm-up failure is no job's failure: jobs import again
            print(f"sweep: warming the workers failed ({exc}); the jobs start them",
                  file=sys.stderr, flush=True)
            return []


def start_workers(launcher: Any) -> _Warming | None:
    """Start the joblib launcher's worker processes now, each loading what a job loads first
    (Hydra's plugins, the command, its simulator and codecs: seconds per process), while this
    process writes the manifest and imports the table writer. The launcher's Parallel, made
    with the same arguments, reuses them (loky's reusable executor). Other launchers, or a
    task that is not kvsim's: nothing."""
    what = getattr(launcher.task_function, "prepare", None)
    joblib_cfg = getattr(launcher, "joblib", None)  # Hydra's joblib launcher, kvsim_joblib
    if joblib_cfg is None or what is None:
        return None
    from joblib import Parallel, delayed, effective_n_jobs

    joblib_cfg = parallel_kwargs(joblib_cfg)
    workers = effective_n_jobs(joblib_cfg.get("n_jobs", -1))
    outputs = Parallel(**joblib_cfg, return_as="generator_unordered")(
        delayed(prepare_worker)(*what) for _ in range(workers))
    return _Warming(outputs)


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
        fingerprint = config_fingerprint()
        # done: a marker written under the same conf/ and code; otherwise the job runs, and
        # finds its point itself if its resolved config is unchanged
        markers = [read_marker(sweep_dir, job) for job in jobs]
        missing = [job for job, m in zip(jobs, markers, strict=True)
                   if m is None or m.get("fingerprint") != fingerprint]
        warming = start_workers(self.launcher) if missing else None
        if missing:
            # the table writer's libraries, imported before any job: a Ctrl-C that lands
            # inside their first import would leave them half-imported for the final write
            import pandas  # noqa: F401
            import pyarrow.parquet  # noqa: F401

        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        with _locked(sweep_dir):
            manifest = {"arguments": list(arguments), "grid": grid, "jobs": jobs,
                        "fingerprint": fingerprint}
            text = json.dumps(manifest, indent=1) + "\n"
            path = sweep_dir / MANIFEST
            if not path.is_file() or path.read_text() != text:  # a rerun keeps its mtime
                _write_atomic(path, text)
        launcher = str(self.config.hydra.launcher.get("_target_", "?")).rsplit(".", 1)[-1]
        print(f"sweep: {len(jobs)} points in {sweep_dir} ({len(jobs) - len(missing)} already "
              f"done, {len(missing)} to run with {launcher})", file=sys.stderr, flush=True)
        results: list[Any] = []
        table = sweep_dir / f"{TABLE_STEM}.parquet"
        try:
            if missing:
                if warming is not None:
                    warming.wait()
                with interrupt_latch():
                    results = list(self.launcher.launch(
                        missing, initial_job_idx=_next_job_number(sweep_dir)))
        finally:  # interrupted too: the table holds every point that finished
            stale = missing or not table.is_file() or \
                table.stat().st_mtime < newest_input_mtime(sweep_dir)
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
