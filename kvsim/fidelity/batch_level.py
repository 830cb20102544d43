"""The batch level: how long the emulator's real batched decode steps took against the
profile's step for the same number of members (`kvsim validate multi.decode=real`).

With the real model's decode the multi-request case's emulator steps one forward over every
member per step (kvsim.transport.model_batch), and the simulator takes that step from the
hardware profile (`tpot_batch`, its ratio to a lone step at each batch size). Each request's
row keeps its tokens' times and its decode spans, so the interval between two consecutive
tokens of a request is one step of the batch it was in (with whatever came between two
steps: a rebuild of the batched cache when a member joins or leaves), and the requests in one
of their batch spans (drafting, verifying, decoding) at the interval's middle are that
batch's members. The level at B members is the mean of those intervals (a TPOT is a mean)
over the profile's step of B members at the case's mid-decode context: 1.0 is the profile's
pace. It names where the case's TPOT error comes from; the verdict does not use it.

The emulator runs both sides on one host, so each interval is also told by what else ran
there, from every request's trace spans (classified_intervals): `receiving` where a
transfer or a dequantization of any request overlaps it (the decode host taking in and
dequantizing another request's cache beside the step), else `prefill` where a prefill runs
at its middle (the sender prefilling the next request), else `quiet`. Each size's mean per
class is kept beside the pooled one with its ratio to the quiet steps of as many members;
the prefill class's ratio is what the profile's slowdown beside a prefill
(`tpot_beside_prefill`, workload.colocated_prefill) is set against.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsim.core.report import finite_number

MIN_INTERVALS = 10  # intervals a batch size needs to be reported
# what else ran on the host during an interval (see the module docstring), in report order
SURROUNDINGS = ("quiet", "prefill", "receiving")
# spans of any request that are the host's work beside a decode step: taking a cache in ...
RECEIVING_SPANS = ("transfer", "dequantize")  # (name prefixes: "transfer full", ...)
# spans in which a request is a member of its decode instance's batch (drafting on the
# anchor, its rejected drafts, verifying, decoding)
MEMBER_SPANS = ("draft_accepted", "draft_rejected", "verify", "decode")


def _spans(row: dict, names: tuple[str, ...], prefix: bool = False
           ) -> list[tuple[float, float]]:
    """[(start, end)] (epoch s) of a request row's trace spans named one of `names` (with
    prefix: whose name starts with one of them, as "transfer" names "transfer full")."""
    return [(float(s[2]), float(s[3])) for s in row.get("trace_spans") or []
            if isinstance(s, list) and len(s) == 4 and isinstance(s[0], str)
            and (s[0].startswith(names) if prefix else s[0] in names)]


def _token_times(row: dict) -> list[float]:
    """A request row's committed tokens' times (epoch s), tokens committed together once:
    its arrival (its prefill's start less its wait for the prefill instance) +
    committed_from_arrival_s."""
    prefill = _spans(row, ("prefill",))
    wait = finite_number(row.get("prefill_wait_s"))
    times = row.get("committed_from_arrival_s")
    if not prefill or wait is None or not isinstance(times, list):
        return []
    arrival = prefill[0][0] - wait
    return sorted({arrival + float(t) for t in times if finite_number(t) is not None})


def classified_intervals(requests: list[dict]) -> list[tuple[int, str, float]]:
    """[(members, surroundings, s between two consecutive tokens of one request)] over one
    scenario's emulated request rows (a row's `per_request`): every interval between two
    of a request's distinct token times from its first batch span on, counted at the
    number of requests in a batch span at its middle, and told by what else ran on the
    host (one of SURROUNDINGS, see the module docstring). Raises (KeyError, TypeError,
    ValueError) on a malformed trace span."""
    spans = [_spans(r, MEMBER_SPANS) for r in requests]
    prefills = [s for r in requests for s in _spans(r, ("prefill",))]
    receiving = [s for r in requests for s in _spans(r, RECEIVING_SPANS, prefix=True)]
    out: list[tuple[int, str, float]] = []
    for row, own in zip(requests, spans, strict=True):
        if not own:
            continue
        start = min(lo for lo, _ in own)
        times = [t for t in _token_times(row) if t >= start]
        for a, b in zip(times, times[1:], strict=False):
            middle = (a + b) / 2
            members = sum(1 for theirs in spans
                          if any(lo <= middle <= hi for lo, hi in theirs))
            if not members:
                continue
            if any(lo < b and a < hi for lo, hi in receiving):
                where = "receiving"
            elif any(lo <= middle <= hi for lo, hi in prefills):
                where = "prefill"
            else:
                where = "quiet"
            out.append((members, where, b - a))
    return out


def member_intervals(requests: list[dict]) -> dict[int, list[float]]:
    """{members: [s between two consecutive tokens of one request]}: classified_intervals
    by members alone."""
    out: dict[int, list[float]] = {}
    for members, _where, step_s in classified_intervals(requests):
        out.setdefault(members, []).append(step_s)
    return out


@dataclass
class BatchLevel:
    """The emulator's batched steps by members against the profile's (sizes with at least
    MIN_INTERVALS intervals)."""

    members: list[int]
    intervals: list[int]  # intervals measured at each
    measured_s: list[float]  # their mean
    median_s: list[float]  # their median
    simulated_s: list[float]  # the profile's step of that many members
    # {surroundings: ([intervals at each size], [their mean s, None under MIN_INTERVALS])}
    by_surroundings: dict[str, tuple[list[int], list[float | None]]] = \
        field(default_factory=dict)
    # the profile's step beside a prefill over its step alone at each size (None: the
    # profile did not measure it)
    beside_prefill_ratio: list[float] | None = None

    @property
    def levels(self) -> list[float]:
        return [m / s for m, s in zip(self.measured_s, self.simulated_s, strict=True)]

    def words(self) -> str:
        parts = [f"{b}: {m * 1e3:.0f} ms vs {s * 1e3:.0f} (x {m / s:.2f}, {n} steps)"
                 for b, n, m, s in zip(self.members, self.intervals, self.measured_s,
                                       self.simulated_s, strict=True)]
        out = ("multi-request real decode: the emulator's batched steps (the mean interval "
               "between a request's tokens, by members decoding) against the profile's "
               "step of as many members: " + "; ".join(parts))
        if self.by_surroundings:
            out += "; by what else ran on the host: " + "; ".join(
                f"{b}: " + self._surroundings_words(i) for i, b in enumerate(self.members))
        return out

    def _surroundings_words(self, i: int) -> str:
        counts = {w: self.by_surroundings[w][0][i] for w in self.by_surroundings}
        means = {w: self.by_surroundings[w][1][i] for w in self.by_surroundings}
        quiet = means.get("quiet")
        parts = []
        for where in SURROUNDINGS:
            mean = means.get(where)
            if mean is None:
                parts.append(f"{where} ({counts.get(where, 0)} steps)")
                continue
            text = f"{where} {mean * 1e3:.0f} ms ({counts[where]} steps"
            if where != "quiet" and quiet:
                text += f", x {mean / quiet:.2f} of quiet"
                if where == "prefill" and self.beside_prefill_ratio is not None:
                    text += f"; the profile's x {self.beside_prefill_ratio[i]:.2f}"
            parts.append(text + ")")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"members": self.members, "intervals": self.intervals,
                "measured_s": self.measured_s, "median_s": self.median_s,
                "simulated_s": self.simulated_s, "level": self.levels,
                "by_surroundings": {w: {"intervals": n, "measured_s": m}
                                    for w, (n, m) in self.by_surroundings.items()},
                "profile_beside_prefill_ratio": self.beside_prefill_ratio}


def batch_level(intervals: dict[int, list[float]], simulated_step_s: Callable[[int], float],
                classified: list[tuple[int, str, float]] | None = None,
                beside_prefill_ratio: Callable[[int], float] | None = None
                ) -> BatchLevel | None:
    """The level of pooled member_intervals (every load's and codec's) against
    simulated_step_s(members) (the profile's step, s); None where no size has
    MIN_INTERVALS intervals. classified (classified_intervals, pooled): the same intervals
    by what else ran on the host; beside_prefill_ratio(members): the profile's step beside
    a prefill over its step alone, where measured."""
    sizes = sorted(b for b, v in intervals.items() if len(v) >= MIN_INTERVALS)
    if not sizes:
        return None
    simulated = [float(simulated_step_s(b)) for b in sizes]
    if not all(math.isfinite(s) and s > 0 for s in simulated):
        raise ValueError(f"the profile's batched steps must be > 0 s, got {simulated}")
    by: dict[str, tuple[list[int], list[float | None]]] = {}
    if classified is not None:
        for where in SURROUNDINGS:
            steps = [[s for b, w, s in classified if b == size and w == where] for size in sizes]
            by[where] = ([len(v) for v in steps],
                         [float(statistics.fmean(v)) if len(v) >= MIN_INTERVALS else None
                          for v in steps])
    return BatchLevel(sizes, [len(intervals[b]) for b in sizes],
                      [float(statistics.fmean(intervals[b])) for b in sizes],
                      [float(statistics.median(intervals[b])) for b in sizes], simulated, by,
                      [float(beside_prefill_ratio(b)) for b in sizes]
                      if beside_prefill_ratio is not None else None)


class BatchSteps:
    """A multi-request case's batch level over its loads, where its decode instance batches
    the real model's forwards (real): one instance, every request with a slot (more requests
    than slots would count a waiting request as a member; one slot per instance makes
    concurrent lone forwards look like a batch)."""

    def __init__(self, real: bool, context_tokens: int) -> None:
        self.real = real
        self.context_tokens = context_tokens  # where the profile's steps are taken
        self.intervals: dict[int, list[float]] = {}
        self.classified: list[tuple[int, str, float]] = []  # the same, told by surroundings
        self.sim: list[str] = []  # the last load's simulation overrides
        self.skipped = ""  # why the level is not measured, where a row could not be read

    def add(self, measured: list[dict], sim: list[str]) -> None:
        """One load's emulated rows (one per codec) and its simulation's overrides."""
        if not self.real or self.skipped:
            return
        requests = [r for row in measured for r in row.get("per_request") or []
                    if isinstance(r, dict)]
        try:
            found = classified_intervals(requests)
        except (KeyError, TypeError, ValueError) as exc:
            self.skipped = f"a request row could not be read ({type(exc).__name__}: {exc})"
            return
        for members, _where, step_s in found:
            self.intervals.setdefault(members, []).append(step_s)
        self.classified += found
        self.sim = sim

    def level(self) -> tuple[dict | None, str]:
        """(the level's record with its words, or None; a note where it was not measured
        though it should have been: a row or the profile could not be read)."""
        if not self.real:
            return None, ""
        if self.skipped:
            return None, f"multi-request batch level not measured: {self.skipped}"
        if not self.intervals:
            return None, ""
        from kvsim.core.compose import compose
        from kvsim.scenario.config import SimConfig
        from kvsim.scenario.timing_model import TimingModel

        try:
            scfg, _ = compose("sim", self.sim, SimConfig)
            timing = TimingModel(scfg.model, scfg.hardware)
            level = batch_level(self.intervals,
                                lambda b: timing.tpot_s(self.context_tokens, b),
                                self.classified,
                                timing.beside_prefill_ratio if timing.beside_prefill_measured
                                else None)
        except (ValueError, OSError) as exc:
            return None, f"multi-request batch level not measured: {exc}"
        if level is None:
            return None, ""
        return {**level.as_dict(), "context_tokens": self.context_tokens,
                "words": level.words()}, ""
