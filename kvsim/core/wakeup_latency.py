"""Hold this host's idle CPUs to a wake-up latency while a transfer is timed (Linux PM QoS).

An idle CPU of a virtual machine halts, and its host may then run the physical core slower
or let it sleep deeper; a decode step that starts after the receiver waited about a second
for its last bytes runs slower for its first tens of ms. Measured here (a 2-vCPU KVM guest,
haltpoll idle driver, SmolLM2-135M at 1,536 tokens, one torch thread): a step on a fresh
cache after 1 s asleep took 20-25 ms more than the later steps (median of 5), after 1 s of
busy-waiting 5 ms, after 0.3 s asleep 4 ms; `kvsim emulate` at 0.3 Gbps (token bucket, int8
and int4, 1,536 tokens, 8 requests each way, interleaved) had its first steps 14.0 ms
(median) over their later ones left alone, and 2.1 ms with the CPUs held to wake at once.
A disaggregated decode node in service does not sit idle between its requests' bytes, so the
emulator holds the CPUs awake while it times them, as latency benchmarks do
(`transport.cpu_wakeup_us`, -1: leave them).

Linux PM QoS: a process that keeps /dev/cpu_dma_latency open with a 32-bit latency (us)
written to it keeps every CPU out of idle states that take longer to leave; the request
ends when the file is closed, whatever ends the process. Opening it needs root; elsewhere
(another OS, an unprivileged user) the hold is not taken, and `WakeupHold` says why.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PM_QOS_PATH = Path("/dev/cpu_dma_latency")
LEAVE = -1  # cpu_wakeup_us: do not request anything
MAX_US = 2**31 - 1  # the kernel reads a signed 32-bit int


@dataclass(frozen=True)
class WakeupHold:
    """What `held_wakeup_latency` got for the latency it was asked (requested_us; LEAVE:
    nothing): held_us, the latency (us) every CPU is held to while it lasts, or None with
    `why` it is not held."""

    requested_us: int
    held_us: int | None
    why: str = ""


@contextmanager
def held_wakeup_latency(latency_us: int, path: Path = PM_QOS_PATH) -> Iterator[WakeupHold]:
    """Hold every CPU of this host to wake within `latency_us` (0: at once) while the block
    runs; LEAVE (-1) requests nothing. Never raises for a hold it cannot take: the block
    runs anyway, told why (the caller reports it)."""
    if latency_us == LEAVE:
        yield WakeupHold(LEAVE, None, "not requested (cpu_wakeup_us=-1)")
        return
    if not 0 <= latency_us <= MAX_US:
        raise ValueError(f"a wake-up latency is 0..{MAX_US} us (or -1: leave it), got "
                         f"{latency_us}")
    why = ""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:
        fd, why = -1, f"{path}: {exc.strerror or exc}"
    if fd < 0:
        # yielded outside the handler, so that the block's own errors do not carry this one
        yield WakeupHold(latency_us, None, why)
        return
    try:
        try:
            os.write(fd, struct.pack("=i", latency_us))  # native 32-bit int, as the kernel reads
        except OSError as exc:
            hold = WakeupHold(latency_us, None, f"{path}: {exc.strerror or exc}")
        else:
            hold = WakeupHold(latency_us, latency_us)
        yield hold
    finally:
        os.close(fd)  # the request ends with the file


_reported: set[str] = set()


def report_unheld(who: str, hold: WakeupHold) -> None:
    """One line on stderr, once per process and `who`, where a requested hold was not taken
    (a validation's sender runs once per scenario)."""
    if hold.held_us is not None or hold.requested_us == LEAVE or who in _reported:
        return
    _reported.add(who)
    print(f"{who}: CPUs not held awake ({hold.why}; transport.cpu_wakeup_us=-1 leaves "
          "them): a decode step after an idle wait may run slower", file=sys.stderr)
