"""The multi-request case's batch level (kvsim.fidelity.batch_level): each interval between
two of a request's tokens counted at the number of requests decoding at its middle, against
the profile's step of as many members."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.fidelity.batch_level import MIN_STEPS, batch_level, member_intervals


def _row(arrival: float, wait: float, member_from: float, tokens: list[float]) -> dict:
    """A request row: arrived at `arrival` (epoch s), prefilled after `wait`, in the batch
    from member_from (drafting) to its last token; tokens: its tokens' times from arrival."""
    start = arrival + wait
    return {"prefill_wait_s": wait, "committed_from_arrival_s": tokens,
            "trace_spans": [["prefill", "prefill", start, start + 1.0],
                            ["draft_accepted", "decode", member_from, member_from + 0.1],
                            ["decode", "decode", member_from + 0.1, arrival + tokens[-1]]]}


def test_each_interval_is_counted_at_the_members_decoding_at_its_middle():
    # a: alone from t=2, tokens every 0.1 s; b: joins at t=3, tokens every 0.2 s, while a
    # decodes its tokens are 0.2 s apart too, and a's last ones after b left
    a_tokens = [2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0, 3.2, 3.4, 3.6, 3.8, 4.0]
    a = _row(0.0, 0.0, 1.95, a_tokens)
    b = _row(1.0, 0.5, 3.0, [2.1, 2.3, 2.5, 2.7, 2.9])  # tokens at 3.1 .. 3.9 (epoch)
    got = member_intervals([a, b])
    # a's first interval (the first step on a fresh cache) left out: 9 of 0.1 s alone, then
    # 5 of 0.2 s beside b; b's first left out: 3 of 0.2 s, with a
    assert sorted(got) == [1, 2]
    assert got[1] == pytest.approx([0.1] * 9)
    assert got[2] == pytest.approx([0.2] * 8)


def test_tokens_committed_together_and_rows_without_spans_are_left_out():
    # the first interval is the verification's two tokens, the rest 0.1 s
    verified = _row(0.0, 0.0, 0.5, [1.0, 1.0, 1.1, 1.2, 1.3])
    got = member_intervals([verified, {"committed_from_arrival_s": [0.1, 0.2]}])
    assert got == {1: pytest.approx([0.1, 0.1, 0.1])}


def test_the_level_is_the_mean_interval_over_the_profiles_step():
    intervals = {1: [0.08] * MIN_STEPS, 2: [0.12] * (MIN_STEPS - 1) + [0.22],
                 3: [0.2] * (MIN_STEPS - 1)}  # too few at 3: not reported
    level = batch_level(intervals, lambda b: {1: 0.08, 2: 0.1}[b])
    assert level.members == [1, 2] and level.steps == [MIN_STEPS, MIN_STEPS]
    assert level.levels == pytest.approx([1.0, 1.3])  # the mean, 0.13 s
    assert level.as_dict()["median_s"] == pytest.approx([0.08, 0.12])
    assert "2: 130 ms vs 100 (x 1.30, 10 steps)" in level.words()
    assert batch_level({1: [0.1]}, lambda b: 0.1) is None
    with pytest.raises(ValueError, match="must be > 0"):
        batch_level(intervals, lambda b: 0.0)


def test_the_timing_model_decode_has_no_batch_level(tmp_path):
    from kvsim.fidelity.validation import MultiConfig, _BatchSteps

    timing = _BatchSteps(MultiConfig())
    timing.add([{"per_request": [_row(0.0, 0.0, 0.5, [1.0 + i / 10 for i in range(20)])]}],
               ["model=smollm2-135m"])
    assert timing.level() is None and not timing.intervals


def test_the_real_decode_level_is_against_the_simulations_profile():
    """_BatchSteps pools every load's rows and takes the profile its simulation named, at
    the case's mid-decode context."""
    from kvsim.core.paths import DATA_DIR
    from kvsim.fidelity.validation import MultiConfig, _BatchSteps
    from kvsim.model.hardware_profile import load_profile

    profile = DATA_DIR / "profiles" / "hardware" / "local-smollm2-135m.json"
    sim = ["model=smollm2-135m", "hardware=local-cpu", f"hardware.profile={profile}"]
    real = _BatchSteps(MultiConfig(decode="real", context_tokens=512, output_tokens=32))
    tokens = [1.0 + i / 10 for i in range(MIN_STEPS + 2)]
    for load in range(2):  # two loads, one request each
        real.add([{"per_request": [_row(100.0 * load, 0.0, 0.5, tokens)]}], sim)
    level = real.level()
    assert level["members"] == [1] and level["steps"] == [2 * MIN_STEPS]
    assert level["context_tokens"] == 528
    doc = load_profile(str(profile), "smollm2-135m")
    step = float(np.interp(528, doc["tpot"]["context_tokens"], doc["tpot"]["s"]))
    assert level["simulated_s"] == pytest.approx([step])
    assert level["level"] == pytest.approx([0.1 / step])
    assert level["words"].startswith("multi-request real decode")
