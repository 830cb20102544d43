"""The batch level: how long the emulator's real batched decode steps took against the
profile's step for the same number of members (`kvsim validate multi.decode=real`).

With the real model's decode the multi-request case's emulator steps one forward over every
member per step (kvsim.transport.model_batch), and the simulator takes that step from the
hardware profile (`tpot_batch`, its ratio to a lone step at each batch size). Each request's
row keeps its tokens' times and its decode spans, so the interval between two consecutive
tokens of a request is one step of the batch it was in (with whatever came between two
steps: a rebuild of the batched cache when a member joins or leaves), and the requests
decoding at the interval's middle are that batch's members. The level at B members is the
mean of those intervals (a TPOT is a mean) over the profile's step of B members at the
case's mid-decode context: 1.0 is the profile's pace. It names where the case's TPOT error
comes from; the verdict does not use it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from kvsim.core.report import finite_number

MIN_STEPS = 10  # intervals a batch size needs for its median to be reported
# spans in which a request is a member of its decode instance's batch (drafting on the
# anchor, verifying, decoding)
MEMBER_SPANS = ("draft_accepted", "verify", "decode")


def _member_span(row: dict) -> tuple[float, float] | None:
    """(first batch step's start, decode end) of a request row (epoch s), from its trace."""
    spans = [s for s in row.get("trace_spans") or []
             if isinstance(s, list) and len(s) == 4 and s[0] in MEMBER_SPANS]
    ends = [float(s[3]) for s in spans if s[0] == "decode"]
    if not spans or not ends:
        return None
    return min(float(s[2]) for s in spans), max(ends)


def _token_times(row: dict) -> list[float]:
    """A request row's committed tokens' times (epoch s): its arrival (its prefill's start
    less its wait for the prefill instance) + committed_from_arrival_s."""
    prefill = [s for s in row.get("trace_spans") or [] if isinstance(s, list) and
               len(s) == 4 and s[0] == "prefill"]
    wait = finite_number(row.get("prefill_wait_s"))
    times = row.get("committed_from_arrival_s")
    if not prefill or wait is None or not isinstance(times, list):
        return []
    arrival = float(prefill[0][2]) - wait
    return [arrival + float(t) for t in times if finite_number(t) is not None]


def member_intervals(requests: list[dict]) -> dict[int, list[float]]:
    """{members decoding: [s between two consecutive tokens of one request]} over one
    scenario's emulated request rows (a row's `per_request`). A request's first interval
    (the first step on a fresh cache) and the tokens a verification commits together are
    left out."""
    spans = [_member_span(r) for r in requests]
    live = [s for s in spans if s is not None]
    out: dict[int, list[float]] = {}
    for row, span in zip(requests, spans, strict=True):
        if span is None:
            continue
        times = [t for t in _token_times(row) if t >= span[0]]
        for a, b in zip(times[1:], times[2:], strict=False):
            if b <= a:
                continue
            middle = (a + b) / 2
            members = sum(1 for lo, hi in live if lo <= middle <= hi)
            if members:
                out.setdefault(members, []).append(b - a)
    return out


@dataclass
class BatchLevel:
    """The emulator's batched steps by members against the profile's (sizes with at least
    MIN_STEPS intervals)."""

    members: list[int]
    steps: list[int]  # intervals measured at each
    measured_s: list[float]  # their mean
    median_s: list[float]  # their median
    simulated_s: list[float]  # the profile's step of that many members

    @property
    def levels(self) -> list[float]:
        return [m / s for m, s in zip(self.measured_s, self.simulated_s, strict=True)]

    def words(self) -> str:
        parts = [f"{b}: {m * 1e3:.0f} ms vs {s * 1e3:.0f} (x {m / s:.2f}, {n} steps)"
                 for b, n, m, s in zip(self.members, self.steps, self.measured_s,
                                       self.simulated_s, strict=True)]
        return ("multi-request real decode: the emulator's batched steps (the mean interval "
                "between a request's tokens, by members decoding) against the profile's "
                "step of as many members: " + "; ".join(parts))

    def as_dict(self) -> dict:
        return {"members": self.members, "steps": self.steps, "measured_s": self.measured_s,
                "median_s": self.median_s, "simulated_s": self.simulated_s,
                "level": self.levels}


def batch_level(intervals: dict[int, list[float]], simulated_step_s: Callable[[int], float]
                ) -> BatchLevel | None:
    """The level of pooled member_intervals (every load's and codec's) against
    simulated_step_s(members) (the profile's step, s); None where no size has MIN_STEPS
    intervals."""
    sizes = sorted(b for b, v in intervals.items() if len(v) >= MIN_STEPS)
    if not sizes:
        return None
    simulated = [float(simulated_step_s(b)) for b in sizes]
    if not all(math.isfinite(s) and s > 0 for s in simulated):
        raise ValueError(f"the profile's batched steps must be > 0 s, got {simulated}")
    return BatchLevel(sizes, [len(intervals[b]) for b in sizes],
                      [float(statistics.fmean(intervals[b])) for b in sizes],
                      [float(statistics.median(intervals[b])) for b in sizes], simulated)
