"""The multi-request case's batch level (kvsim.fidelity.batch_level): each interval between
two of a request's tokens counted at the number of requests in a batch span at its middle,
against the profile's step of as many members."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.fidelity.batch_level import (
    MIN_INTERVALS,
    BatchSteps,
    batch_level,
    classified_intervals,
    member_intervals,
)


def _row(arrival: float, wait: float, member_from: float, tokens: list[float]) -> dict:
    """A request row: arrived at `arrival` (epoch s), prefilled after `wait`, in the batch
    from member_from (drafting for 0.1 s, then decoding) to its last token; tokens: its
    tokens' times from arrival."""
    start = arrival + wait
    return {"prefill_wait_s": wait, "committed_from_arrival_s": tokens,
            "trace_spans": [["prefill", "prefill", start, start + 1.0],
                            ["draft_accepted", "decode", member_from, member_from + 0.1],
                            ["decode", "decode", member_from + 0.1, arrival + tokens[-1]]]}


def test_each_interval_is_counted_at_the_members_in_a_batch_span_at_its_middle():
    # a: from t=1.95, tokens every 0.1 s from t=2 to 3, then every 0.2 s to 4 beside b;
    # b: arrived at 1, prefilled from 1.5, in the batch from 3.0, tokens at 3.1 .. 3.9
    a_tokens = [2.0 + i / 10 for i in range(11)] + [3.2, 3.4, 3.6, 3.8, 4.0]
    a = _row(0.0, 0.0, 1.95, a_tokens)
    b = _row(1.0, 0.5, 3.0, [2.1, 2.3, 2.5, 2.7, 2.9])
    got = member_intervals([a, b])
    assert sorted(got) == [1, 2]
    assert got[1] == pytest.approx([0.1] * 10)  # a alone
    assert got[2] == pytest.approx([0.2] * 9)  # a's last 5 and b's 4


def test_tokens_committed_together_count_once_and_rows_without_spans_are_left_out():
    verified = _row(0.0, 0.0, 0.5, [1.0, 1.0, 1.1, 1.2, 1.3])  # a verification's two tokens
    got = member_intervals([verified, {"committed_from_arrival_s": [0.1, 0.2]}])
    assert got == {1: pytest.approx([0.1, 0.1, 0.1])}


def test_a_request_between_its_spans_is_not_a_member():
    # b drafts 3.0-3.1, then waits for its residual until 3.5, then decodes: a's interval
    # 3.2-3.4 is a step alone
    a = _row(0.0, 0.0, 2.95, [3.0, 3.2, 3.4, 3.6])
    b = _row(0.0, 0.0, 3.0, [3.8, 3.9])
    b["trace_spans"][2][2] = 3.5
    got = member_intervals([a, b])
    assert got[1] == pytest.approx([0.2, 0.1])  # a's 3.2 - 3.4; b's, after a left
    assert got[2] == pytest.approx([0.2, 0.2])  # a's 3.0 - 3.2 and 3.4 - 3.6


def test_the_level_is_the_mean_interval_over_the_profiles_step():
    intervals = {1: [0.08] * MIN_INTERVALS, 2: [0.12] * (MIN_INTERVALS - 1) + [0.22],
                 3: [0.2] * (MIN_INTERVALS - 1)}  # too few at 3: not reported
    level = batch_level(intervals, lambda b: {1: 0.08, 2: 0.1}[b])
    assert level.members == [1, 2] and level.intervals == [MIN_INTERVALS, MIN_INTERVALS]
    assert level.levels == pytest.approx([1.0, 1.3])  # the mean, 0.13 s
    assert level.as_dict()["median_s"] == pytest.approx([0.08, 0.12])
    assert "2: 130 ms vs 100 (x 1.30, 10 steps)" in level.words()
    assert batch_level({1: [0.1]}, lambda b: 0.1) is None
    with pytest.raises(ValueError, match="must be > 0"):
        batch_level(intervals, lambda b: 0.0)


def _profile_sim() -> tuple[list[str], dict]:
    from kvsim.core.paths import DATA_DIR
    from kvsim.model.hardware_profile import load_profile

    profile = DATA_DIR / "profiles" / "hardware" / "local-smollm2-135m.json"
    return (["model=smollm2-135m", "hardware=local-cpu", f"hardware.profile={profile}"],
            load_profile(str(profile), "smollm2-135m"))


def test_the_level_is_against_the_simulations_profile_at_each_batch_size():
    """BatchSteps pools every load's rows and takes the profile its simulation named, at
    its context, for as many members as decoded."""
    sim, doc = _profile_sim()
    real = BatchSteps(True, 528)
    alone = [1.0 + i / 10 for i in range(MIN_INTERVALS + 1)]
    for load in range(2):  # one request alone, then two side by side, at each load
        t0 = 100.0 * load
        real.add([{"per_request": [_row(t0, 0.0, 0.5, alone)]}], sim)
        pair = [_row(t0 + 50, 0.0, t0 + 50.5, [1.0 + i / 5 for i in range(MIN_INTERVALS + 1)])
                for _ in range(2)]
        real.add([{"per_request": pair}], sim)
    level, note = real.level()
    assert note == "" and level["members"] == [1, 2] and level["context_tokens"] == 528
    assert level["intervals"] == [2 * MIN_INTERVALS, 4 * MIN_INTERVALS]
    step = float(np.interp(528, doc["tpot"]["context_tokens"], doc["tpot"]["s"]))
    batch = doc["tpot_batch"]
    ratio = float(np.interp(528, batch["context_tokens"],
                            [row[1] / row[0] for row in batch["s"]]))
    assert level["simulated_s"] == pytest.approx([step, step * ratio])
    assert level["level"] == pytest.approx([0.1 / step, 0.2 / (step * ratio)])
    assert level["words"].startswith("multi-request real decode")


def test_no_level_without_the_real_decode_and_a_note_where_a_row_is_malformed():
    sim, _ = _profile_sim()
    rows = [{"per_request": [_row(0.0, 0.0, 0.5, [1.0 + i / 10 for i in range(20)])]}]
    timing = BatchSteps(False, 528)
    timing.add(rows, sim)
    assert timing.level() == (None, "") and not timing.intervals
    broken = BatchSteps(True, 528)
    bad = _row(0.0, 0.0, 0.5, [1.0, 1.1])
    bad["trace_spans"][1][2] = None
    broken.add([{"per_request": [bad]}], sim)
    broken.add(rows, sim)  # the rest is not pooled: a level over part of the rows misleads
    level, note = broken.level()
    assert level is None and "a request row could not be read (TypeError" in note


def test_each_interval_is_told_by_what_else_ran_on_the_host():
    # a decodes every 0.1 s from t=10 to 13; b's prefill runs 10.5-11.5, its transfer
    # 11.5-11.75 and a dequantization of it 11.8-11.81; b itself never joins the batch
    a = _row(0.0, 0.0, 9.95, [10.0 + i / 10 for i in range(31)])
    b = {"prefill_wait_s": 0.0, "committed_from_arrival_s": [],
         "trace_spans": [["prefill", "prefill", 10.5, 11.5],
                         ["transfer full", "link", 11.5, 11.75],
                         ["dequantize layer 0 stream 0", "decode", 11.8, 11.81]]}
    got = classified_intervals([a, b])
    where = [w for _b, w, _s in got]
    assert all(members == 1 for members, _w, _s in got) and len(got) == 30
    # 10.0-10.5 quiet (5), 10.5-11.5 beside the prefill (10: the last ends as the transfer
    # starts), 11.5-11.9 receiving (the transfer to 11.75, the dequantization in 11.8-11.9:
    # 4), then quiet (11)
    assert where == ["quiet"] * 5 + ["prefill"] * 10 + ["receiving"] * 4 + ["quiet"] * 11
    assert member_intervals([a, b]) == {1: pytest.approx([0.1] * 30)}


def test_the_level_by_surroundings_against_the_profiles_ratio_beside_a_prefill():
    intervals = {1: [0.1] * 12 + [0.11] * 10 + [0.15] * 3}
    classified = [(1, "quiet", 0.1)] * 12 + [(1, "prefill", 0.11)] * 10 + \
        [(1, "receiving", 0.15)] * 3
    level = batch_level(intervals, lambda b: 0.1, classified, lambda b: 1.05)
    assert level.by_surroundings["quiet"] == ([12], [pytest.approx(0.1)])
    assert level.by_surroundings["prefill"] == ([10], [pytest.approx(0.11)])
    assert level.by_surroundings["receiving"] == ([3], [None])  # too few for a mean
    words = level.words()
    assert "1: quiet 100 ms (12 steps), prefill 110 ms (10 steps, x 1.10 of quiet; the " \
        "profile's x 1.05), receiving (3 steps)" in words
    record = level.as_dict()
    assert record["profile_beside_prefill_ratio"] == [1.05]
    assert record["by_surroundings"]["prefill"] == {"intervals": [10],
                                                    "measured_s": [pytest.approx(0.11)]}
    plain = batch_level(intervals, lambda b: 0.1)
    assert "by what else" not in plain.words() and plain.as_dict()["by_surroundings"] == {}
