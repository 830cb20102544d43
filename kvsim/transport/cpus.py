"""Which CPUs the two ends of an emulated transfer run on.

On one host, `kvsim emulate` runs the prefill side (the sender: prefill, encoder, link loop)
and the decode side (`kvsim serve`: receiver, on-arrival worker, decode loop) as two
processes that share the machine's cores. A disaggregated deployment gives each side its
own. With `transport.split_cpus=true` emulate gives the sender the first half of this
process's CPUs and the decode host the rest (on a 2-CPU host: one each), so that neither
side's work slows the other's by taking its core: the sender's encode no longer lands on the
core a decode step runs on when the link is fast and both are busy at once.

`pin(cpus)` moves every thread of this process (the interpreter's, and pools that already
exist: numba's, torch's, ZeroMQ's) onto the set and returns the set it had, so that emulate
can pin its in-process sender for one transfer and put it back afterwards. Linux only
(sched_setaffinity over /proc/self/task); elsewhere split_cpus is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def available() -> bool:
    """Whether this platform can pin threads (Linux: sched_setaffinity, /proc/self/task)."""
    return hasattr(os, "sched_setaffinity") and Path("/proc/self/task").is_dir()


def parse_cpus(text: str) -> set[int]:
    """A CPU list as `taskset -c` writes it ("0-3,6", "1") -> {0, 1, 2, 3, 6}; "" -> {}."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            if dash and not hi:  # "1-": a range without its end
                raise ValueError
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or a range "
                             "(e.g. 0-3,6)") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpus(cpus: set[int]) -> str:
    """{0, 1, 2, 3, 6} -> "0-3,6" (parse_cpus' inverse)."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        elif out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def halves() -> tuple[set[int], set[int]]:
    """(the sender's CPUs, the decode host's): this process's CPUs split in two, the first
    half (rounded down) to the sender. Raises where there are fewer than two or the
    platform cannot pin."""
    if not available():
        raise ValueError("transport.split_cpus=true needs Linux (sched_setaffinity)")
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        raise ValueError(f"transport.split_cpus=true needs at least 2 CPUs, this process "
                         f"has {len(mine)} ({format_cpus(set(mine))})")
    cut = len(mine) // 2
    return set(mine[:cut]), set(mine[cut:])


def pin(cpus: set[int]) -> set[int]:
    """Every thread of this process onto `cpus`; returns the CPUs the calling thread had (to
    pin back to). Threads started later inherit their creator's set."""
    if not cpus:
        raise ValueError("pin: an empty CPU set")
    before = os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return before


def pin_listed(text: str) -> None:
    """`pin` to a CPU list as transport.cpus writes it; "" leaves this process as it is."""
    if text:
        pin(parse_cpus(text))


@contextlib.contextmanager
def pinned(text: str) -> Iterator[None]:
    """Every thread of this process on the CPU list `text` while the block runs, then back
    on the set it had ("": nothing changes)."""
    if not text:
        yield
        return
    before = os.sched_getaffinity(0)  # taken first: a pin that fails half-way is undone too
    try:
        pin(parse_cpus(text))
        yield
    finally:
        pin(before)
