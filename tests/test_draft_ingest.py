"""The draft step's slowdown fit (kvsim.calibrate.draft_ingest): replays by hand, the fit
recovering known parameters, and the windows read from emulated request rows."""

from __future__ import annotations

import math

import pytest

from kvsim.calibrate.draft_ingest import (
    GRID_DT_S,
    DraftWindow,
    fit,
    replay_end_s,
    windows_from_rows,
)


def window(drafts: int, end_s: float = 0.0, tpot_s: float = 0.06,
           spans: tuple[tuple[float, float], ...] = (), arrival: tuple[float, float] = (0.0, 1.0),
           later_bytes: float = 1e7) -> DraftWindow:
    return DraftWindow(start_s=0.0, end_s=end_s, drafts=drafts, tpot_s=tpot_s,
                       worker_spans=spans, later_arrival=arrival, later_bytes=later_bytes)


def test_replay_by_hand():
    """Bytes at 10 MB/s over [0, 1] s, 50 ns/B: the receiver is busy half the time; busy
    ratio 3: a step advances at (1 - 0.5 x 2/3) / 0.06 per s, so 2 drafts after a 0.01 s
    first-step extra end at 0.01 + 2 x 0.06 x 1.5 = 0.19 s. A worker job over the whole
    window makes it fully busy (one step takes 3 x 0.06), and busy + ingest is capped at 1;
    once the bytes are in, steps run at the plain rate."""
    w = window(2)
    assert replay_end_s(w, 3.0, 50e-9, 0.01) == pytest.approx(0.19, abs=2 * GRID_DT_S)
    assert replay_end_s(w, 3.0, 0.0, 0.01) == pytest.approx(0.13, abs=2 * GRID_DT_S)
    busy = window(1, spans=((0.0, 1.0),))
    assert replay_end_s(busy, 3.0, 0.0, 0.0) == pytest.approx(0.18, abs=2 * GRID_DT_S)
    assert replay_end_s(busy, 3.0, 50e-9, 0.0) == pytest.approx(0.18, abs=2 * GRID_DT_S)
    # bytes over [0, 0.09] only: a step takes 0.09 s while they arrive, then 0.06
    short = window(2, arrival=(0.0, 0.09), later_bytes=9e5)
    assert replay_end_s(short, 3.0, 50e-9, 0.0) == pytest.approx(0.09 + 0.06,
                                                                 abs=2 * GRID_DT_S)


def test_the_fit_recovers_the_ratio_and_the_cost_per_byte_from_two_rates():
    """Windows made by the model itself (busy ratio 2.53, 20.4 ns/B: off the grid) at a
    slow rate (bytes over 1 s, short worker jobs) and a fast one (jobs back to back): the
    fit finds both to the grid's step; not saturated (20.4 ns x 12 MB/s = 0.24). With a
    cost that saturates even the slow rate, any larger cost replays the same: flagged."""
    def made(ratio: float, ingest: float) -> list[DraftWindow]:
        shapes = [window(d, arrival=(0.0, 1.0), later_bytes=1.2e7,
                         spans=tuple((0.1 * k, 0.1 * k + 0.004) for k in range(10)))
                  for d in (3, 5, 7)]
        shapes += [window(d, arrival=(0.0, 0.1), later_bytes=1.2e7, spans=((0.0, 0.16),))
                   for d in (1, 2, 3)]
        return [DraftWindow(**{**w.__dict__, "end_s": replay_end_s(w, ratio, ingest, 0.005)})
                for w in shapes]

    got = fit(made(2.53, 20.4e-9), 0.005)
    assert got.busy_ratio == pytest.approx(2.53, abs=0.1)
    assert got.ingest_s_per_byte == pytest.approx(20.4e-9, abs=1.5e-9)
    assert got.rms_s < 3 * GRID_DT_S and got.requests == 6 and not got.saturated
    # one window of six disturbed (its last draft 0.3 s late): absolute errors keep the fit
    disturbed = made(2.53, 20.4e-9)
    disturbed[4] = DraftWindow(**{**disturbed[4].__dict__, "end_s": disturbed[4].end_s + 0.3})
    kept = fit(disturbed, 0.005)
    assert kept.busy_ratio == pytest.approx(2.53, abs=0.1)
    assert kept.ingest_s_per_byte == pytest.approx(20.4e-9, abs=1.5e-9)
    assert kept.rms_s > 0.3 / 6 ** 0.5 - 3 * GRID_DT_S  # the disturbed window's miss
    sat = fit(made(2.5, 100e-9), 0.005)  # 100 ns x 12 MB/s = 1.2: busy while they arrive
    assert sat.saturated and 1 / 12e6 <= sat.ingest_s_per_byte <= 100e-9
    assert sat.busy_ratio == pytest.approx(2.5, abs=0.1)
    with pytest.raises(ValueError, match="no request drafted"):
        fit([], 0.0)


def test_the_fit_matches_every_recorded_draft_step():
    """Windows of four drafts whose last draft ends where busy ratio 2 puts it but whose
    first three steps end where ratio 4 puts them: matched on the last draft alone the fit
    finds 2; matched on every step (absolute misses: the most steps win) it finds 4, missing
    the last draft's end, and counts every step it matched. Every step made by ratio 3:
    found, and nothing missed."""
    shapes = [window(4, arrival=(0.0, 1.0), later_bytes=1.2e7,
                     spans=tuple((0.05 * k, 0.05 * k + 0.02) for k in range(20)))
              for _ in range(3)]

    def ends(w: DraftWindow, ratio: float) -> tuple[float, ...]:
        return tuple(replay_end_s(DraftWindow(**{**w.__dict__, "drafts": k, "step_ends_s": ()}),
                                  ratio, 0.0, 0.0) for k in range(1, w.drafts + 1))

    last_only = [DraftWindow(**{**w.__dict__, "end_s": ends(w, 2.0)[-1]}) for w in shapes]
    assert fit(last_only, 0.0).busy_ratio == pytest.approx(2.0, abs=0.05)
    assert fit(last_only, 0.0).steps_matched == 3
    mixed = [DraftWindow(**{**w.__dict__, "step_ends_s": ends(w, 4.0)[:-1] + (w.end_s,)})
             for w in last_only]
    got = fit(mixed, 0.0)
    assert got.busy_ratio == pytest.approx(4.0, abs=0.05) and got.steps_matched == 12
    assert got.rms_s > 0.02  # the last draft's end is missed now
    # each window weighs as one: two 1-draft windows (the worker busy throughout) made by
    # ratio 2 and a 6-draft one (busy 60% of the time) whose steps ratio 4 made. Summed over
    # steps, the 6-draft window's misses would outvote the two others' and give 4 (worked
    # out on this grid); averaged per window, two of three windows say 2
    one = window(1, arrival=(0.0, 1.0), later_bytes=1.2e7, spans=((0.0, 1.0),))
    six = window(6, arrival=(0.0, 1.0), later_bytes=1.2e7,
                 spans=tuple((0.05 * k, 0.05 * k + 0.03) for k in range(40)))
    ones = [DraftWindow(**{**one.__dict__, "end_s": ends(one, 2.0)[-1],
                           "step_ends_s": ends(one, 2.0)}) for _ in range(2)]
    sixes = DraftWindow(**{**six.__dict__, "end_s": ends(six, 4.0)[-1],
                           "step_ends_s": ends(six, 4.0)})
    assert fit([*ones, sixes], 0.0).busy_ratio == pytest.approx(2.0, abs=0.05)
    # every step made by ratio 3: recovered, the last end matched
    exact = [DraftWindow(**{**w.__dict__, "end_s": ends(w, 3.0)[-1],
                            "step_ends_s": ends(w, 3.0)}) for w in shapes]
    three = fit(exact, 0.0)
    assert three.busy_ratio == pytest.approx(3.0, abs=0.05) and three.rms_s < 2 * GRID_DT_S


def test_windows_are_read_from_emulated_rows():
    """A drafted on-arrival row: drafting from the first draft span's start to the last's
    end, the worker's layer jobs, and the later streams arriving from the anchor's
    completion to the last stream's (prefill end + their completion times); plain rows,
    unfinished ones and one-stream ones give none."""
    row = {"status": "done", "proposed_tokens": 2, "tpot_s": 0.05,
           "stream_complete_from_prefill_end_s": {"anchor": 0.2, "residual": 0.5},
           "stream_bytes": {"anchor": 1000, "residual": 3000},
           "trace_spans": [["prefill", "prefill", 1.0, 2.0],
                           ["draft_accepted", "decode", 2.25, 2.3],
                           ["draft_rejected", "decode", 2.3, 2.4],
                           ["dequantize layer 0 streams 0-1", "decode", 2.3, 2.31],
                           ["dequantize layer 0 stream 0", "decode", 2.1, 2.11],
                           ["dequantize stream 0", "decode", 2.2, 2.25]]}
    (w,) = windows_from_rows([row, {**row, "proposed_tokens": 0},
                              {**row, "status": "failed"}, {**row, "tpot_s": math.nan},
                              {**row, "stream_complete_from_prefill_end_s": {"full": 0.2}}])
    assert (w.start_s, w.end_s, w.drafts, w.tpot_s) == (2.25, 2.4, 2, 0.05)
    assert w.worker_spans == ((2.3, 2.31), (2.1, 2.11))
    assert w.later_arrival == pytest.approx((2.2, 2.5)) and w.later_bytes == 3000
    # three streams, the middle one completing last: the later bytes end with it
    assert w.step_ends_s == () and w.targets()[0].tolist() == [2]  # no steps recorded
    # each draft step's end (from arrival), placed on the spans' clock by the last
    (ws,) = windows_from_rows([{**row, "draft_steps_from_arrival_s": [1.31, 1.45]}])
    assert ws.step_ends_s == pytest.approx((2.26, 2.4))
    steps, ends = ws.targets()
    assert steps.tolist() == [1, 2] and ends == pytest.approx([2.26, 2.4])
    # as many step times as drafts, or none are used
    (wn,) = windows_from_rows([{**row, "draft_steps_from_arrival_s": [1.45]}])
    assert wn.step_ends_s == ()
    (w3,) = windows_from_rows([{**row, "stream_complete_from_prefill_end_s":
                                {"anchor": 0.2, "mid": 0.7, "last": 0.5},
                                "stream_bytes": {"anchor": 1000, "mid": 500, "last": 3000}}])
    assert w3.later_arrival == pytest.approx((2.2, 2.7)) and w3.later_bytes == 3500


@pytest.mark.parametrize("step_ends_s", [(0.1,), (0.2, 0.1), (0.1, 0.25)])
def test_a_windows_step_ends_must_fit_its_drafts(step_ends_s):
    """Step ends are as many as the drafts, in order, the last the window's end (0.2 s)."""
    with pytest.raises(ValueError, match="2 times in order"):
        DraftWindow(start_s=0.0, end_s=0.2, drafts=2, tpot_s=0.06, worker_spans=(),
                    later_arrival=(0.0, 1.0), later_bytes=1e7, step_ends_s=step_ends_s)
    ok = DraftWindow(start_s=0.0, end_s=0.2, drafts=2, tpot_s=0.06, worker_spans=(),
                     later_arrival=(0.0, 1.0), later_bytes=1e7, step_ends_s=(0.1, 0.2))
    assert DraftWindow.from_doc({**ok.__dict__, "worker_spans": [],
                                 "later_arrival": [0.0, 1.0], "step_ends_s": [0.1, 0.2]}) == ok
