"""A drafted scenario's first draft step, measured, replayed on the emulator's own worker and
simulated (kvsim.fidelity.first_draft), and where the validation summary names it."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvsim.calibrate.draft_ingest import GRID_DT_S
from kvsim.fidelity.drafting import drafting_line, drafting_summary
from kvsim.fidelity.first_draft import (
    KEYS,
    DraftModel,
    draft_model,
    first_draft_keys,
    measured_keys,
    simulated_s,
)
from kvsim.fidelity.validation import _first_draft_again

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "data" / "profiles"
HARDWARE = PROFILES / "hardware" / "local-smollm2-135m.json"
TC = PROFILES / "link" / "local-smollm2-135m-tc.json"

T_PE = 1000.0  # prefill end on the spans' clock (s)


def _request(anchor_s=0.10, first_end_s=0.25, drafts=1, worker=True, steps_recorded=True,
             tpot_s=0.05, status="done"):
    """An emulated request that drafted on its anchor (kvsim.transport row fields): its
    anchor's cache ready `anchor_s` after prefill end, drafting from then, its first draft
    step ending `first_end_s` after prefill end and each later one a tpot_s after; its
    worker dequantizing the residual the whole time (worker) or not at all."""
    start = T_PE + anchor_s
    ends = [T_PE + first_end_s + i * tpot_s for i in range(drafts)]
    spans = [["prefill", "prefill", T_PE - 1.0, T_PE],
             ["draft_accepted", "decode", start, ends[-1]]]
    if worker:  # back-to-back layer jobs over the whole window and beyond
        t = start - 0.01
        while t < ends[-1] + 0.05:
            spans.append([f"dequantize layer {len(spans)} stream 1", "decode", t, t + 0.002])
            t += 0.002
    row = {"status": status, "proposed_tokens": drafts, "accepted_tokens": drafts,
           "tpot_s": tpot_s, "trace_spans": spans,
           "stream_complete_from_prefill_end_s": {"anchor": anchor_s - 0.01,
                                                  "residual": first_end_s + 0.2},
           "stream_bytes": {"anchor": 1e6, "residual": 3e6},
           "anchor_ready_from_prefill_end_s": anchor_s,
           "ttft_from_prefill_end_s": first_end_s}
    if steps_recorded:  # from arrival: any clock, placed by the last one
        row["draft_steps_from_arrival_s"] = [5.0 + (e - ends[0]) for e in ends]
    return row


def test_the_draft_model_is_the_one_the_simulator_applies():
    """The link profile's draft step where it describes the run, else the hardware
    profile's; the first step's extra at the scenario's context; None without a
    busy_ratio."""
    hw = json.loads(HARDWARE.read_text())
    link = json.loads(TC.read_text())["draft_step"]
    extra = hw["first_step_extra"]
    model = draft_model(HARDWARE, TC, "smollm2-135m", 1536)
    assert (model.busy_ratio, model.ingest_s_per_byte) == (link["busy_ratio"],
                                                          link["ingest_s_per_byte"])
    assert model.extra_s == pytest.approx(float(np.interp(1536, extra["context_tokens"],
                                                          extra["s"])))
    # no link profile: the hardware profile's draft step
    assert draft_model(HARDWARE, None, "smollm2-135m", 1536).busy_ratio == \
        hw["draft_step"]["busy_ratio"]
    # another model's link entry does not describe the run
    assert draft_model(HARDWARE, TC, "another-model", 1536).busy_ratio == \
        hw["draft_step"]["busy_ratio"]


def test_no_busy_ratio_no_model(tmp_path):
    hw = json.loads(HARDWARE.read_text())
    del hw["draft_step"]
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hw))
    assert draft_model(path, None, "smollm2-135m", 1024) is None


def test_the_replay_runs_the_model_on_the_requests_own_worker():
    """A worker busy the whole first step: the model's step is tpot x busy_ratio after the
    first step's extra, so the replayed time is the measured one plus that end's miss; with
    no worker (and no ingest cost) it is a plain tpot."""
    model = DraftModel(busy_ratio=2.0, ingest_s_per_byte=0.0, extra_s=0.004)
    busy = measured_keys({"per_request": [_request()]}, model)
    assert busy["first_draft_measured_s"] == pytest.approx(0.15)
    # replayed end: 0.10 + 0.004 + 0.05 x 2 = 0.204 after prefill end, measured 0.25
    assert busy["first_draft_replayed_s"] == pytest.approx(0.15 + 0.204 - 0.25,
                                                           abs=2 * GRID_DT_S)
    idle = measured_keys({"per_request": [_request(worker=False)]}, model)
    assert idle["first_draft_replayed_s"] == pytest.approx(0.15 + 0.154 - 0.25,
                                                           abs=2 * GRID_DT_S)
    # the mean over the requests that drafted
    both = measured_keys({"per_request": [_request(), _request(worker=False)]}, model)
    assert both["first_draft_replayed_s"] == pytest.approx(
        (busy["first_draft_replayed_s"] + idle["first_draft_replayed_s"]) / 2)


def test_a_later_draft_step_does_not_move_the_first():
    model = DraftModel(2.0, 0.0, 0.0)
    one = measured_keys({"per_request": [_request()]}, model)
    three = measured_keys({"per_request": [_request(drafts=3)]}, model)
    assert three == pytest.approx(one)


def test_what_cannot_be_replayed_is_measured_alone():
    """Several drafts without their steps' ends recorded: measured, no replay; no model:
    measured, no replay; a request that did not finish or did not draft: left out."""
    model = DraftModel(2.0, 0.0, 0.0)
    unrecorded = measured_keys({"per_request": [_request(drafts=2, steps_recorded=False)]},
                               model)
    assert unrecorded == {"first_draft_measured_s": pytest.approx(0.15),
                          "first_draft_replayed_s": None}
    # one draft: its end is the window's, recorded or not
    single = measured_keys({"per_request": [_request(steps_recorded=False)]}, model)
    assert single["first_draft_replayed_s"] is not None
    assert measured_keys({"per_request": [_request()]}, None)["first_draft_replayed_s"] is None
    plain = {**_request(), "proposed_tokens": 0}
    failed = _request(status="timeout")
    assert measured_keys({"per_request": [plain, failed]}, model) == {}
    assert measured_keys({}, model) == {}


def test_the_simulated_time_and_the_three_keys():
    sim = {"proposed_tokens": 2, "ttft_from_prefill_end_s": 0.27,
           "anchor_ready_from_prefill_end_s": 0.16}
    assert simulated_s(sim) == pytest.approx(0.11)
    assert simulated_s({**sim, "proposed_tokens": 0}) is None
    assert simulated_s({**sim, "anchor_ready_from_prefill_end_s": math.nan}) is None
    model = DraftModel(2.0, 0.0, 0.0)
    keys = first_draft_keys({"per_request": [_request()]}, sim, model)
    assert set(keys) == set(KEYS) and keys["first_draft_simulated_s"] == pytest.approx(0.11)
    # only the simulator drafted: its time, none measured
    assert first_draft_keys({"per_request": [{**_request(), "proposed_tokens": 0}]}, sim,
                            model) == {"first_draft_measured_s": None,
                                       "first_draft_replayed_s": None,
                                       "first_draft_simulated_s": pytest.approx(0.11)}
    assert first_draft_keys({}, {**sim, "proposed_tokens": 0}, model) == {}


def test_a_resimulation_recomputes_carries_or_drops_the_replay():
    """With the run's scenario file: all three again. Without: the saved measured and
    replayed times are carried (recompare keeps them), the replay dropped on other
    profiles; a run that saved none and a simulation that did not draft add nothing."""
    sim = {"proposed_tokens": 1, "ttft_from_prefill_end_s": 0.27,
           "anchor_ready_from_prefill_end_s": 0.16}
    model = DraftModel(2.0, 0.0, 0.0)
    saved = {"first_draft_measured_s": 0.15, "first_draft_replayed_s": 0.10,
             "first_draft_simulated_s": 0.09}
    again = _first_draft_again(saved, sim, {"per_request": [_request()]}, model, False)
    assert again == first_draft_keys({"per_request": [_request()]}, sim, model)
    assert _first_draft_again(saved, sim, None, model, False) == \
        {"first_draft_simulated_s": pytest.approx(0.11)}
    assert _first_draft_again(saved, sim, None, model, True) == \
        {"first_draft_simulated_s": pytest.approx(0.11), "first_draft_replayed_s": None}
    assert _first_draft_again({}, {**sim, "proposed_tokens": 0}, None, model, True) == {}
    assert _first_draft_again({}, sim, None, model, True) == \
        {"first_draft_simulated_s": pytest.approx(0.11)}


def _drafted(metric, error_pct, **first):
    return {"case": "single", "emulation": "tc", "bandwidth_gbps": 0.6, "context_tokens": 1536,
            "codec": "lynx", "metric": metric, "measured_s": 1.0,
            "simulated_s": 1.0 + error_pct / 100, "error_pct": error_pct,
            "accepted_measured": "1/1", "accepted_simulated": "1.88/2", **first}


def test_the_drafting_line_gives_a_differing_scenarios_first_draft():
    first = {"first_draft_measured_s": 0.1311, "first_draft_replayed_s": 0.1248,
             "first_draft_simulated_s": 0.1054}
    line = drafting_line(drafting_summary([_drafted("ttft_c", 15.05, **first),
                                           _drafted("ttft", -10.5, **first)]))
    assert line is not None and ("15.05% off; anchor ready to first drafted token 131 ms "
                                 "measured, 125 replayed on the emulator's own worker, 105 "
                                 "simulated)") in line
    no_replay = drafting_line(drafting_summary(
        [_drafted("ttft_c", 15.05, **{**first, "first_draft_replayed_s": None})]))
    assert "131 ms measured, 105 simulated)" in no_replay
    # a row without them (a run measured before they were kept): the line as before
    bare = drafting_line(drafting_summary([_drafted("ttft_c", 15.05)]))
    assert "15.05% off); " in bare and "anchor ready" not in bare
    summary = drafting_summary([_drafted("ttft_c", 15.05, **first)])
    assert {k: summary["differing"][0][k] for k in KEYS} == first
