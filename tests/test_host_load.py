"""kvsim.core.host_load: the CPU time other work took on this host over an interval, and how
a validation reports it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvsim.core import host_load
from kvsim.core.host_load import HostLoad, HostLoadMeter
from kvsim.fidelity.validation import (
    SHARED_HOST_BACKGROUND_CORES,
    _host_before,
    _host_load_line,
    _host_load_summary,
    _profile_background,
)

_TICK_S = 0.01  # a /proc/stat written here counts in ticks of this length (SC_CLK_TCK 100)


def _stat(path: Path, user: int, system: int, idle: int, steal: int, cpus: int = 2) -> None:
    # fields: user nice system idle iowait irq softirq steal guest guest_nice
    lines = [f"cpu  {user} 0 {system} {idle} 0 50 70 {steal} 0 0"]
    lines += [f"cpu{i} 1 0 1 1 0 0 0 0 0 0" for i in range(cpus)]
    path.write_text("\n".join(lines + ["intr 1 2", "ctxt 5"]) + "\n")


def test_background_is_the_hosts_busy_time_less_this_process_trees(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    clock, own = [100.0], [3.0]
    monkeypatch.setattr(host_load.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(host_load, "_own_cpu_s", lambda: own[0])
    monkeypatch.setattr(host_load.os, "sysconf", lambda name: int(1 / _TICK_S))
    _stat(stat, user=1000, system=200, idle=5000, steal=10, cpus=2)
    meter = HostLoadMeter(stat)
    assert meter.available
    # 10 s later: 1500 ticks busy (15 CPU-s; interrupt time is not counted), this tree 6 of
    # them, 50 ticks stolen
    clock[0], own[0] = 110.0, 9.0
    _stat(stat, user=2200, system=500, idle=5500, steal=60, cpus=2)
    load = meter.read()
    assert load == HostLoad(wall_s=10.0, cpus=2, busy_cpu_s=pytest.approx(15.0),
                            own_cpu_s=6.0, steal_cpu_s=pytest.approx(0.5))
    assert load.background_cores == pytest.approx(0.9)
    assert load.own_cores == pytest.approx(0.6) and load.steal_cores == pytest.approx(0.05)
    assert load.as_dict() == {"wall_s": 10.0, "cpus": 2, "background_cores": 0.9,
                              "own_cores": 0.6, "steal_cores": 0.05}
    assert "0.90 of 2 CPUs busy with other work" in load.describe()
    # ticks round: own a little above busy is no negative neighbour
    own[0] = 30.0
    assert meter.read().background_cores == 0.0


def test_no_proc_stat_no_reading(tmp_path):
    meter = HostLoadMeter(tmp_path / "missing")
    assert not meter.available and meter.read() is None
    (tmp_path / "garbled").write_text("cpu  a b c d\n")
    assert HostLoadMeter(tmp_path / "garbled").read() is None


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="no /proc/stat (not Linux)")
def test_a_running_descendant_is_this_trees_own_before_and_after_it_is_reaped():
    """A busy grandchild (a child's child: a kept decode host under `ip netns exec` is such
    a tree) counts as this tree's own while it runs (/proc) and once its parent is reaped
    (os.times), with nothing lost between: no interval reads a kept child as a neighbour."""
    meter = HostLoadMeter()
    spin = "import time\nend = time.time() + 1.2\nwhile time.time() < end: pass"
    parent = ("import subprocess, sys\n"
              f"subprocess.run([sys.executable, '-c', {spin!r}], check=True)")
    child = subprocess.Popen([sys.executable, "-c", parent])
    try:
        time.sleep(0.9)
        running = meter.read()
    finally:
        child.wait(timeout=30)
    reaped = meter.read()
    # the grandchild kept one CPU busy for ~0.8 s of the first interval: this tree's own
    assert running.own_cpu_s > 0.6
    # ... and still once reaped: its whole ~1.2 CPU-s (plus two interpreters' start)
    assert reaped.own_cpu_s - running.own_cpu_s > 0.2
    assert reaped.own_cpu_s > 1.1


def test_a_validation_says_whether_its_host_was_shared():
    quiet = {"background_cores": 0.03, "cpus": 2, "wall_s": 60.0, "own_cores": 1.1,
             "steal_cores": 0.0}
    busy = {**quiet, "background_cores": 0.97}
    rows = [{"background_cores": 0.02}, {"background_cores": 0.05}, {"metric": "ttft"}]
    s = _host_load_summary({"calibration": quiet, "comparisons": quiet}, rows)
    assert s["measured"] and not s["shared"] and s["max_scenario_background_cores"] == 0.05
    line = _host_load_line(s)
    assert "0.03 of 2 CPUs during the calibration" in line and "a quiet host" in line
    # one scenario beside a neighbour is enough to say so
    s = _host_load_summary({"comparisons": quiet},
                           rows + [{"background_cores": SHARED_HOST_BACKGROUND_CORES + 0.5}])
    assert s["shared"] and "a shared host" in _host_load_line(s)
    s = _host_load_summary({"calibration": busy, "comparisons": quiet}, rows)
    assert s["shared"]
    # nothing readable, or a run saved before the host was measured
    nothing = _host_load_summary({"comparisons": None}, [{"metric": "ttft"}])
    assert not nothing["measured"] and not nothing["shared"]
    assert _host_load_line(nothing) == "host: other work beside this run not measured"
    assert _host_load_line(None, "the measured run") == \
        "host: other work beside the measured run not measured"


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="no /proc/stat (not Linux)")
def test_the_host_is_watched_idle_before_a_validation(capsys):
    assert _host_before(0.0) is None  # host_check_s=0: no look
    before = _host_before(0.3)
    assert before["wall_s"] == pytest.approx(0.3, abs=0.2) and before["own_cores"] < 0.5
    assert "CPUs busy with other work" in capsys.readouterr().err


def test_a_validation_on_a_saved_profile_says_what_ran_beside_its_calibration(tmp_path):
    recorded = {"background_cores": 0.6, "cpus": 2, "wall_s": 300.0, "own_cores": 1.0,
                "steal_cores": 0.0}
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"host": {"cpu_model": "x", "background": recorded}}))
    assert _profile_background(hw) == recorded
    s = _host_load_summary({"profile": recorded, "comparisons": {**recorded,
                                                                 "background_cores": 0.0}}, [])
    assert s["shared"]  # a busy calibration makes the figures a busy host's too
    assert "0.60 of 2 CPUs while its profile was calibrated" in _host_load_line(s)
    # a profile from before it was recorded, or none readable: nothing said
    hw.write_text(json.dumps({"host": {"cpu_model": "x"}}))
    assert _profile_background(hw) is None
    hw.write_text(json.dumps({"host": "an older host name"}))
    assert _profile_background(hw) is None
    assert _profile_background(tmp_path / "missing.json") is None
