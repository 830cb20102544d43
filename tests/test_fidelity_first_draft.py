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
    draft_model_of,
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
PREFILL_S = 1.0  # arrival -> prefill end (s)


def _request(anchor_s=0.10, first_end_s=0.25, drafts=1, worker=True, steps_recorded=True,
             tpot_s=0.05, status="done", accepted=None, with_key=True):
    """An emulated request that drafted on its anchor (kvsim.transport row fields): its
    anchor's cache ready `anchor_s` after prefill end, drafting from then, its first draft
    step ending `first_end_s` after prefill end and each later one a tpot_s after; its
    worker dequantizing the residual the whole time (worker) or not at all. accepted=0:
    its first valid token comes after verification, 0.2 s after its last draft."""
    accepted = drafts if accepted is None else accepted
    start = T_PE + anchor_s
    ends = [T_PE + first_end_s + i * tpot_s for i in range(drafts)]
    spans = [["prefill", "prefill", T_PE - PREFILL_S, T_PE],
             ["draft_accepted", "decode", start, ends[-1]]]
    if worker:  # back-to-back layer jobs over the whole window and beyond
        t = start - 0.01
        while t < ends[-1] + 0.05:
            spans.append([f"dequantize layer {len(spans)} stream 1", "decode", t, t + 0.002])
            t += 0.002
    ttft_pe = first_end_s if accepted else ends[-1] - T_PE + 0.2
    row = {"status": status, "proposed_tokens": drafts, "accepted_tokens": accepted,
           "tpot_s": tpot_s, "trace_spans": spans,
           "stream_complete_from_prefill_end_s": {"anchor": anchor_s - 0.01,
                                                  "residual": first_end_s + 0.2},
           "stream_bytes": {"anchor": 1e6, "residual": 3e6},
           "anchor_ready_from_prefill_end_s": anchor_s,
           "ttft_from_prefill_end_s": ttft_pe, "ttft_s": PREFILL_S + ttft_pe}
    if with_key:
        row["first_draft_from_prefill_end_s"] = first_end_s
    if steps_recorded:
        row["draft_steps_from_arrival_s"] = [PREFILL_S + e - T_PE for e in ends]
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
    sim = {"proposed_tokens": 2, "first_draft_from_prefill_end_s": 0.27,
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
    sim = {"proposed_tokens": 1, "first_draft_from_prefill_end_s": 0.27,
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
    assert line is not None and ("15.05% off; anchor ready to the first draft step's end 131 ms "
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


def test_a_rejected_first_draft_is_timed_at_its_step_not_at_the_first_valid_token():
    """accepted 0: TTFT is the end of verification; the first draft step's end is what the
    decision turns on, in the row's key and, for a row measured before it, from its draft
    steps' ends."""
    model = DraftModel(2.0, 0.0, 0.004)
    accepted = measured_keys({"per_request": [_request()]}, model)
    rejected = measured_keys({"per_request": [_request(accepted=0)]}, model)
    older = measured_keys({"per_request": [_request(accepted=0, with_key=False)]}, model)
    assert rejected == pytest.approx(accepted) and older == pytest.approx(accepted)
    assert accepted["first_draft_measured_s"] == pytest.approx(0.15)
    # neither the key nor the draft steps: not timed
    assert measured_keys({"per_request": [_request(with_key=False, steps_recorded=False)]},
                         model) == {}


def test_one_request_is_its_own_row():
    """repeats=1: the emulated codec's row is its one request's (no per_request list)."""
    model = DraftModel(2.0, 0.0, 0.004)
    assert measured_keys(_request(), model) == \
        measured_keys({"per_request": [_request()]}, model)


def test_the_replay_shifts_every_drafted_requests_mean():
    """A request the replay cannot use (its first step's end unrecorded) still counts in
    the measured mean, and the replayed time is that mean plus the mean miss of the others."""
    model = DraftModel(2.0, 0.0, 0.0)
    one = measured_keys({"per_request": [_request()]}, model)
    miss = one["first_draft_replayed_s"] - one["first_draft_measured_s"]
    other = _request(anchor_s=0.12, drafts=2, steps_recorded=False)
    both = measured_keys({"per_request": [_request(), other]}, model)
    assert both["first_draft_measured_s"] == pytest.approx((0.15 + 0.13) / 2)
    assert both["first_draft_replayed_s"] == pytest.approx(both["first_draft_measured_s"] + miss)


def test_a_malformed_request_loses_its_replay_not_the_validation():
    model = DraftModel(2.0, 0.0, 0.0)
    bad = {**_request(), "stream_bytes": {"anchor": 1e6}}  # the residual's bytes missing
    assert measured_keys({"per_request": [bad]}, model) == \
        {"first_draft_measured_s": pytest.approx(0.15), "first_draft_replayed_s": None}
    nulls = {**_request(), "stream_complete_from_prefill_end_s": {"anchor": None,
                                                                   "residual": None}}
    assert measured_keys({"per_request": [nulls]}, model)["first_draft_replayed_s"] is None


def test_the_model_is_read_from_the_profiles_the_simulation_ran_on(tmp_path):
    """draft_model_of: the last hardware.profile / link.profile overrides (a step probe's
    rescaled copies come after the calibrated ones); none named, or no file: None."""
    link = json.loads(TC.read_text())
    link["draft_step"]["ingest_s_per_byte"] = 3e-9  # as a rescale would scale it
    scaled = tmp_path / "tc.json"
    scaled.write_text(json.dumps(link))
    sim = [f"hardware.profile={HARDWARE}", f"link.profile={TC}", "codecs=[lynx]",
           f"link.profile={scaled}"]
    model = draft_model_of(sim, "smollm2-135m", 1536)
    assert model.ingest_s_per_byte == 3e-9 and model.busy_ratio == link["draft_step"]["busy_ratio"]
    assert draft_model_of(["codecs=[lynx]"], "smollm2-135m", 1536) is None
    assert draft_model_of([f"hardware.profile={tmp_path / 'none.json'}"], "smollm2-135m",
                          1536) is None


def test_a_resimulation_that_no_longer_drafts_clears_the_saved_keys():
    """With the run's scenario file and neither engine drafting now, the saved keys (which
    recompare would otherwise carry) are cleared."""
    plain = {"proposed_tokens": 0, "ttft_from_prefill_end_s": 0.2,
             "anchor_ready_from_prefill_end_s": 0.1}
    saved = {"first_draft_measured_s": 0.15, "first_draft_replayed_s": 0.10,
             "first_draft_simulated_s": 0.09}
    measured = {"per_request": [{**_request(), "proposed_tokens": 0}]}
    assert _first_draft_again(saved, plain, measured, DraftModel(2.0, 0.0, 0.0), False) == \
        dict.fromkeys(KEYS)
    assert _first_draft_again({}, plain, measured, DraftModel(2.0, 0.0, 0.0), False) == {}


def test_both_engines_timelines_give_the_first_draft_steps_end(tmp_path):
    """The simulator's decode timeline records its first draft step's end (the analytic
    one: the anchor plus one draft step), and the row gives it from prefill end; a request
    that does not draft has none."""
    from sim_receiver_scenario import receiver_scenario

    from kvsim.core.profiles import profile_path
    from kvsim.scenario.metrics import request_row
    from kvsim.scenario.speculative import speculative_decode

    tl = speculative_decode(1.0, 1.5, 0.1, 0.12, lambda n: 0.2, 8, lambda n: n, 4)
    assert tl.first_draft_t == pytest.approx(1.12)
    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["draft_step"] = {"ratio": 2.0}
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(doc))

    def record(codec):
        sc = receiver_scenario(f"codecs=[{codec}]", "deserializer=on_arrival",
                               "link.bandwidth_gbps=0.05", f"hardware.profile={measured}",
                               "speculative.draft_overhead_s=null")
        sc.run()
        return sc.records[0]

    lynx, int8 = record("lynx"), record("int8")
    assert lynx.timeline.proposed >= 1 and int8.timeline.proposed == 0
    assert lynx.timeline.first_draft_t == pytest.approx(
        lynx.timeline.start_t + lynx.timeline.draft_tpot_s, rel=1e-9)
    row = request_row(lynx, [1], 1)
    assert row["first_draft_from_prefill_end_s"] == pytest.approx(
        lynx.timeline.first_draft_t - lynx.prefill_end_t)
    assert math.isnan(request_row(int8, [1], 1)["first_draft_from_prefill_end_s"])
