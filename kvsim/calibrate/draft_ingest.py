"""What slows the receiver's drafts: its worker's layer jobs and the later streams' bytes.

While a split-stream request drafts on its anchor, the receiver's process also takes in the
later streams (sockets, frame checks, copies; on a `tc`-shaped veth the kernel's shaping
and packet processing as well) and its on-arrival worker dequantizes their layers, on the
same cores as the draft step. The first draft's slowdown while the residual arrives grows
with the arrival rate, well beyond what the worker's jobs alone predict (the measurements are
in CHANGELOG.md, with the fidelity runs that found it).

The model both engines apply (kvsim.sim.worker_load on the projected worker jobs and
arrivals, kvsim.transport.decode_loop's timing decode on the real worker and bytes): at each
moment the receiver is busy a share u = min(1, worker busy + ingest), where the worker is
busy (1) while it runs a layer job and ingest = ingest_s_per_byte x the later streams' mean
arrival rate (bytes/s) while they arrive; a draft step advances at
(1 - u (1 - 1/busy_ratio)) / tpot steps per second. `fit` finds (busy_ratio,
ingest_s_per_byte) for one link from calibration transfers' requests that drafted, by
replaying each one's draft window on its own measured worker spans and arrivals and
matching the end of each of its draft steps where the row recorded them (the mean of its
steps' absolute misses, so that each request weighs the same: a few more constraints from
the same transfers, CHANGELOG.md, 2026-12-06), or else of its last
(least absolute errors over a grid: the fit rests on a
few windows, and least squares followed one disturbed window of six, to a busy_ratio of 6.45
over `tc` where absolute errors give 2.65 and the token bucket's were 3.0 and 2.5, and lynx's
TTFT over `tc` at 1 Gbps came out 20-21% late in the simulator: CHANGELOG.md, 2026-12-06).
Transfers at two rates are needed: near the cores' limit the worker's share dominates, at a
moderate rate the bytes' share does. Where even the slower rate saturates
the receiver (ingest_s_per_byte x its rate >= 1), a larger cost would replay the same, and
the grid's tie-break keeps the smallest: the fit's `saturated` flag says so, and the cost is
then a lower bound (rates below the slower one are extrapolated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GRID_DT_S = 0.001  # replay time step (s)
BUSY_RATIOS = np.round(np.arange(1.0, 12.0001, 0.05), 4)  # candidate busy_ratio values
INGEST_NS_PER_BYTE = np.arange(0.0, 120.001, 1.0)  # candidate ingest costs (ns per byte)


@dataclass(frozen=True)
class DraftWindow:
    """One request's drafting, as the receiver measured it (s, one clock)."""

    start_s: float  # first draft step began (anchor cache ready)
    end_s: float  # last draft step ended
    drafts: int  # draft steps made
    tpot_s: float  # its decode step on the full cache (a plain step)
    worker_spans: tuple[tuple[float, float], ...]  # on-arrival worker's layer jobs
    later_arrival: tuple[float, float]  # the later streams' bytes arrived over [a, b]
    later_bytes: float  # their wire bytes
    # [drafts] every draft step's end (s, the same clock; the last is end_s); () where the
    # row did not record them: then only end_s is matched
    step_ends_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        ends = self.step_ends_s
        in_order = all(b >= a for a, b in zip(ends[:-1], ends[1:], strict=True))
        if ends and (len(ends) != self.drafts or not in_order
                     or abs(ends[-1] - self.end_s) > 1e-6):
            raise ValueError(f"a draft window's step ends must be {self.drafts} times in "
                             f"order, the last its end ({self.end_s} s); got {ends}")

    @classmethod
    def from_doc(cls, doc: dict) -> DraftWindow:
        """A window as a profile keeps it (`draft_step.fit.windows`: dataclasses.asdict,
        its tuples as JSON lists)."""
        return cls(**{**doc, "worker_spans": tuple(map(tuple, doc["worker_spans"])),
                      "later_arrival": tuple(doc["later_arrival"]),
                      "step_ends_s": tuple(doc.get("step_ends_s") or ())})

    def targets(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps [n] int, their measured ends [n] s) that a replay is matched on: every
        draft step where recorded, else the last."""
        if self.step_ends_s:
            return np.arange(1, self.drafts + 1), np.asarray(self.step_ends_s, dtype=float)
        return np.array([self.drafts]), np.array([self.end_s])


def windows_from_rows(rows: list[dict]) -> list[DraftWindow]:
    """The DraftWindows of a `kvsim emulate` run's request rows that drafted on arrival
    (trace spans with the draft steps and the worker's "dequantize layer" jobs, per-stream
    completion times and bytes; each draft step's end from `draft_steps_from_arrival_s`
    where present, placed on the spans' clock by the last one, the last draft span's end).
    The later streams follow the anchor on one link, so they arrive from the anchor's
    completion to the last stream's."""
    out = []
    for row in rows:
        proposed = int(row.get("proposed_tokens") or 0)
        spans = row.get("trace_spans") or []
        complete = row.get("stream_complete_from_prefill_end_s") or {}
        sizes = row.get("stream_bytes") or {}
        tpot_s = float(row.get("tpot_s") or math.nan)
        if row.get("status") != "done" or proposed == 0 or len(complete) < 2 or \
                not (math.isfinite(tpot_s) and tpot_s > 0):  # no plain step to compare with
            continue
        prefill_end = [float(b) for name, _p, _a, b in spans if name == "prefill"]
        drafts = [(float(a), float(b)) for name, _p, a, b in spans
                  if name in ("draft_accepted", "draft_rejected")]
        if not prefill_end or not drafts:
            continue
        names = list(complete)
        t_pe = prefill_end[0]
        end_s = max(b for _a, b in drafts)
        steps = [float(t) for t in row.get("draft_steps_from_arrival_s") or []]
        step_ends = tuple(end_s - (steps[-1] - t) for t in steps) \
            if len(steps) == proposed else ()
        out.append(DraftWindow(
            start_s=min(a for a, _b in drafts), end_s=end_s,
            drafts=proposed, tpot_s=tpot_s,
            worker_spans=tuple((float(a), float(b)) for name, process, a, b in spans
                               if process == "decode" and name.startswith("dequantize layer ")),
            later_arrival=(t_pe + float(complete[names[0]]),
                           t_pe + max(float(complete[n]) for n in names[1:])),
            later_bytes=float(sum(float(sizes[n]) for n in names[1:])),
            step_ends_s=step_ends))
    return out


def _grid(w: DraftWindow, extra_s: float, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(worker busy [g] in {0, 1}, later bytes' arrival rate [g] B/s) on the replay grid
    from w.start_s + extra_s (the first step's extra on a fresh cache runs first)."""
    t = w.start_s + extra_s + GRID_DT_S * (np.arange(int(horizon_s / GRID_DT_S)) + 0.5)
    busy = np.zeros(len(t))
    for a, b in w.worker_spans:
        busy[(t >= a) & (t < b)] = 1.0
    a, b = w.later_arrival
    rate = np.where((t >= a) & (t < b), w.later_bytes / (b - a), 0.0) if b > a else \
        np.zeros(len(t))
    return busy, rate


def replay_step_ends_s(w: DraftWindow, busy_ratio: float, ingest_s_per_byte: float,
                       extra_s: float) -> np.ndarray:
    """[w.drafts] when the model says each of w's draft steps ends (s, w's clock): steps
    from w.start_s + extra_s, each advancing at (1 - u (1 - 1/busy_ratio)) / tpot_s."""
    busy, rate = _grid(w, extra_s, _horizon(w, extra_s))
    return _end_times(w, busy, rate, np.array([busy_ratio]), ingest_s_per_byte, extra_s,
                      np.arange(1, w.drafts + 1))[0]


def replay_end_s(w: DraftWindow, busy_ratio: float, ingest_s_per_byte: float,
                 extra_s: float) -> float:
    """When the model says w's last draft step ends (s; replay_step_ends_s's last)."""
    return float(replay_step_ends_s(w, busy_ratio, ingest_s_per_byte, extra_s)[-1])


def _horizon(w: DraftWindow, extra_s: float) -> float:
    # long enough for the slowest candidate: every step at the largest ratio
    return w.drafts * w.tpot_s * float(BUSY_RATIOS[-1]) + extra_s + 0.1


def _end_times(w: DraftWindow, busy: np.ndarray, rate: np.ndarray, ratios: np.ndarray,
               ingest_s_per_byte: float, extra_s: float, steps: np.ndarray) -> np.ndarray:
    """[len(ratios), len(steps)] replayed end of w's draft steps `steps` (1-based) (s),
    one row per busy ratio."""
    u = np.minimum(1.0, busy + ingest_s_per_byte * rate)  # [g]
    slow = 1.0 - 1.0 / ratios  # [r]
    progress = np.cumsum(1.0 - np.outer(slow, u), axis=1) * (GRID_DT_S / w.tpot_s)  # [r, g]
    idx = np.array([np.searchsorted(p, steps - 1e-9) for p in progress])  # [r, n]
    return w.start_s + extra_s + GRID_DT_S * (idx + 1.0)


@dataclass(frozen=True)
class DraftFit:
    busy_ratio: float  # a draft step over a decode step while the receiver is fully busy
    ingest_s_per_byte: float  # receiver busy time per later-stream byte taken in (s/B)
    # root mean square of (replayed - measured) last-draft end (s): what a TTKT sees, and
    # what the calibration's poor-fit check has used since before the fit matched every step
    rms_s: float
    steps_matched: int  # draft step ends matched, over every request
    requests: int
    saturated: bool  # the cost x every window's arrival rate >= 1: a lower bound


def fit(windows: list[DraftWindow], extra_s: float) -> DraftFit:
    """(busy_ratio, ingest_s_per_byte) minimising the summed absolute error of the replayed
    draft step ends over `windows` (each window's mean over its matched steps,
    DraftWindow.targets; BUSY_RATIOS x INGEST_NS_PER_BYTE grid; ties: the smaller ingest
    cost, then ratio); rms_s is the chosen pair's root mean square error on the last draft's
    end. extra_s: the first step's extra on a fresh cache (s)."""
    if not windows:
        raise ValueError("no request drafted: nothing to fit the draft step on")
    grids = [_grid(w, extra_s, _horizon(w, extra_s)) for w in windows]
    targets = [w.targets() for w in windows]
    best: tuple[float, float, float, float] | None = None  # (|error|, squares, ratio, cost)
    for ns in INGEST_NS_PER_BYTE:
        err = np.zeros(len(BUSY_RATIOS))
        sq_err = np.zeros(len(BUSY_RATIOS))
        for w, (busy, rate), (steps, ends) in zip(windows, grids, targets, strict=True):
            miss = _end_times(w, busy, rate, BUSY_RATIOS, ns * 1e-9, extra_s, steps) - ends
            err += np.abs(miss).mean(axis=1)
            sq_err += miss[:, -1] ** 2
        i = int(np.argmin(err))
        if best is None or err[i] < best[0] - 1e-12:
            best = (float(err[i]), float(sq_err[i]), float(BUSY_RATIOS[i]), float(ns) * 1e-9)
    assert best is not None
    _abs, sq, ratio, ingest = best
    rates = [w.later_bytes / (w.later_arrival[1] - w.later_arrival[0]) for w in windows
             if w.later_arrival[1] > w.later_arrival[0]]
    saturated = ingest > 0 and bool(rates) and ingest * min(rates) >= 1.0
    return DraftFit(ratio, ingest, float(np.sqrt(sq / len(windows))),
                    sum(len(steps) for steps, _ends in targets), len(windows), saturated)
