"""deserializer=on_arrival: the transport receiver's default, a worker per request that
dequantizes each layer once its last message is in (kvsim.sim.policy._layer_job_work), then
the decoder builds its cache (hardware profile `cache_build`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sim_receiver_scenario import receiver_scenario

from kvsim.profiles import profile_path
from kvsim.sim.policy import build_plan


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


def test_a_measured_draft_step_paces_the_drafts_on_arrival_only(tmp_path):
    """A profile's draft_step (a draft step beside the residual's dequantization over a
    decode step) sets the drafts' pace on arrival when no draft_overhead_s is configured;
    on demand keeps its own model (the anchor's dequantization per draft)."""
    doc = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())
    doc["draft_step"] = {"ratio": 2.0}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    got = {}
    for mode in ("on_arrival", "on_demand"):
        sc = receiver_scenario("codecs=[lynx]", f"deserializer={mode}",
                               "link.bandwidth_gbps=0.05", f"hardware.profile={path}",
                               "speculative.draft_overhead_s=null")
        sc.run()
        tl = sc.records[0].timeline
        assert tl.proposed >= 1
        got[mode] = (tl.draft_tpot_s, sc.timing.tpot_s(1024))
    draft, step = got["on_arrival"]
    assert draft == pytest.approx(2.0 * step, rel=1e-9)
    draft, step = got["on_demand"]
    assert draft != pytest.approx(2.0 * step, rel=1e-3)
    # a configured overhead wins over the measured one
    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_arrival", "link.bandwidth_gbps=0.05",
                           f"hardware.profile={path}")  # BASE: draft_overhead_s=0
    sc.run()
    assert sc.records[0].timeline.draft_tpot_s == pytest.approx(sc.timing.tpot_s(1024), rel=1e-9)
