"""deserializer=on_arrival: the transport receiver's default, a worker per request that
dequantizes each layer once its last message is in (kvsim.scenario.policy._layer_job_work), then
the decoder builds its cache (hardware profile `cache_build`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sim_receiver_scenario import receiver_scenario

from kvsim.core.profiles import profile_path
from kvsim.scenario.policy import build_plan


@pytest.mark.parametrize("policy", ["split_stream", "monolithic", "layerwise"])
def test_layer_jobs_put_each_layers_work_on_its_last_message(policy: str):
    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_arrival")
    shape = sc.model.kv_shape(1000)  # 4 pages of 256 tokens, the last one short
    table = sc.codec.size_table(shape)
    bf16_layer = 1000 * 2 * shape.kv_heads * shape.head_dim * 2
    t = sc.codec_timing
    plan = build_plan(table, shape, policy, t, layer_jobs=True, anchor_jobs=True)
    pages = table.chunk_bytes.shape[2]
    if policy == "split_stream":
        anchor, residual = plan.flows
        # messages are (layer, page) in layer-major order: the work sits on every 4th
        for flow, seconds in ((anchor, t.anchor_decode_s), (residual, t.decode_s)):
            want = np.zeros(len(flow.deserialize_s))
            want[pages - 1::pages] = seconds(bf16_layer)
            np.testing.assert_allclose(flow.deserialize_s, want, rtol=1e-12)
    else:  # one flow, (chunk, stream) order: the layer's last message is its residual's
        (flow,) = plan.flows
        want = np.zeros(len(flow.deserialize_s))
        want[2 * pages - 1::2 * pages] = t.decode_s(bf16_layer)
        np.testing.assert_allclose(flow.deserialize_s, want, rtol=1e-12)
    # without drafting no anchor job is planned
    plan = build_plan(table, shape, "split_stream", t, layer_jobs=True, anchor_jobs=False)
    assert not plan.flows[0].deserialize_s.any()


def test_layer_jobs_cost_the_fitted_fixed_part_plus_their_bytes():
    """With a calibrated layer-job fit a job costs fixed + bytes / rate (the anchor's with
    its own pair), on the same messages as without."""
    from dataclasses import replace

    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_arrival")
    shape = sc.model.kv_shape(1000)
    table = sc.codec.size_table(shape)
    bf16_layer = 1000 * 2 * shape.kv_heads * shape.head_dim * 2
    t = replace(sc.codec_timing, layer_job_fixed_s=0.004, layer_job_gb_per_s=0.5,
                anchor_layer_job_fixed_s=0.003, anchor_layer_job_gb_per_s=1.0)
    anchor, residual = build_plan(table, shape, "split_stream", t, layer_jobs=True,
                                  anchor_jobs=True).flows
    pages = table.chunk_bytes.shape[2]
    for flow, job_s in ((anchor, 0.003 + bf16_layer / 1e9), (residual, 0.004 + bf16_layer / 0.5e9)):
        want = np.zeros(len(flow.deserialize_s))
        want[pages - 1::pages] = job_s
        np.testing.assert_allclose(flow.deserialize_s, want, rtol=1e-12)


def test_monolithic_is_ready_one_layer_after_its_last_byte_on_a_slow_link():
    """At 0.05 Gbps a layer arrives far slower than it dequantizes, so every layer but the
    last is done before the next lands: the cache is usable one layer's dequantization
    after the last byte (on_demand: the whole cache's)."""
    bf16_layer = 1024 * 2 * 3 * 64 * 2
    got = {}
    for mode in ("on_arrival", "on_demand"):
        sc = receiver_scenario("codecs=[int8]", f"deserializer={mode}", "link.bandwidth_gbps=0.05")
        sc.run()
        rec = sc.records[0]
        got[mode] = rec.decode_start_t - rec.all_arrival_t
        layers = sc.model.layers
    layer_s = sc.codec_timing.decode_s(bf16_layer)
    assert got["on_arrival"] == pytest.approx(layer_s, rel=1e-9)
    assert got["on_demand"] == pytest.approx(layers * layer_s, rel=1e-9)


def test_cache_build_and_first_step_extra_delay_the_start(tmp_path):
    """A profile's cache_build and first_step_extra come between the dequantized cache and
    the first step; drafting on the anchor, the full cache's build precedes verification."""
    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["cache_build"] = {"gb_per_s": 0.05}  # 1024 tokens: 7.86 MB -> 0.157 s
    doc["first_step_extra"] = {"context_tokens": [256, 4096], "s": [0.01, 0.01]}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_arrival", "link.bandwidth_gbps=0.05",
                   f"hardware.profile={path}")
    sc.run()
    rec = sc.records[0]
    build = sc.model.kv_bytes_bf16(1024) / 0.05e9
    assert sc.timing.cache_build_s(1024) == pytest.approx(build, rel=1e-12)
    tl = rec.timeline
    assert tl.proposed >= 1  # the residual was still on the wire
    assert tl.start_t == pytest.approx(rec.needed_ready_t + build + 0.01, rel=1e-9)
    draft_end = tl.start_t + tl.proposed * sc.timing.tpot_s(1024)
    ready = max(draft_end, rec.full_ready_t)
    assert tl.verify_start_t == pytest.approx(ready + build, rel=1e-9)
    # a lone verification pass takes the profile's measured verify curve
    assert sc.timing.verify_measured
    assert tl.verify_s == pytest.approx(
        sc.timing.verify_s(tl.proposed, 1024), rel=1e-9)


def test_cache_build_must_be_a_positive_rate(tmp_path):
    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["cache_build"] = {"gb_per_s": float("nan")}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="cache_build.gb_per_s"):
        receiver_scenario("codecs=[int8]", "deserializer=on_arrival",
                          f"hardware.profile={path}").run()


def test_the_transports_receiver_modes_draft_plain_steps_plus_the_measured_contention(
        tmp_path):
    """on_arrival / on_demand build the anchor's cache before drafting: a draft is a decode
    step x the profile's draft_step ratio when no draft_overhead_s is configured, and a plain
    decode step without that measurement; the other deserializers keep their own model (the
    anchor's dequantization per draft, as the drafts read it); a configured overhead wins."""
    from kvsim.scenario.speculative import draft_overhead_s

    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc.pop("draft_step", None)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(doc))
    doc["draft_step"] = {"ratio": 2.0}
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(doc))

    def drafted(mode: str, profile, *extra: str):
        sc = receiver_scenario("codecs=[lynx]", f"deserializer={mode}",
                               "link.bandwidth_gbps=0.05", f"hardware.profile={profile}",
                               *extra)
        sc.run()
        tl = sc.records[0].timeline
        assert tl.proposed >= 1
        return sc, tl.draft_tpot_s

    unset = "speculative.draft_overhead_s=null"
    for mode in ("on_arrival", "on_demand"):
        sc, draft = drafted(mode, measured, unset)
        assert draft == pytest.approx(2.0 * sc.timing.tpot_s(1024), rel=1e-9)
        sc, draft = drafted(mode, plain, unset)
        assert draft == pytest.approx(sc.timing.tpot_s(1024), rel=1e-9)
    sc, draft = drafted("shared", measured, unset)
    plan = sc.plan(1024)
    anchor = draft_overhead_s(None, sc.codec_timing, sc.model.kv_bytes_bf16(1024),
                              plan.stream_bytes[0], plan.total_bytes, sc.hw.devices)
    assert anchor > 0
    assert draft == pytest.approx(sc.timing.tpot_s(1024) + anchor, rel=1e-9)
    sc, draft = drafted("on_arrival", measured)  # BASE: draft_overhead_s=0
    assert draft == pytest.approx(sc.timing.tpot_s(1024), rel=1e-9)


def test_a_link_profiles_draft_step_replaces_the_hardware_profiles(tmp_path):
    """A link profile measured with the receiver's draft step on that link (kvsim
    calibrate on tc) sets the drafts of a run with that link.profile, in the simulator and
    in the emulator's timing model (the HELLO's draft costs); a link profile without one,
    one measured with another model, or a run without a measured hardware profile keeps
    the hardware profile's. Its fields are checked like the hardware profile's; the
    emulator refuses a profile of another emulation."""
    from kvsim.calibrate import link_profile as lp
    from kvsim.core.compose import compose
    from kvsim.scenario.link_profile import draft_step_for, link_draft_step, load_link_profile
    from kvsim.transport import session
    from kvsim.transport.config import EmulateConfig

    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["draft_step"] = {"ratio": 2.0}
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(doc))
    link = {"version": 1, "kind": "link", "name": "l", "emulation": "tc", "efficiency": 1.0,
            "latency_s": 0.0, "message_overhead_bytes": 0.0}
    plain_link, tc_link = tmp_path / "plain-link.json", tmp_path / "tc-link.json"
    other_model = tmp_path / "other-model-link.json"
    lp.write_link_profile(link, plain_link)
    drafty = {"ratio": 3.0, "context_tokens": 1024, "model": "smollm2-135m",
              "ingest_s_per_byte": 3e-8}
    lp.write_link_profile({**link, "draft_step": drafty}, tc_link)
    lp.write_link_profile({**link, "draft_step": {**drafty, "model": "llama-3.1-8b"}},
                          other_model)

    def draft_s(link_path) -> tuple[float, float]:
        sc = receiver_scenario("codecs=[lynx]", "deserializer=on_arrival",
                               "link.bandwidth_gbps=0.05", f"hardware.profile={hw}",
                               f"link.profile={link_path}",
                               "speculative.draft_overhead_s=null")
        sc.run()
        tl = sc.records[0].timeline
        assert tl.proposed >= 1
        return tl.draft_tpot_s, sc.timing.tpot_s(1024)

    for path, ratio in ((plain_link, 2.0), (tc_link, 3.0), (other_model, 2.0)):
        draft, step = draft_s(path)
        assert draft == pytest.approx(ratio * step, rel=1e-9), path.name
    tc = load_link_profile(str(tc_link))
    assert tc.emulation == "tc" and tc.draft_step == drafty
    assert draft_step_for(tc, "smollm2-135m", str(hw)) == drafty
    assert draft_step_for(tc, "smollm2-135m", "") is None  # no measured hardware
    assert draft_step_for(load_link_profile(str(plain_link)), "smollm2-135m", str(hw)) is None
    assert link_draft_step("", "smollm2-135m", str(hw), "tc") is None
    with pytest.raises(ValueError, match="measured on emulation 'tc', but "
                                         "transport.emulation=token_bucket"):
        link_draft_step(str(tc_link), "smollm2-135m", str(hw), "token_bucket")

    def hello(*extra: str) -> dict:  # the emulator's first request, as it would be sent
        cfg, _ = compose("transport", [
            "model=smollm2-135m", "hardware=local-cpu", f"hardware.profile={hw}",
            "link=emulated", "link.bandwidth_gbps=0.05", "transport.emulation=tc",
            "transport.dequantize=on_arrival", "transport.kv_source=synthetic",
            "transport.decode=timing", "workload=emulated", "workload.context_tokens=1024",
            "codecs=[lynx]", "speculative.draft_overhead_s=null", *extra], EmulateConfig)
        return session.outgoing_requests(cfg, None)[0][0].hello

    step = receiver_scenario("codecs=[lynx]", f"hardware.profile={hw}").timing.tpot_s(1024)
    assert hello()["draft_overhead_s"] == pytest.approx(1.0 * step, rel=1e-9)
    assert hello(f"link.profile={tc_link}")["draft_overhead_s"] == \
        pytest.approx(2.0 * step, rel=1e-9)
    # the link's cost per later-stream byte goes to the receiver's timing decode too
    assert hello()["ingest_s_per_byte"] == 0.0
    assert hello(f"link.profile={tc_link}")["ingest_s_per_byte"] == pytest.approx(3e-8)
    for bad, field in (({"ratio": 0.5}, "draft_step.ratio"),
                       ({"ratio": 1.5, "busy_ratio": float("nan")}, "draft_step.busy_ratio"),
                       ({"ratio": 1.5, "ingest_s_per_byte": -1e-9},
                        "draft_step.ingest_s_per_byte"),
                       ({"busy_ratio": 2.0}, "draft_step.ratio"), ("fast", "draft_step.ratio")):
        lp.write_link_profile({**link, "draft_step": bad}, tc_link)
        with pytest.raises(ValueError, match=f"link profile .*tc-link.json: {field} must"):
            load_link_profile(str(tc_link))


def test_worker_busy_fraction_and_projected_link_completions():
    """By hand: jobs (finish, work) = (2, 1), (5, 2), (6, 0.5) from now = 1.5: busy
    0.5 + 2 + 0.5 s of [1.5, 6]; a lone flow's projection is the link's own arithmetic."""
    import simpy

    from kvsim.sim.link import Link
    from kvsim.sim.link_projection import project_link
    from kvsim.sim.worker_load import busy_fraction

    assert busy_fraction(1.5, np.array([2.0, 5.0, 6.0]), np.array([1.0, 2.0, 0.5])) == \
        pytest.approx(3.0 / 4.5, rel=1e-12)
    assert busy_fraction(7.0, np.array([2.0, 6.0]), np.array([1.0, 1.0])) == 0.0
    assert busy_fraction(0.0, np.empty(0), np.empty(0)) == 0.0
    env = simpy.Environment()
    link = Link(env, 8e-9 * 1000.0)  # 1000 bytes/s
    # 3 messages of 100 bytes released at 0, 0 and 0.5 s, then a moment into the run
    flow = link.submit(np.full(3, 100.0), np.array([0.0, 0.0, 0.5]))
    env.run(until=0.05)
    link.flush()
    np.testing.assert_allclose(project_link(link)[flow], [0.1, 0.2, 0.6], rtol=1e-12)
    env.run()
    np.testing.assert_allclose(flow.complete_t, [0.1, 0.2, 0.6], rtol=1e-12)


@pytest.mark.parametrize("gbps,ingest", [(0.05, 0.0), (1.0, 0.0), (0.05, 40e-9),
                                         (0.05, 300e-9)])
def test_drafts_slow_down_by_the_workers_projected_load_until_the_full_cache(
        tmp_path, gbps: float, ingest: float):
    """With draft_step.busy_ratio r in the profile, on arrival: drafts run at r x the
    decode step while the receiver is busy with the residual and at the step while it is
    idle, averaged over its busy share s from drafting's start to its last job (projected
    then; exact for a lone two-stream request, so it equals the share in the simulated
    schedule): step x r / (r (1 - s) + s); the overhead ends when the full cache is
    ready. With draft_step.ingest_s_per_byte c the receiver is also busy min(1, c x the
    residual's mean rate) while the residual arrives and the worker waits: checked here on
    a 10-us grid of that definition (40 ns/B at 6.25 MB/s: a quarter; 300 ns/B: fully
    busy while it arrives)."""
    from kvsim.sim.nodes import priority_server
    from kvsim.sim.worker_load import busy_fraction

    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["draft_step"] = {"ratio": 1.5, "busy_ratio": 3.0}
    if ingest:
        doc["draft_step"]["ingest_s_per_byte"] = ingest
    path = tmp_path / "busy.json"
    path.write_text(json.dumps(doc))
    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_arrival",
                           f"link.bandwidth_gbps={gbps}", f"hardware.profile={path}",
                           "speculative.draft_overhead_s=null")
    sent = []  # the request's receivers, kept for their arrival and ready times
    send = sc._send

    def keep(*args, **kwargs):
        out = send(*args, **kwargs)
        sent.append(out[0])
        return out

    sc._send = keep
    sc.run()
    tl = sc.records[0].timeline
    assert tl.proposed >= 1
    (receivers,) = sent
    # the worker's schedule as the simulator ran it (every arrival known after the run)
    works = [rx.plan.deserialize_s for rx in receivers]
    finish = priority_server([rx.arrival_t for rx in receivers], works)
    share = busy_fraction(tl.start_t, finish[1], works[1])
    if ingest:  # u(t) on a grid over [drafting start, the worker's last job]
        a0, a1 = float(receivers[0].arrival_t.max()), float(receivers[1].arrival_t.max())
        rate = float(receivers[1].plan.sizes_bytes.sum()) / (a1 - a0)  # B/s
        t = np.arange(tl.start_t, float(finish[1].max()), 1e-5) + 5e-6
        job = np.zeros(len(t), dtype=bool)
        for f, w in zip(finish[1], works[1], strict=True):
            job |= (t >= f - w) & (t < f)
        u = np.where(job, 1.0, np.where((t >= a0) & (t < a1), min(1.0, ingest * rate), 0.0))
        assert float(u.mean()) > share + 0.1  # the bytes' share counts
        share = float(u.mean())
        # (to the grid's resolution: a job starting where the residual ends can fall
        # between two 10-us points)
        assert share == pytest.approx(1.0, abs=1e-4) if ingest * rate >= 1 else share < 1.0
    assert 0.0 < share <= 1.0
    tpot = sc.timing.tpot_s(1024)
    # busy_ratio 3: steps of 3 x tpot while busy, tpot while idle, weighted by steps made
    draft = tpot * 3.0 / (3.0 * (1.0 - share) + share)
    full_t = max(rx.ready_t for rx in receivers)  # the worker's last job (+ nothing)
    last_start = tl.start_t + (tl.proposed - 1) * draft  # earlier drafts: before full_t
    assert last_start <= full_t
    draft_end = max(t1 for kind, _t0, t1 in tl.segments if kind.startswith("draft"))
    # the draft in progress when the full cache is ready finishes at the plain step
    left = 1.0 - (full_t - last_start) / draft  # of a step
    rel = 1e-3 if ingest else 1e-9  # the grid's resolution
    assert draft_end == pytest.approx(full_t + left * tpot, rel=rel)
    if tl.proposed > 1:
        assert tl.token_t[0] - tl.start_t == pytest.approx(draft, rel=rel)


def test_busy_draft_overhead_weights_the_busy_ratio_by_steps_made():
    """By hand: r = 3 (overhead 2 x 0.1 s), busy half the time: in 1 s, 0.5 s idle make 5
    steps and 0.5 s busy make 5/3, so a step takes 1 / (20/3) = 0.15 s: 0.05 s overhead."""
    from kvsim.scenario.speculative import busy_share_overhead_s

    assert busy_share_overhead_s(0.2, 0.1, 0.5) == pytest.approx(0.05, rel=1e-12)
    assert busy_share_overhead_s(0.2, 0.1, 1.0) == pytest.approx(0.2, rel=1e-12)
    assert busy_share_overhead_s(0.2, 0.1, 0.0) == 0.0


def test_a_configured_draft_overhead_wins_over_the_busy_ratio(tmp_path):
    """The seeds' pin (speculative.draft_overhead_s=0) drafts at the plain step even with a
    profile that measured draft_step.busy_ratio."""
    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["draft_step"] = {"ratio": 1.5, "busy_ratio": 3.0}
    path = tmp_path / "busy.json"
    path.write_text(json.dumps(doc))
    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_arrival",
                           "link.bandwidth_gbps=0.05", f"hardware.profile={path}")
    sc.run()
    tl = sc.records[0].timeline
    assert tl.proposed > 1
    assert tl.token_t[0] - tl.start_t == pytest.approx(sc.timing.tpot_s(1024), rel=1e-9)


def test_both_engines_slow_drafts_by_the_busy_ratio_under_one_rule(tmp_path):
    """receiver_busy_draft_s (the simulator's _decode and the emulator's HELLO): (busy_ratio
    - 1) x TPOT on arrival with no configured overhead and a profile that measured it;
    None for the other receiver modes, a configured overhead or a profile without it."""
    from kvsim.scenario.speculative import receiver_busy_draft_s

    def timing_from(doc: dict):
        path = tmp_path / "hw.json"
        path.write_text(json.dumps(doc))
        return receiver_scenario("codecs=[lynx]", "deserializer=on_arrival",
                                 f"hardware.profile={path}").timing

    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["draft_step"] = {"ratio": 1.5, "busy_ratio": 3.0}
    timing = timing_from(doc)
    assert receiver_busy_draft_s("on_arrival", None, timing, 1024) == \
        pytest.approx(2.0 * timing.tpot_s(1024), rel=1e-12)
    assert receiver_busy_draft_s("on_demand", None, timing, 1024) is None
    assert receiver_busy_draft_s("on_arrival", 0.0, timing, 1024) is None
    doc["draft_step"] = {"ratio": 1.5}
    assert receiver_busy_draft_s("on_arrival", None, timing_from(doc), 1024) is None


def test_a_codec_whose_layers_do_not_decode_alone_falls_back_to_on_demand():
    """As the transport's receiver (kvsim.transport.assembly), on arrival is on demand for
    CacheGen, whose layers do not decode alone: the same timeline as deserializer=on_demand,
    and the row says which mode ran; a layer-independent codec keeps on arrival."""
    rows = {}
    for mode in ("on_arrival", "on_demand"):
        sc = receiver_scenario("codecs=[cachegen]", f"deserializer={mode}",
                               "link.bandwidth_gbps=0.05")
        rows[mode] = sc.run()
        assert sc.deserializer == "on_demand"
    assert rows["on_arrival"]["dequantize"] == "on_demand"
    for key in ("ttft_s", "full_ready_from_prefill_end_s", "ttft_committed_s"):
        assert rows["on_arrival"][key] == rows["on_demand"][key]
    sc = receiver_scenario("codecs=[int8]", "deserializer=on_arrival")
    assert sc.run()["dequantize"] == "on_arrival"
