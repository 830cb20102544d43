"""Measured link profiles: the fit recovers known parameters exactly, the loader refuses bad
files clearly, a profile changes the simulator's link exactly as its numbers say (analytic:
one flow of B bytes at R Gbps x efficiency with latency d arrives at d + 8B/(R eff 1e9)), and
one real token-bucket measurement (`slow`: real processes, a few seconds) fits a goodput
near the rate."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import simpy

from kvsim.calibrate import link_profile as lp
from kvsim.model.hardware import HardwareSpec
from kvsim.model.spec import ModelSpec
from kvsim.scenario.config import LinkConfig, SimConfig
from kvsim.scenario.link_profile import LinkProfile, load_link_profile, profiled_link_settings
from kvsim.scenario.variants import variants
from kvsim.sim.link import Link
from kvsim.sim.run import Scenario

MODEL = ModelSpec(name="tiny", layers=4, attention_heads=4, kv_heads=2, head_dim=64,
                  hidden_size=256, params_total=1e8, params_active=1e8)
HW = HardwareSpec(name="test", hbm_gb_per_s=100.0, bf16_tflops=10.0, memory_gb=100.0)


def _synthetic(fit: lp.LinkFit) -> list[lp.Measurement]:
    """Exact model times for two message sizes x two durations x two rates."""
    out = []
    for rate in (0.1, 1.0):
        for payload, messages in ((1e6, 1), (8e6, 8), (1e6, 64), (8e6, 512)):
            scaled = payload * rate  # bigger transfers at the faster rate, as measured
            out.append(lp.Measurement(rate, scaled, messages,
                                      fit.predict_s(rate, scaled, messages)))
    return out


@pytest.mark.parametrize("truth", [lp.LinkFit(0.956, 0.0021, 80.0),
                                   lp.LinkFit(1.0, 0.0, 0.0),
                                   lp.LinkFit(0.5, 0.01, 16.0)])
def test_fit_recovers_known_parameters_exactly(truth):
    ms = _synthetic(truth)
    got = lp.fit_link(ms)
    assert got.efficiency == pytest.approx(truth.efficiency, rel=1e-9)
    assert got.latency_s == pytest.approx(truth.latency_s, rel=1e-9, abs=1e-12)
    assert got.message_overhead_bytes == pytest.approx(truth.message_overhead_bytes,
                                                       rel=1e-9, abs=1e-6)
    doc = lp.profile_doc("synthetic", "tc", [0.1, 1.0], ms, command="test")
    assert doc["fit_max_abs_pct_error"] < 1e-7
    for m in doc["measurements"]:
        assert m["predicted_s"] == pytest.approx(m["measured_s"], rel=1e-9)


def test_fit_keeps_latency_and_overhead_non_negative():
    # times a little shorter than a zero-latency link would give: the free fit wants a
    # negative latency; the kept fit pins it at 0
    truth = lp.LinkFit(1.0, 0.0, 0.0)
    ms = _synthetic(truth)
    for m in ms:
        m.measured_s -= 1e-4
    got = lp.fit_link(ms)
    assert got.latency_s >= 0.0 and got.message_overhead_bytes >= 0.0
    assert got.efficiency == pytest.approx(1.0, rel=0.01)


def test_fit_refuses_too_few_or_degenerate_or_impossible_measurements():
    with pytest.raises(ValueError, match="at least 3"):
        lp.fit_link(_synthetic(lp.LinkFit(1.0, 0.0, 0.0))[:2])
    # one shape repeated: payload, messages and the constant cannot be told apart
    same = [lp.Measurement(1.0, 1e6, 10, 0.01) for _ in range(4)]
    with pytest.raises(ValueError, match="do not determine"):
        lp.fit_link(same)
    # four times faster than the rate: no link
    fast = _synthetic(lp.LinkFit(4.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="outside"):
        lp.fit_link(fast)
    bad = _synthetic(lp.LinkFit(1.0, 0.0, 0.0))
    bad[0].measured_s = math.nan
    with pytest.raises(ValueError, match="measured_s must be finite"):
        lp.fit_link(bad)


def test_control_frame_constant_matches_the_protocol():
    from kvsim.bench.transport import FRAME_OVERHEAD_BYTES
    from kvsim.kernels import wire
    from kvsim.transport import protocol

    assert lp.CONTROL_FRAME_BYTES == protocol.CONTROL_BYTES
    assert lp.CONTROL_FRAME_BYTES == FRAME_OVERHEAD_BYTES - wire.CHUNK_HEADER_BYTES


def _profile_file(tmp_path, **fields) -> str:
    doc = {"version": 1, "kind": "link", "name": "p", "emulation": "tc", "efficiency": 0.5,
           "latency_s": 0.0, "message_overhead_bytes": 0.0, "source": "measured", **fields}
    path = tmp_path / "p.json"
    lp.write_link_profile(doc, path)
    return str(path)


def test_loader_reads_a_written_profile(tmp_path):
    ms = _synthetic(lp.LinkFit(0.9, 0.003, 40.0))
    path = lp.write_link_profile(lp.profile_doc("x", "token_bucket", [0.1, 1.0], ms),
                                 tmp_path / "x.json")
    prof = load_link_profile(str(path))
    assert prof.name == "x" and prof.path == str(path)
    assert prof.efficiency == pytest.approx(0.9, rel=1e-9)
    assert prof.latency_s == pytest.approx(0.003, rel=1e-9)
    assert prof.message_overhead_bytes == pytest.approx(40.0, rel=1e-9)


@pytest.mark.parametrize("fields, message", [
    ({"kind": "hardware"}, "kind must be 'link'"),
    ({"version": 2}, "version must be 1"),
    ({"efficiency": math.nan}, "efficiency must be finite"),
    ({"latency_s": math.inf}, "latency_s must be finite"),
    ({"efficiency": 0.0}, r"efficiency must be in \(0"),
    ({"efficiency": 1.5}, "efficiency must be in"),
    ({"latency_s": -0.1}, "latency_s must be in"),
    ({"message_overhead_bytes": "64"}, "message_overhead_bytes must be a number"),
    ({"emulation": "netem"}, "emulation must be one of"),
])
def test_loader_refuses_bad_fields(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        load_link_profile(_profile_file(tmp_path, **fields))


def test_loader_refuses_missing_files_and_names(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_link_profile(str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="no link profile named"):
        load_link_profile("no-such-profile")
    with pytest.raises(ValueError, match="link.profile: .*not found"):
        LinkConfig(profile=str(tmp_path / "absent.json")).validate()
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_link_profile(str(broken))


def test_shipped_link_profiles_load():
    from kvsim.core.profiles import PROFILE_DIR

    shipped = sorted((PROFILE_DIR / "link").glob("*.json"))
    assert shipped  # `kvsim calibrate out_dir=data/profiles` ships them
    for path in shipped:
        prof = load_link_profile(path.stem)
        assert 0.5 < prof.efficiency <= 1.2 and prof.latency_s >= 0


def test_profile_settings_one_flow_arrives_at_the_analytic_time():
    prof = LinkProfile(efficiency=0.8, latency_s=0.004, message_overhead_bytes=100.0,
                       name="p", path="p.json")
    rate_gbps, cfg_latency_s, cfg_overhead = 10.0, 0.001, 28.0
    settings = profiled_link_settings(rate_gbps, cfg_latency_s, cfg_overhead,
                                      [[1.0, 5.0]], prof)
    assert settings["trace"] == [[1.0, 4.0]]  # a trace's rates scale alike
    assert profiled_link_settings(rate_gbps, cfg_latency_s, cfg_overhead, [], None) == {
        "bandwidth_gbps": rate_gbps, "latency_s": cfg_latency_s,
        "message_overhead_bytes": cfg_overhead, "trace": []}
    settings["trace"] = []
    env = simpy.Environment()
    link = Link(env, **settings)
    payload, messages = 4e6, 4
    got = []
    link.submit(np.full(messages, payload / messages), np.zeros(messages),
                on_done=lambda f: got.append(float(f.arrival_t()[-1])))
    env.run()
    wire_bytes = payload + messages * (cfg_overhead + 100.0)
    assert got[0] == pytest.approx(0.005 + 8 * wire_bytes / (rate_gbps * 0.8 * 1e9), rel=1e-12)


def _scenario(tmp_path, bandwidth_gbps: float, codecs=("bf16", "lynx"),
              contexts=(1000, 3000), transfer: str = "seeds", **link) -> list:
    """Per codec: (the row's link_profile, per request (encode end, needed arrival, all
    arrived, last token), the scenario) of requests arriving 10 ms apart."""
    timing = tmp_path / "timing.json"
    entry = {"encode_gb_per_s": 50.0, "decode_gb_per_s": 25.0, "source": "assumed",
             "assumption": "test"}
    timing.write_text(json.dumps({"version": 1, "hardware": "test", "default": entry}))
    cfg = SimConfig(model=MODEL, hardware=HW, codecs=list(codecs), codec_timing=str(timing),
                    transfer=transfer)  # seeds: one-stream codecs monolithic
    cfg.link = replace(cfg.link, bandwidth_gbps=bandwidth_gbps, **link)
    cfg.workload = replace(cfg.workload, kind="trace",
                           arrivals_t=[0.01 * i for i in range(len(contexts))],
                           arrivals_context_tokens=list(contexts), output_tokens=8)
    out = []
    for v in variants(cfg):
        sc = Scenario(cfg, v, contexts[0], bandwidth_gbps)
        row = sc.run()
        recs = sorted(sc.records, key=lambda r: r.seq)
        out.append((row["link_profile"], [(r.encode_end_t, r.needed_arrival_t,
                                           r.all_arrival_t, float(r.timeline.token_t[-1]))
                                          for r in recs], sc))
    return out


def test_sim_with_a_half_efficiency_profile_is_a_half_rate_link(tmp_path):
    path = _profile_file(tmp_path, efficiency=0.5, latency_s=0.003,
                         message_overhead_bytes=64.0)
    profiled = _scenario(tmp_path, 10.0, profile=path, latency_s=0.001,
                         message_overhead_bytes=16.0)
    plain = _scenario(tmp_path, 5.0, latency_s=0.004, message_overhead_bytes=80.0)
    assert [p[0] for p in profiled] == [path, path] and [p[0] for p in plain] == ["", ""]
    assert [p[1] for p in profiled] == [p[1] for p in plain]  # exactly: the same floats


def test_sim_with_a_profile_one_flow_arrives_at_the_analytic_time(tmp_path):
    # one bf16 request, monolithic: one flow released at the encoder's end, alone on the
    # link: last byte arrives at d + 8 (B + n overhead) / (R eff 1e9)
    path = _profile_file(tmp_path, efficiency=0.5, latency_s=0.003,
                         message_overhead_bytes=64.0)
    ((name, [(encode_end_t, _, all_arrival_t, _)], sc),) = _scenario(
        tmp_path, 10.0, codecs=("bf16",), contexts=(1000,), profile=path, latency_s=0.001,
        message_overhead_bytes=16.0)
    plan = sc.plan(1000)
    (flow,) = plan.flows
    payload, messages = float(flow.sizes_bytes.sum()), flow.sizes_bytes.size
    expect = encode_end_t + 0.004 + 8 * (payload + messages * 80.0) / (10.0 * 0.5 * 1e9)
    assert all_arrival_t == pytest.approx(expect, rel=1e-12)


def test_handshake_delays_every_time_of_a_request_by_itself_exactly(tmp_path):
    """A transfer's handshake holds its encoder back from prefill end: alone on its link,
    the request's encode end, arrivals and tokens all move by exactly the handshake; a
    profile's handshake adds to the link's."""
    path = _profile_file(tmp_path, efficiency=0.5, handshake_s=0.003)
    for codec in ("bf16", "lynx"):  # monolithic and split-stream
        plain = _scenario(tmp_path, 10.0, codecs=(codec,), contexts=(1000,), profile=path,
                          handshake_s=0.0)
        shaken = _scenario(tmp_path, 10.0, codecs=(codec,), contexts=(1000,), profile=path,
                           handshake_s=0.001)
        [(_, [before], sc)] = plain
        [(_, [after], _)] = shaken
        assert sc.handshake_s == pytest.approx(0.003)
        assert after == pytest.approx(tuple(t + 0.001 for t in before), abs=1e-12)
        # the profile's half efficiency is a 5 Gbps link; without its 3 ms handshake the
        # same request is 3 ms earlier
        [(_, [bare], _)] = _scenario(tmp_path, 5.0, codecs=(codec,), contexts=(1000,))
        assert before == pytest.approx(tuple(t + 0.003 for t in bare), abs=1e-12)


def test_handshake_is_hidden_behind_a_prefill_the_transfer_runs_with(tmp_path):
    """layerwise: the sender says hello as prefill starts, so a handshake shorter than the
    first layer's prefill changes nothing; one longer than the whole prefill starts the
    encoder at prefill start + handshake, with every layer ready by then."""
    def first_arrival(handshake_s: float) -> tuple:
        [(_, [(encode_end, _, _, last)], sc)] = _scenario(
            tmp_path, 10.0, codecs=("bf16",), contexts=(1000,), transfer="layerwise",
            handshake_s=handshake_s)
        [rec] = sc.records
        return rec.prefill_start_t, rec.prefill_end_t, encode_end, last, \
            float(sc.plan(1000).encode_cum_s[-1])
    t_p0, t_pe, encode_end, last, encode_s = first_arrival(0.0)
    layer_s = (t_pe - t_p0) / MODEL.layers
    assert first_arrival(0.5 * layer_s) == (t_p0, t_pe, encode_end, last, encode_s)
    late = first_arrival(2.0 * (t_pe - t_p0))
    assert late[:2] == (t_p0, t_pe)
    assert late[2] == pytest.approx(t_p0 + 2.0 * (t_pe - t_p0) + encode_s, abs=1e-12)
    assert late[2] > encode_end and late[3] > last


def test_handshake_entry_is_the_median_of_finished_requests():
    rows = [{"status": "done", "handshake_s": x} for x in (0.002, 0.004, 0.003)] + [
        {"status": "error", "handshake_s": 0.5}, {"status": "done", "handshake_s": math.nan},
        {"status": "done"}]
    got = lp.handshake_entry(rows)
    assert got["handshake_s"] == 0.003
    assert got["handshake"]["requests"] == 3 and got["handshake"]["min_s"] == 0.002 and \
        got["handshake"]["max_s"] == 0.004
    assert lp.handshake_entry(rows[3:]) is None and lp.handshake_entry([]) is None


def test_loader_reads_a_handshake_and_refuses_a_bad_one(tmp_path):
    assert load_link_profile(_profile_file(tmp_path)).handshake_s == 0.0  # none: none
    assert load_link_profile(_profile_file(tmp_path, handshake_s=0.002)).handshake_s == 0.002
    for bad, message in ((-0.001, "handshake_s must be in"), (math.nan, "must be finite"),
                         ("2 ms", "must be a number")):
        with pytest.raises(ValueError, match=message):
            load_link_profile(_profile_file(tmp_path, handshake_s=bad))
    with pytest.raises(ValueError, match="link.handshake_s"):
        LinkConfig(handshake_s=-1.0).validate()


@pytest.mark.slow
def test_real_token_bucket_profile_fits_a_goodput_near_the_rate(tmp_path):
    transfers = (lp.Transfer("big", 8, 128, 256, 0.4), lp.Transfer("big-short", 8, 128, 256, 0.1),
                 lp.Transfer("small", 1, 16, 4096, 0.4))
    doc = lp.measure_link_profile("token_bucket", [0.5], name="t", repeats=1,
                                  transfers=transfers, command="pytest")
    assert 0.9 <= doc["efficiency"] <= 1.1, lp.summary(doc)
    assert doc["latency_s"] >= 0 and doc["message_overhead_bytes"] >= 0
    assert len(doc["measurements"]) == 3
    path = lp.write_link_profile(doc, tmp_path / "t.json")
    assert load_link_profile(str(path)).efficiency == doc["efficiency"]
