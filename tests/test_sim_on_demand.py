"""deserializer=on_demand: the transport receiver's dequantize-when-needed, as the simulator
models it (kvsim.sim.run._load_on_demand, kvsim.sim.batch's load after drafting)."""

from __future__ import annotations

import math

import pytest
from sim_receiver_scenario import receiver_scenario


def test_monolithic_on_demand_equals_deserializing_after_the_last_byte():
    """Monolithic: dequantizing the whole cache after its last byte is what the shared
    deserializer does too (same codec timing), so both give the same first token."""
    rows = {}
    for mode in ("shared", "on_demand"):
        sc = receiver_scenario("codecs=[int8]", f"deserializer={mode}", "link.bandwidth_gbps=0.3")
        rows[mode] = sc.run()
    assert rows["on_demand"]["ttft_s"] == pytest.approx(rows["shared"]["ttft_s"], rel=1e-9)
    sc = receiver_scenario("codecs=[int8]", "deserializer=on_demand", "link.bandwidth_gbps=0.3")
    sc.run()
    rec = sc.records[0]
    load = sc.codec_timing.decode_s(sc.model.kv_bytes_bf16(1024))
    assert rec.decode_start_t == pytest.approx(rec.all_arrival_t + load, rel=1e-12)


def test_split_stream_loads_the_anchor_then_the_full_cache_after_drafting():
    """The anchor is dequantized once it is in; drafting runs until the residual is in and
    the step in progress ends; then the full cache is dequantized and verification starts."""
    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_demand", "link.bandwidth_gbps=0.1")
    sc.run()
    rec = sc.records[0]
    bf16 = sc.model.kv_bytes_bf16(1024)
    anchor_load = sc.codec_timing.anchor_decode_s(bf16)
    full_load = sc.codec_timing.decode_s(bf16)
    tl = rec.timeline
    assert tl.start_t == pytest.approx(rec.needed_arrival_t + anchor_load, rel=1e-12)
    assert tl.proposed >= 1  # the residual was still on the wire: drafts were made
    step = sc.timing.tpot_s(1024)  # batch of one, no draft overhead
    steps_done = math.ceil((rec.all_arrival_t - tl.start_t) / step - 1e-9)
    draft_end = tl.start_t + steps_done * step
    assert tl.proposed == steps_done
    assert tl.verify_start_t == pytest.approx(draft_end + full_load, rel=1e-9)
    assert rec.full_ready_t == pytest.approx(tl.verify_start_t, rel=1e-12)
    kinds = [k for k, _a, _b in tl.segments]
    assert "wait" in kinds  # the full cache's load sits between drafting and verification


def test_split_stream_without_drafting_when_the_residual_beats_the_anchor_load():
    """A fast link: the residual is in before the anchor is dequantized, so (as the
    transport's decoder) nothing is drafted and the full cache is loaded after it."""
    sc = receiver_scenario("codecs=[lynx]", "deserializer=on_demand", "link.bandwidth_gbps=100")
    sc.run()
    rec = sc.records[0]
    bf16 = sc.model.kv_bytes_bf16(1024)
    assert rec.timeline.proposed == 0
    anchor_load = sc.codec_timing.anchor_decode_s(bf16)
    full_load = sc.codec_timing.decode_s(bf16)
    assert rec.decode_start_t == pytest.approx(rec.needed_arrival_t + anchor_load + full_load,
                                               rel=1e-9)
