"""`kvsim sweep` and `kvsim sim -m`: Hydra multiruns, the resuming sweeper, the merged table,
resume after an interruption, launchers (basic, joblib, submitit_local)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from kvsim.cli.main import main
from kvsim.cli.sweep import build_table, point_key
from kvsim.commands.sweep import default_sweep_dir, multirun_arguments

BASE = ["scenario=none", "model=llama-3.1-8b", "codecs=[int8,lynx]", "samples=1",
        "workload.output_tokens=64"]


def _job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit())


def test_point_key_follows_the_resolved_config_not_its_order():
    a = {"link": {"bandwidth_gbps": 10.0, "latency_s": 0.0}, "codecs": ["int8"]}
    b = {"codecs": ["int8"], "link": {"latency_s": 0.0, "bandwidth_gbps": 10.0}}
    assert point_key(a) == point_key(b)
    assert point_key(a) != point_key({**a, "codecs": ["lynx"]})
    assert len(point_key(a)) == 16


def test_table_has_grid_config_and_metric_columns():
    point = {"key": "k1", "overrides": ["link.bandwidth_gbps=25", "hardware=a100"],
             "config": {"link": {"bandwidth_gbps": 25.0}, "hardware": {"name": "a100"}},
             "rows": [{"codec": "int8", "ttkt_s": {"32": 1.5}}, {"codec": "lynx"}]}
    t = build_table([point], {"link.bandwidth_gbps": ["10", "25"], "hardware": ["h100"]})
    assert len(t) == 2
    assert t["grid.link.bandwidth_gbps"].tolist() == [25.0, 25.0]  # the resolved value
    assert t["grid.hardware"].tolist() == ["a100", "a100"]  # a group: the preset's name
    assert t["config.link.bandwidth_gbps"].tolist() == [25.0, 25.0]
    assert t.loc[0, "ttkt_s.32"] == 1.5 and t.loc[0, "point"] == "k1"


def test_sweep_arguments_default_to_joblib_and_a_directory_named_by_the_grid():
    args = multirun_arguments(["link.bandwidth_gbps=10,25", "codecs=[int8]"])
    assert args[:3] == ["--multirun", "hydra/sweeper=kvsim_resume",
                        "hydra/launcher=kvsim_joblib"]
    assert any(a.startswith("hydra.sweep.dir=") for a in args)
    # the same grid in another order finds the same directory (and resumes there)
    assert default_sweep_dir(["a=1", "b=2,3"]) == default_sweep_dir(["b=2,3", "a=1"])
    assert default_sweep_dir(["a=1"]) != default_sweep_dir(["a=2"])
    mine = multirun_arguments(["x=1", "hydra/launcher=basic", "hydra.sweep.dir=/tmp/s"])
    assert "hydra/launcher=kvsim_joblib" not in mine
    assert mine.count("hydra/launcher=basic") == 1
    with pytest.raises(ValueError, match="report="):
        multirun_arguments(["x=1", "report=r.json"])


def test_multirun_over_two_keys_writes_a_run_directory_per_job(tmp_path, capsys):
    sweep_dir = tmp_path / "m"
    rc = main(["sim", "-m", *BASE, "link.bandwidth_gbps=10,40",
               "workload.context_tokens=1024,2048", f"hydra.sweep.dir={sweep_dir}"])
    assert rc == 0
    jobs = _job_dirs(sweep_dir)
    assert len(jobs) == 4
    seen = set()
    for job in jobs:
        report = json.loads((job / "report.json").read_text())
        cfg = report["config"]
        seen.add((cfg["link"]["bandwidth_gbps"], cfg["workload"]["context_tokens"]))
        assert (job / ".hydra" / "config.yaml").is_file()
        assert {r["codec"] for r in report["rows"]} == {"int8", "lynx"}
        assert report["rows"][0]["bandwidth_gbps"] == cfg["link"]["bandwidth_gbps"]
    assert seen == {(10.0, 1024), (10.0, 2048), (40.0, 1024), (40.0, 2048)}


def test_sweep_table_follows_the_grid_and_a_rerun_computes_nothing(tmp_path, capsys):
    sweep_dir = tmp_path / "s"
    args = ["sweep", *BASE, "link.bandwidth_gbps=10,40", "workload.context_tokens=2048,4096",
            "hydra/launcher=basic", f"hydra.sweep.dir={sweep_dir}"]
    assert main(args) == 0
    t = pd.read_parquet(sweep_dir / "sweep.parquet")
    assert len(t) == 4 * 2 and t["point"].nunique() == 4
    for col in ("grid.link.bandwidth_gbps", "grid.workload.context_tokens", "codec",
                "ttft_s", "ttkt_s.32", "breakdown_s.decode", "config.model.name",
                "config.link.bandwidth_gbps", "config.samples"):
        assert col in t.columns, col
    # the simulator ran with the grid's values
    assert (t["bandwidth_gbps"] == t["grid.link.bandwidth_gbps"]).all()
    assert (t["context_tokens"] == t["grid.workload.context_tokens"]).all()
    int8 = t[t["codec"] == "int8"].set_index(["context_tokens", "bandwidth_gbps"])
    assert int8.loc[(4096, 40.0), "ttft_s"] < int8.loc[(4096, 10.0), "ttft_s"]
    ratio = int8.loc[(4096, 10.0), "total_bytes"] / int8.loc[(2048, 10.0), "total_bytes"]
    assert ratio == pytest.approx(2.0, rel=1e-3)
    side = json.loads((sweep_dir / "sweep.json").read_text())
    assert side["command"] == "sweep" and side["rows"] == 8 and side["points_done"] == 4
    assert side["grid"] == {"link.bandwidth_gbps": ["10", "40"],
                            "workload.context_tokens": ["2048", "4096"]}
    assert side["provenance"]["kvsim_version"]
    assert len(_job_dirs(sweep_dir)) == 4
    capsys.readouterr()
    table_files = [sweep_dir / f"sweep.{ext}" for ext in ("parquet", "csv", "json")]
    written = [p.stat().st_mtime_ns for p in table_files]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "4 already done, 0 to run" in out.err
    assert len(_job_dirs(sweep_dir)) == 4  # nothing launched again
    assert [p.stat().st_mtime_ns for p in table_files] == written  # nor the table rewritten
    assert out.out.count("int8") == 4  # the summary, read from the CSV twin
    # a point newer than the table (a parent killed before its final write) makes it stale
    point = next((sweep_dir / "points").glob("*.json"))
    os.utime(point, ns=(written[0] + 10**9, written[0] + 10**9))
    assert main(args) == 0
    assert (sweep_dir / "sweep.parquet").stat().st_mtime_ns > written[0]
    assert len(pd.read_parquet(sweep_dir / "sweep.parquet")) == 8
    # after a change of conf/ or code (another fingerprint) the jobs run again, and each finds
    # its point by its resolved config instead of simulating it again
    for marker in (sweep_dir / "jobs").glob("*.json"):
        doc = json.loads(marker.read_text())
        marker.write_text(json.dumps({**doc, "fingerprint": "other-code"}))
    points_before = sorted(p.name for p in (sweep_dir / "points").iterdir())
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "0 already done, 4 to run" in err and err.count("(reused:") == 4
    assert sorted(p.name for p in (sweep_dir / "points").iterdir()) == points_before
    assert len(pd.read_parquet(sweep_dir / "sweep.parquet")) == 8


def test_interrupted_sweep_resumes_with_only_the_missing_points(tmp_path):
    sweep_dir = tmp_path / "i"
    # six points of ~10 s each (1,500 Poisson requests per codec), one at a time, so that an
    # interrupt sent after the first lands mid-sweep
    args = [sys.executable, "-m", "kvsim", "sweep", "scenario=table1-qwen32b-16k",
            "codecs=[int8,lynx]", "samples=1", "workload=bench-10k", "workload.requests=1500",
            "workload.context_tokens=8192,16384,24576",
            "link.bandwidth_gbps=10,25", "hydra/launcher=basic",
            f"hydra.sweep.dir={sweep_dir}"]

    def interruptible() -> None:  # in the child: SIGINT delivered and handled by Python,
        # whatever this (pytest) process inherited or left blocked or ignored
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ}, text=True, preexec_fn=interruptible)
    deadline = time.monotonic() + 240
    points = sweep_dir / "points"
    while time.monotonic() < deadline and proc.poll() is None:
        if points.is_dir() and len(list(points.glob("*.json"))) >= 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    done_first = len(list(points.glob("*.json")))
    assert 1 <= done_first < 6, f"the interrupt missed the sweep:\n{err[-2000:]}"
    assert (sweep_dir / "sweep.parquet").is_file(), err[-3000:]
    table = pd.read_parquet(sweep_dir / "sweep.parquet")  # the finished points, already merged
    assert table["point"].nunique() == done_first
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=600,
                           env={**os.environ})
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{done_first} already done, {6 - done_first} to run" in rerun.stderr
    assert len(list(points.glob("*.json"))) == 6
    assert pd.read_parquet(sweep_dir / "sweep.parquet")["point"].nunique() == 6


class _InterruptInFinalizer:
    """Ctrl-C landing while the garbage collector runs a finalizer: the KeyboardInterrupt is
    raised there, printed and swallowed by Python."""

    def __del__(self) -> None:
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)


@pytest.fixture
def python_sigint():
    """SIGINT handled by Python's default handler during the test, as in a terminal (a shell
    starts a background job with SIGINT ignored), and put back after it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_a_point_swallowed_stops_the_sweep_at_the_next(tmp_path, monkeypatch,
                                                                   capsys, python_sigint):
    from kvsim.commands import sim

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    run = sim.run

    def swallowing(cfg):
        rows = run(cfg)
        _InterruptInFinalizer()  # collected at once: the point itself finishes
        return rows

    monkeypatch.setattr(sim, "run", swallowing)
    sweep_dir = tmp_path / "s"
    rc = main(["sweep", *BASE, "link.bandwidth_gbps=10,25,50", "hydra/launcher=basic",
               f"hydra.sweep.dir={sweep_dir}"])
    assert rc == 130 and "kvsim: interrupted" in capsys.readouterr().err
    assert len(list((sweep_dir / "points").glob("*.json"))) == 1  # the next two never began
    assert pd.read_parquet(sweep_dir / "sweep.parquet")["point"].nunique() == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # latch removed


def test_scenario_grid_runs_and_a_command_line_key_wins(tmp_path, capsys):
    sweep_dir = tmp_path / "f"
    assert main(["sweep", "scenario=fig11-context", "codecs=[int8]", "samples=1",
                 "hydra/launcher=basic", f"hydra.sweep.dir={sweep_dir}"]) == 0
    t = pd.read_parquet(sweep_dir / "sweep.parquet")
    assert sorted(t["context_tokens"]) == [32768, 65536, 131072]  # the scenario's grid
    one = tmp_path / "g"
    assert main(["sim", "-m", "scenario=fig11-context", "workload.context_tokens=4096",
                 "codecs=[int8]", "samples=1", f"hydra.sweep.dir={one}"]) == 0
    jobs = _job_dirs(one)
    assert len(jobs) == 1  # the command line's value replaced the scenario's three
    report = json.loads((jobs[0] / "report.json").read_text())
    assert report["config"]["workload"]["context_tokens"] == 4096
    # a single run of a scenario that declares a grid says so
    capsys.readouterr()
    assert main(["sim", "scenario=fig11-context", "codecs=[int8]", "samples=1"]) == 0
    assert "add -m to run them all" in capsys.readouterr().err


def test_a_failing_point_is_reported_and_the_others_are_kept(tmp_path, capsys):
    sweep_dir = tmp_path / "bad"
    rc = main(["sweep", *BASE, "link.bandwidth_gbps=10,-1", "hydra/launcher=basic",
               f"hydra.sweep.dir={sweep_dir}"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "1 of 2 points failed" in err and "link.bandwidth_gbps" in err
    assert pd.read_parquet(sweep_dir / "sweep.parquet")["point"].nunique() == 1


def test_joblib_launcher_by_default(tmp_path, capsys):
    sweep_dir = tmp_path / "j"
    assert main(["sweep", *BASE, "link.bandwidth_gbps=10,40",
                 f"hydra.sweep.dir={sweep_dir}"]) == 0
    err = capsys.readouterr().err
    assert "with SharedContextJoblibLauncher" in err  # kvsim_joblib
    assert pd.read_parquet(sweep_dir / "sweep.parquet")["point"].nunique() == 2
    assert not list(sweep_dir.glob(".launch-context-*"))  # the shared context is removed
    # the data files the worker processes loaded reach the sidecar's provenance
    side = json.loads((sweep_dir / "sweep.json").read_text())
    files = {f["path"]: f["sha256"] for f in side["provenance"]["data_files"]}
    timing = [p for p in files if "codec_timing" in p]
    assert timing and all(len(files[p]) == 64 for p in timing)


def test_hydras_own_joblib_launcher_gives_the_same_table(tmp_path):
    tables = []
    for launcher in ("joblib", "kvsim_joblib"):
        sweep_dir = tmp_path / launcher
        assert main(["sweep", *BASE, "link.bandwidth_gbps=10,40", f"hydra/launcher={launcher}",
                     f"hydra.sweep.dir={sweep_dir}"]) == 0
        t = pd.read_parquet(sweep_dir / "sweep.parquet")
        tables.append(t.sort_values(["point", "codec"]).reset_index(drop=True)
                      .filter(regex=r"^(point|codec|ttft_s|ttkt_s\.\d+)$"))
    pd.testing.assert_frame_equal(*tables)


def test_joblib_workers_start_warm_and_the_launcher_reuses_them(tmp_path, capsys,
                                                                monkeypatch):
    from joblib.externals.loky import reusable_executor as loky

    from hydra_plugins.kvsim_sweeper import resuming_sweeper
    from kvsim.cli.sweep import prepare_worker

    assert prepare_worker("kvsim.commands.sim", "prepare") == os.getpid()
    warmed: list[int] = []
    started = resuming_sweeper.start_workers

    def spy(launcher):
        warming = started(launcher)
        assert warming is not None
        monkeypatch.setattr(warming, "wait", lambda w=warming.wait: warmed.extend(w()) or warmed)
        return warming

    monkeypatch.setattr(resuming_sweeper, "start_workers", spy)
    pools_before = loky._next_executor_id
    args = ["sweep", *BASE, "link.bandwidth_gbps=10,40", "hydra.launcher.n_jobs=2",
            f"hydra.sweep.dir={tmp_path / 'w'}"]
    assert main(args) == 0
    # the warm-up ran on the pool of worker processes that then ran the jobs
    assert len(warmed) == 2 and set(warmed) <= set(loky._executor._processes)
    assert loky._next_executor_id - pools_before <= 1
    # a rerun with nothing left to do starts no worker
    monkeypatch.setattr(resuming_sweeper, "start_workers", lambda launcher: pytest.fail(
        "workers started for a finished sweep"))
    assert main(args) == 0
    assert "2 already done, 0 to run" in capsys.readouterr().err


def test_submitit_local_launcher(tmp_path, capsys):
    sweep_dir = tmp_path / "sub"
    assert main(["sweep", *BASE, "link.bandwidth_gbps=10,40", "hydra/launcher=submitit_local",
                 "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep_dir}"]) == 0
    assert "with LocalLauncher" in capsys.readouterr().err
    t = pd.read_parquet(sweep_dir / "sweep.parquet")
    assert sorted(t["bandwidth_gbps"].unique()) == [10.0, 40.0]
