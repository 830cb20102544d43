"""On a host that runs both ends: the on-arrival worker's pace (kvsim.calibrate.worker_pace,
kvsim.sim.nodes.WorkPace: the work clock by hand, the paced server against the plain one, the
fit recovering known terms exactly from synthetic jobs, the link profile's checks, a
simulated request whose worker is paced) and the encoder's (kvsim.calibrate.encoder_pace)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvsim.calibrate import link_profile as lp
from kvsim.calibrate.worker_pace import MIN_ALONE_JOBS, MIN_JOBS, fit, job_samples, pace_entry
from kvsim.core.profiles import profile_path
from kvsim.scenario.codec_timing import CodecTiming
from kvsim.scenario.link_profile import load_link_profile, worker_pace_for
from kvsim.sim.nodes import WorkPace, priority_server, worker_server
from tests.sim_receiver_scenario import receiver_scenario
from tests.worker_pace_rows import flat_lynx_timing, paced_rows


def test_the_work_clock_by_hand():
    """Over [1, 3] s a job runs at half speed (extra 1): the clock advances 1 there, slope 1
    elsewhere; overlapping spans add their extras; from_work is to_work's inverse."""
    pace = WorkPace(1.0, [(1.0, 3.0, 1.0)])
    t = np.array([0.5, 1.0, 2.0, 3.0, 5.0])
    assert pace.to_work(t) == pytest.approx([0.5, 1.0, 1.5, 2.0, 4.0], abs=1e-12)
    assert pace.from_work(pace.to_work(t)) == pytest.approx(t, abs=1e-12)
    both = WorkPace(1.0, [(0.0, 2.0, 1.0), (1.0, 3.0, 2.0)])  # x2, x4, x3 on [0,1,2,3]
    assert both.to_work(np.array([1.0, 2.0, 3.0])) == pytest.approx(
        [0.5, 0.75, 0.75 + 1 / 3], abs=1e-12)
    plain = WorkPace(1.0, [(1.0, 1.0, 5.0), (0.0, 2.0, 0.0)])  # empty or no extra: no span
    assert plain.to_work(t) is t and plain.from_work(t) is t
    for alone, spans in ((0.0, []), (1.0, [(2.0, 1.0, 1.0)]), (1.0, [(0.0, 1.0, -0.5)])):
        with pytest.raises(ValueError, match="a worker's pace needs"):
            WorkPace(alone, spans)


def test_a_paced_server_by_hand_and_against_the_plain_one():
    """Two jobs of 0.5 s of work arriving at 0 and 0.1 s, half speed over [0, 1] s: the
    first takes all of [0, 1], the second starts at 1 and ends at 1.5. Without a pace the
    server is priority_server; `alone` alone scales every job's length."""
    arrivals, works = [np.array([0.0, 0.1])], [np.array([0.5, 0.5])]
    start, finish = worker_server(arrivals, works, WorkPace(1.0, [(0.0, 1.0, 1.0)]))
    assert start[0] == pytest.approx([0.0, 1.0]) and finish[0] == pytest.approx([1.0, 1.5])
    # straddling the span's end: 10 ms of work from 5 ms before it does 2.5 ms there
    _, late = worker_server([np.array([0.995])], [np.array([0.01])],
                            WorkPace(1.0, [(0.0, 1.0, 1.0)]))
    assert late[0] == pytest.approx([0.995 + 0.005 + 0.0075], abs=1e-12)
    start, finish = worker_server(arrivals, works, None)
    assert finish[0] == pytest.approx([0.5, 1.0]) and start[0] == pytest.approx([0.0, 0.5])
    two = [np.array([0.0, 0.2, 0.9]), np.array([0.05, 0.3])]  # two classes, anchor first
    jobs = [np.array([0.1, 0.3, 0.2]), np.array([0.4, 0.1])]
    _, doubled = worker_server(two, jobs, WorkPace(2.0, []))
    for got, want in zip(doubled, priority_server(two, [2 * w for w in jobs]), strict=True):
        assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("truth", [(0.7, 0.5, 0.4), (1.0, 0.0, 0.0), (0.8, 0.3, 0.0)])
def test_the_fit_recovers_known_terms_exactly(truth):
    base_s = 0.004
    timing = CodecTiming(1.0, 1.0, "assumed", layer_job_fixed_s=base_s, layer_job_gb_per_s=1e9,
                         anchor_layer_job_fixed_s=base_s, anchor_layer_job_gb_per_s=1e9)
    rows = paced_rows(truth, base_s) + [{"status": "error", "trace_spans": []},
                                   {"status": "done", "dequantize": "on_demand"}]
    samples = job_samples(rows, lambda row: timing, lambda tokens: 0.0)
    assert samples.requests == 4 and samples.rates_gbps == (0.3, 0.8)
    assert set(np.round(samples.encoder_share, 12)) <= {0.0, 1.0}
    got = fit(samples)
    assert (got.alone, got.encoder, got.ingest) == pytest.approx(truth, abs=1e-9)
    assert got.jobs == 48 and got.rms_s < 1e-12 and got.alone_jobs == 16
    # with fewer jobs after both spans than MIN_ALONE_JOBS, one joint fit: as exact here
    three = fit(job_samples(paced_rows(truth, base_s, requests=3), lambda row: timing,
                            lambda tokens: 0.0))
    assert 3 * 4 < MIN_ALONE_JOBS and three.alone_jobs == 0
    assert (three.alone, three.encoder, three.ingest) == pytest.approx(truth, abs=1e-9)
    entry = pace_entry(rows, lambda row: timing, lambda tokens: 0.0, "smollm2-135m")
    assert entry["model"] == "smollm2-135m" and entry["requests"] == 4
    # too few jobs (12 < MIN_JOBS), or one rate only: no fit
    assert pace_entry(rows[:1], lambda row: timing, lambda tokens: 0.0, "m") is None
    assert pace_entry(rows[0::2], lambda row: timing, lambda tokens: 0.0, "m") is None
    assert len(rows[0::2]) * 12 >= MIN_JOBS


def test_alone_is_the_median_of_the_jobs_after_both_spans(monkeypatch):
    """Two disturbed jobs after both spans (5x as long): `alone` from their median stays
    exact, and so do the other two terms (those jobs add nothing to their least squares);
    the joint fit of all three follows the disturbed jobs."""
    import kvsim.calibrate.worker_pace as wp

    truth, base_s = (0.7, 0.5, 0.4), 0.004
    timing = CodecTiming(1.0, 1.0, "assumed", layer_job_fixed_s=base_s, layer_job_gb_per_s=1e9,
                         anchor_layer_job_fixed_s=base_s, anchor_layer_job_gb_per_s=1e9)
    rows = paced_rows(truth, base_s)
    for row in rows[:2]:  # each request's last job (after both spans, at 0.8 s)
        name, process, start, end = row["trace_spans"][-1]
        row["trace_spans"][-1] = [name, process, start, start + 5 * (end - start)]
    samples = job_samples(rows, lambda row: timing, lambda tokens: 0.0)
    got = fit(samples)
    assert got.alone_jobs == 16
    assert (got.alone, got.encoder, got.ingest) == pytest.approx(truth, abs=1e-9)
    monkeypatch.setattr(wp, "MIN_ALONE_JOBS", 10**6)
    joint = fit(samples)
    assert joint.alone_jobs == 0 and joint.alone > truth[0] + 0.1


def _link(tmp_path, name: str, **fields) -> str:
    doc = {"version": 1, "kind": "link", "name": name, "emulation": "token_bucket",
           "efficiency": 1.0, "latency_s": 0.0, "message_overhead_bytes": 0.0, **fields}
    return str(lp.write_link_profile(doc, tmp_path / f"{name}.json"))


def test_the_link_profile_checks_its_worker_pace(tmp_path):
    pace = {"alone": 0.8, "encoder": 0.5, "ingest": 0.4, "model": "smollm2-135m"}
    prof = load_link_profile(_link(tmp_path, "ok", worker_pace=pace))
    assert prof.worker_pace == pace
    assert worker_pace_for(prof, "smollm2-135m", "hw.json") == pace
    assert worker_pace_for(prof, "smollm2-135m", "") is None  # no measured hardware
    assert worker_pace_for(prof, "llama-3.1-8b", "hw.json") is None  # another model's
    assert load_link_profile(_link(tmp_path, "none")).worker_pace is None
    for bad, field in (({**pace, "alone": 0.0}, "alone"), ({**pace, "encoder": -0.1}, "encoder"),
                       ({**pace, "ingest": float("nan")}, "ingest"),
                       ({"alone": 1.0, "encoder": 0.1}, "ingest")):
        with pytest.raises(ValueError, match=f"worker_pace.{field} must"):
            load_link_profile(_link(tmp_path, "bad", worker_pace=bad))
    with pytest.raises(ValueError, match="worker_pace must be an object"):
        load_link_profile(_link(tmp_path, "bad", worker_pace=[1.0]))


def test_a_simulated_worker_at_its_links_pace(tmp_path):
    """lynx on arrival over a 10 Gbps link (its worker falls behind the encoder): a pace of
    1, 0, 0 changes no time at all; a slower worker alone, beside its encoder or while its
    bytes arrive, makes the anchor (and the full cache) later; bf16 (monolithic) is released
    after its encoder, so the encoder's extra alone leaves it as it was."""
    hw = tmp_path / "hw.json"
    hw.write_text(profile_path("hardware", "local-smollm2-135m").read_text())

    def ready(codec: str, pace: dict | None) -> tuple[float, float]:
        link = _link(tmp_path, f"l{len(list(tmp_path.iterdir()))}",
                     **({"worker_pace": pace} if pace else {}))
        sc = receiver_scenario(f"codecs=[{codec}]", "deserializer=on_arrival",
                               "link.bandwidth_gbps=10.0", f"hardware.profile={hw}",
                               f"link.profile={link}")
        sc.run()
        rec = sc.records[0]
        return rec.needed_ready_t, rec.full_ready_t

    plain = ready("lynx", None)
    assert ready("lynx", {"alone": 1.0, "encoder": 0.0, "ingest": 0.0}) == \
        pytest.approx(plain, abs=1e-12)
    slow = ready("lynx", {"alone": 1.5, "encoder": 0.0, "ingest": 0.0})
    beside = ready("lynx", {"alone": 1.0, "encoder": 1.0, "ingest": 0.0})
    assert slow[0] > plain[0] and slow[1] > plain[1] and beside[0] > plain[0]
    mono = ready("bf16", None)
    assert ready("bf16", {"alone": 1.0, "encoder": 3.0, "ingest": 0.0}) == \
        pytest.approx(mono, abs=1e-12)
    taking_in = ready("lynx", {"alone": 1.0, "encoder": 0.0, "ingest": 1.0})
    assert taking_in[0] > plain[0] and taking_in[1] > plain[1]


def test_calibration_fits_each_links_pace_against_its_codec_timing(tmp_path):
    """kvsim calibrate's step (pipeline._worker_pace): a link's request rows, timed against
    the codec timing file just written (each job's base: its layer's bytes at that model's
    shape), give the profile entry; no rows, none."""
    from kvsim.calibrate.pipeline import Config, _timing_of, _worker_pace
    from kvsim.model.spec import ModelSpec

    model = ModelSpec(name="tiny", layers=4, attention_heads=4, kv_heads=2, head_dim=64,
                      hidden_size=256, params_total=1e8, params_active=1e8)
    timing = flat_lynx_timing(tmp_path / "timing.json", model)  # 4 ms jobs at 1024 tokens
    cfg = Config(model=model)
    timing_of = _timing_of(cfg, timing)
    got = _worker_pace(cfg, paced_rows((0.7, 0.5, 0.4), 0.004), timing_of)
    assert (got["alone"], got["encoder"], got["ingest"]) == pytest.approx((0.7, 0.5, 0.4),
                                                                        abs=1e-9)
    assert got["model"] == "tiny" and got["rates_gbps"] == [0.3, 0.8]
    assert _worker_pace(cfg, [], timing_of) is None


def test_the_encoders_pace_per_rate_and_in_the_simulator(tmp_path):
    """A link's encoder pace: per rate, the median over pipelined requests of the encoder's
    work over the codec timing's (monolithic, failed and untimed requests left out; one rate
    only: none); between its rates the simulator's ratio is interpolated, beyond them held,
    and it scales a split-stream request's encode times, not a monolithic one's."""
    from kvsim.calibrate.encoder_pace import pace_entry as encoder_entry
    from kvsim.scenario.link_profile import encoder_pace_for, encoder_ratio

    timing = CodecTiming(0.5, 1.0, "assumed")  # 1 GB of bf16 cache: 2 s of encoding
    rows = [{"status": "done", "transfer": "split_stream", "context_tokens": 1000,
             "bandwidth_gbps": rate, "encode_work_s": work}
            for rate, work in ((0.3, 2.0), (0.3, 2.4), (0.3, 2.2), (0.8, 3.0), (0.8, 3.4))]
    rows += [{"status": "done", "transfer": "monolithic", "context_tokens": 1000,
              "bandwidth_gbps": 1.0, "encode_work_s": 9.0},
             {"status": "error", "transfer": "split_stream", "bandwidth_gbps": 1.0},
             {"status": "done", "transfer": "layerwise", "context_tokens": 1000,
              "bandwidth_gbps": 1.0, "encode_work_s": float("nan")}]
    got = encoder_entry(rows, lambda row: timing, lambda tokens: 1e6 * tokens, "m")
    assert got["rates_gbps"] == [0.3, 0.8] and got["requests"] == [3, 2]
    assert got["ratio"] == pytest.approx([1.1, 1.6])
    assert encoder_entry(rows[:3], lambda row: timing, lambda t: 1e6 * t, "m") is None
    assert [encoder_ratio(got, r) for r in (0.1, 0.3, 0.55, 0.8, 5.0)] == \
        pytest.approx([1.1, 1.1, 1.35, 1.6, 1.6])
    hw = tmp_path / "hw.json"
    hw.write_text(profile_path("hardware", "local-smollm2-135m").read_text())
    paced = _link(tmp_path, "enc", encoder_pace={**got, "model": "smollm2-135m"})
    assert encoder_pace_for(load_link_profile(paced), "smollm2-135m", str(hw)) is not None
    assert encoder_pace_for(load_link_profile(paced), "smollm2-135m", "") is None
    plain = _link(tmp_path, "plain")

    def encode_s(codec: str, link: str, rate: float) -> float:
        sc = receiver_scenario(f"codecs=[{codec}]", f"link.bandwidth_gbps={rate}",
                               f"hardware.profile={hw}", f"link.profile={link}")
        return float(sc.plan(1024).encode_cum_s[-1])

    assert encode_s("lynx", paced, 0.55) == pytest.approx(1.35 * encode_s("lynx", plain, 0.55),
                                                          rel=1e-12)
    assert encode_s("int8", paced, 0.55) == encode_s("int8", plain, 0.55)  # monolithic
    for bad in ({"rates_gbps": [0.3], "ratio": [1.0]},
                {"rates_gbps": [0.8, 0.3], "ratio": [1.0, 1.2]},
                {"rates_gbps": [0.3, 0.8], "ratio": [1.0, 0.0]},
                {"rates_gbps": [0.3, 0.8], "ratio": [1.0]}, [1.0]):
        with pytest.raises(ValueError, match="encoder_pace needs rates_gbps"):
            load_link_profile(_link(tmp_path, "bad", encoder_pace=bad))


@pytest.mark.parametrize("gbps", [0.2, 1.0])
def test_drafts_slow_down_by_the_paced_workers_load(tmp_path, gbps: float):
    """With draft_step.busy_ratio 3 and a worker pace, drafts run at 3 x the decode step
    while the paced worker is busy with the residual: over its busy share s of the time from
    drafting's start to its last job, as the paced server (worker_server) ran it, a draft
    takes step x 3 / (3 (1 - s) + s) (exact for a lone request); the paced worker is busy
    a larger share than the unpaced one would be."""
    from kvsim.sim.worker_load import busy_fraction

    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["draft_step"] = {"ratio": 1.5, "busy_ratio": 3.0}
    hw = tmp_path / "busy.json"
    hw.write_text(json.dumps(doc))
    link = _link(tmp_path, "paced", worker_pace={"alone": 2.0, "encoder": 0.5, "ingest": 0.3})
    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_arrival",
                           f"link.bandwidth_gbps={gbps}", f"hardware.profile={hw}",
                           f"link.profile={link}", "speculative.draft_overhead_s=null")
    sent, paces = [], []
    send, make_pace = sc._send, sc._worker_pace

    def keep(*args, **kwargs):
        out = send(*args, **kwargs)
        sent.append(out[0])
        return out

    def keep_pace(*args, **kwargs):
        paces.append(make_pace(*args, **kwargs))
        return paces[-1]

    sc._send, sc._worker_pace = keep, keep_pace
    sc.run()
    tl = sc.records[0].timeline
    (receivers,), (pace,) = sent, paces
    arrivals = [rx.arrival_t for rx in receivers]
    works = [rx.plan.deserialize_s for rx in receivers]
    start, finish = worker_server(arrivals, works, pace)
    share = busy_fraction(tl.start_t, finish[1], finish[1] - start[1])
    plain = priority_server(arrivals, works)
    assert share > busy_fraction(tl.start_t, plain[1], works[1])
    assert 0.0 < share <= 1.0 and tl.proposed >= 1
    draft = sc.timing.tpot_s(1024) * 3.0 / (3.0 * (1.0 - share) + share)
    if tl.proposed > 1:
        assert tl.token_t[0] - tl.start_t == pytest.approx(draft, rel=1e-9)
    else:  # one draft, the full cache ready during it: it finishes at the plain step
        full_t = max(rx.ready_t for rx in receivers)
        assert full_t == pytest.approx(float(finish[1][-1]), abs=1e-12)
        left = 1.0 - (full_t - tl.start_t) / draft
        draft_end = max(t1 for kind, _t0, t1 in tl.segments if kind.startswith("draft"))
        assert draft_end == pytest.approx(full_t + left * sc.timing.tpot_s(1024), rel=1e-9)
