"""What else ran on this host while a measurement did: the CPU time spent outside this
process and its children over an interval, in CPUs kept busy (`background_cores`).

A figure measured beside a neighbour holds for a host that busy, not for a quiet one; a
validation reports the background of its calibration and of each scenario so that its
figures carry the condition they were measured under.

Host time (Linux /proc/stat, the aggregate `cpu` line, in USER_HZ ticks, over every CPU
it lists): busy = user +
nice + system (guest time is inside user); steal (time the hypervisor gave to other guests)
apart. Interrupt and softirq time is left out of both sides: the kernel charges it to no
process, so this tree's own packets (the loopback, a veth pair) would otherwise count as a
neighbour. Own time: this process's threads and its children that have been waited for,
theirs included (os.times), plus what its descendants still running have used so far
(/proc/<pid>/stat: their time and that of the children they waited for), so that a child
kept over several intervals (a decode host serving one scenario after another) counts as
this tree's in each; it moves from the second sum to the first when it is reaped, whole.
background_cores = (busy - own) / wall: 1.0 is
a neighbour keeping one CPU busy for the whole interval. Where /proc/stat is missing (not
Linux) there is no reading (HostLoadMeter.available is False, read() returns None).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

_PROC_STAT = Path("/proc/stat")
_USER, _NICE, _SYSTEM, _STEAL = 0, 1, 2, 7  # fields of the cpu line after its label


@dataclass(frozen=True)
class HostLoad:
    """One interval's CPU time: its wall time (s), the host's CPUs, the host's busy and
    steal time and this process tree's own (CPU-s)."""

    wall_s: float
    cpus: int
    busy_cpu_s: float
    own_cpu_s: float
    steal_cpu_s: float

    @property
    def background_cores(self) -> float:
        """CPUs kept busy by work other than this process tree, on average (>= 0; tick
        rounding can make busy a little less than own)."""
        return max(0.0, self.busy_cpu_s - self.own_cpu_s) / self.wall_s if self.wall_s > 0 \
            else 0.0

    @property
    def own_cores(self) -> float:
        return self.own_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steal_cores(self) -> float:
        return self.steal_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"wall_s": round(self.wall_s, 3), "cpus": self.cpus,
                "background_cores": round(self.background_cores, 3),
                "own_cores": round(self.own_cores, 3),
                "steal_cores": round(self.steal_cores, 3)}

    def describe(self) -> str:
        return (f"{self.background_cores:.2f} of {self.cpus} CPUs busy with other work "
                f"(this run {self.own_cores:.2f}, stolen {self.steal_cores:.2f}) over "
                f"{self.wall_s:.0f} s")


def _host_ticks(stat: Path) -> tuple[int, int, int] | None:
    """(busy, steal) ticks since boot from the aggregate cpu line and the number of CPUs
    (the cpuN lines), or None where unreadable."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    line = lines[0].split() if lines else []
    if len(line) < 4 or line[0] != "cpu":
        return None
    try:
        values = [int(v) for v in line[1:]]
    except ValueError:
        return None
    steal = values[_STEAL] if len(values) > _STEAL else 0
    cpus = sum(1 for t in lines[1:] if t.startswith("cpu") and t[3:4].isdigit())
    return values[_USER] + values[_NICE] + values[_SYSTEM], steal, max(cpus, 1)


_PROC = Path("/proc")


def _own_cpu_s(proc: Path = _PROC) -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + \
        _running_descendants_cpu_s(proc)


def _running_descendants_cpu_s(proc: Path = _PROC) -> float:
    """CPU-s used so far by this process's descendants that have not been reaped (each one's
    utime + stime + cutime + cstime: its own threads and the children it waited for); 0
    where /proc cannot be read."""
    parent_of: dict[int, int] = {}
    ticks_of: dict[int, int] = {}
    try:
        entries = [e for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return 0.0
    for entry in entries:
        try:
            text = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        # pid (comm) state ppid ... : comm may hold spaces and parentheses; fields after the
        # last ')' are state, ppid, ..., utime (14th field), stime, cutime, cstime
        fields = text[text.rfind(")") + 2:].split()
        try:
            pid = int(entry.name)
            parent_of[pid] = int(fields[1])
            ticks_of[pid] = sum(int(f) for f in fields[11:15])
        except (IndexError, ValueError):
            continue
    me = os.getpid()
    children_of: dict[int, list[int]] = {}
    for pid, parent in parent_of.items():
        children_of.setdefault(parent, []).append(pid)
    total, todo = 0, list(children_of.get(me, []))
    while todo:
        pid = todo.pop()
        total += ticks_of[pid]
        todo += children_of.get(pid, [])
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
    return total * tick_s


class HostLoadMeter:
    """Starts when made; read() is the HostLoad from then to now (None where the host's
    times cannot be read). `stat` is /proc/stat's path (tests give another)."""

    def __init__(self, stat: Path = _PROC_STAT) -> None:
        self._stat = stat
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        self._start = (time.monotonic(), _host_ticks(stat), _own_cpu_s())

    @property
    def available(self) -> bool:
        return self._start[1] is not None

    def read(self) -> HostLoad | None:
        wall0, ticks0, own0 = self._start
        ticks = _host_ticks(self._stat)
        if ticks0 is None or ticks is None:
            return None
        return HostLoad(wall_s=time.monotonic() - wall0, cpus=ticks[2],
                        busy_cpu_s=(ticks[0] - ticks0[0]) * self._tick_s,
                        own_cpu_s=_own_cpu_s() - own0,
                        steal_cpu_s=(ticks[1] - ticks0[1]) * self._tick_s)
