"""Run `kvsim sim` over a grid, resumably, in parallel, into one tidy table.

    kvsim sweep link.bandwidth_gbps=10,25,50 workload.context_tokens=32768,65536 \\
        'codecs=[int8,lynx]' samples=8
    kvsim sweep scenario=fig11-context                  (the grid the scenario declares)
    kvsim sweep ... hydra/launcher=submitit_slurm hydra.launcher.partition=gpu   (a cluster)

A convenience over `kvsim sim -m`: the same overrides (comma-separated values are the grid
axes; a scenario's `hydra.sweeper.params` add axes, a key on the command line wins), run
with kvsim's joblib launcher on every core by default (`kvsim_joblib`: Hydra's joblib launcher
sending the context every job shares once per worker, hydra_plugins/kvsim_sweeper;
`hydra/launcher=joblib` is Hydra's own, `hydra/launcher=basic` runs them one by one in this
process; submitit_local, submitit_slurm and ray are Hydra's other launchers). Every
finished point is kept as points/<hash of its resolved config>.json in the sweep directory,
and the merged table (sweep.parquet, sweep.csv, sidecar sweep.json: one row per point, codec
and transfer policy, every resolved config value as a `config.*` column and every metric) is
rewritten as points finish. Rerunning the same command resumes: only points without a result
run. The sweep directory is multirun/sweep-<hash of the arguments> under $KVSIM_OUTPUT_ROOT
(default: the current directory); hydra.sweep.dir=DIR names another."""

from __future__ import annotations

import hashlib

COMMAND = ("sweep",)
HELP = "`kvsim sim` over a grid (key=a,b ...), resumable and parallel -> tidy Parquet/CSV table"
CONFIG_NAME = "sim"
MULTIRUN_OF = ("sim",)

_SWEEP_FLAGS = ("-m", "--multirun")


def default_sweep_dir(arguments: list[str]) -> str:
    """multirun/sweep-<10 hex digits of the sorted arguments> under $KVSIM_OUTPUT_ROOT: the
    same command finds the same directory again (and resumes there)."""
    plain = sorted(a for a in arguments if not a.startswith(("hydra.", "hydra/", "-")))
    digest = hashlib.sha256("\n".join(plain).encode()).hexdigest()[:10]
    return "${oc.env:KVSIM_OUTPUT_ROOT,.}/multirun/sweep-" + digest


def multirun_arguments(arguments: list[str]) -> list[str]:
    """The `kvsim sim` command line of this sweep: -m, the resuming sweeper, kvsim's joblib
    launcher and the sweep directory, unless the arguments name their own."""
    if any(a.startswith("report=") for a in arguments):
        raise ValueError("report= names one file, but a sweep runs many jobs: the merged "
                         "table is <sweep dir>/sweep.parquet (and each job's report.json)")
    if any(a.startswith(("hydra/sweeper=", "hydra.sweeper._target_")) for a in arguments):
        raise ValueError("kvsim sweep uses its own resuming sweeper; for another Hydra "
                         "sweeper run `kvsim sim -m hydra/sweeper=...`")
    if any(a in ("--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")
           for a in arguments):
        raise ValueError("--cfg / --info / --shell-completion: ask `kvsim sim` directly")
    given = {a.split("=", 1)[0] for a in arguments}
    out = ["--multirun", "hydra/sweeper=kvsim_resume"]
    if "hydra/launcher" not in given:
        out.append("hydra/launcher=kvsim_joblib")
    if "hydra.sweep.dir" not in given:
        out.append(f"hydra.sweep.dir='{default_sweep_dir(arguments)}'")
    return out + [a for a in arguments if a not in _SWEEP_FLAGS]
