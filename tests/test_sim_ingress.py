"""Decode-side ingress (kvsim.sim.ingress): hand-computed incast."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from kvsim.model.hardware import HardwareSpec
from kvsim.model.spec import ModelSpec
from kvsim.scenario.config import LinkConfig, SimConfig
from kvsim.scenario.variants import variants
from kvsim.sim.nodes import NodeDeserializer
from kvsim.sim.run import Scenario

MODEL = ModelSpec(name="tiny", layers=4, attention_heads=4, kv_heads=2, head_dim=64,
                  hidden_size=256, params_total=1e8, params_active=1e8)
HW = HardwareSpec(name="test", hbm_gb_per_s=100.0, bf16_tflops=10.0, memory_gb=100.0)


def _run(tmp_path, ingress_gbps: float, decode_nodes: int = 1):
    timing = tmp_path / "timing.json"
    entry = {"encode_gb_per_s": 50.0, "decode_gb_per_s": 25.0, "source": "assumed",
             "assumption": "test"}
    timing.write_text(json.dumps({"version": 1, "hardware": "test", "default": entry}))
    cfg = SimConfig(model=MODEL, hardware=HW, codecs=["bf16"], codec_timing=str(timing),
                    transfer="monolithic")
    cfg.link = replace(cfg.link, bandwidth_gbps=1.0, latency_s=0.002,
                       decode_ingress_gbps=ingress_gbps)
    # two identical requests at t=0 on two prefill nodes (one egress link each of 1 Gbps)
    cfg.workload = replace(cfg.workload, kind="trace", arrivals_t=[0.0, 0.0],
                           arrivals_context_tokens=[1000, 1000], output_tokens=8,
                           prefill_nodes=2, decode_nodes=decode_nodes)
    sc = Scenario(cfg, variants(cfg)[0], 1000, 1.0)
    sc.run()
    return sc, sorted(sc.records, key=lambda r: r.seq)


def test_two_prefill_links_into_one_ingress_of_one_link_take_twice_as_long(tmp_path):
    sc, recs = _run(tmp_path, 0.0)
    wire_bytes = recs[0].received_bytes  # bf16 monolithic: one flow, released at encode end
    one_link_s = 8 * wire_bytes / 1e9
    for r in recs:  # no ingress: each request has its own 1 Gbps link
        assert r.needed_arrival_t == pytest.approx(r.encode_end_t + one_link_s + 0.002,
                                                   rel=1e-12)
    sc, recs = _run(tmp_path, 1.0)
    for r in recs:  # ingress of 1 Gbps: both flows share it, each at 0.5 Gbps
        assert r.needed_arrival_t == pytest.approx(r.encode_end_t + 2 * one_link_s + 0.002,
                                                   rel=1e-12)
        assert r.received_bytes == wire_bytes  # bytes counted once, not per crossing
    assert sc.ingress[0].busy_utilisation() == pytest.approx(1.0, rel=1e-9)


def test_ample_ingress_or_one_per_decode_node_changes_nothing(tmp_path):
    _, base = _run(tmp_path, 0.0)
    _, ample = _run(tmp_path, 1000.0)  # never the bottleneck
    _, spread = _run(tmp_path, 1.0, decode_nodes=2)  # one request per decode node
    for b, a, s in zip(base, ample, spread, strict=True):
        assert a.needed_arrival_t == pytest.approx(b.needed_arrival_t, rel=1e-12)
        assert s.needed_arrival_t == pytest.approx(b.needed_arrival_t, rel=1e-12)


def test_ingress_rate_is_validated():
    with pytest.raises(ValueError, match="link.decode_ingress_gbps must be >= 0"):
        LinkConfig(decode_ingress_gbps=-1.0).validate()


def _deser_run(tmp_path, mode: str, transfer: str = "monolithic", arrivals=(0.0, 0.0),
               ingress_gbps: float = 0.0, decode_gb_per_s: float = 25.0,
               egress_gbps: float = 1.0, prefill_nodes: int = 2):
    timing = tmp_path / "timing.json"
    entry = {"encode_gb_per_s": 50.0, "decode_gb_per_s": decode_gb_per_s, "source": "assumed",
             "assumption": "test"}
    timing.write_text(json.dumps({"version": 1, "hardware": "test", "default": entry}))
    cfg = SimConfig(model=MODEL, hardware=HW, codecs=["bf16"], codec_timing=str(timing),
                    deserializer=mode, transfer=transfer)
    cfg.link = replace(cfg.link, bandwidth_gbps=egress_gbps, latency_s=0.002,
                       decode_ingress_gbps=ingress_gbps)
    cfg.workload = replace(cfg.workload, kind="trace", arrivals_t=list(arrivals),
                           arrivals_context_tokens=[1000] * len(arrivals), output_tokens=8,
                           prefill_nodes=prefill_nodes, decode_nodes=1)
    sc = Scenario(cfg, variants(cfg)[0], 1000, egress_gbps)
    sc.run()
    return sorted(sc.records, key=lambda r: r.seq)


def test_node_deserializer_serves_the_instances_requests_one_after_another(tmp_path):
    # bf16 monolithic: each request is one deserialization job of its whole cache, at its
    # last arrival: 1000 tokens x 2048 B / 25 GB/s. Both arrive together.
    work_s = 1000 * 2048 / 25e9
    for r in _deser_run(tmp_path, "shared"):  # per request: both in parallel
        assert r.needed_ready_t == pytest.approx(r.needed_arrival_t + work_s, rel=1e-12)
    a, b = _deser_run(tmp_path, "node")  # one server on the decode instance: FIFO
    assert a.needed_arrival_t == pytest.approx(b.needed_arrival_t, rel=1e-12)
    assert sorted([a.needed_ready_t, b.needed_ready_t]) == pytest.approx(
        [a.needed_arrival_t + work_s, a.needed_arrival_t + 2 * work_s], rel=1e-12)


def test_node_deserializer_alone_is_the_per_request_pipeline(tmp_path):
    # one request, layer-wise pipelined: a FIFO over the instance = its own serial pipeline
    (shared,) = _deser_run(tmp_path, "shared", "layerwise", arrivals=(0.0,))
    (node,) = _deser_run(tmp_path, "node", "layerwise", arrivals=(0.0,))
    assert node.needed_ready_t == pytest.approx(shared.needed_ready_t, rel=1e-12)


def test_node_deserializer_with_ingress_is_fifo_over_both_crossings(tmp_path):
    # bf16 monolithic, two requests at t=0 on two 1 Gbps prefill links into one decode
    # instance whose ingress is 1 Gbps: both flows share the ingress (0.5 Gbps each), so
    # each arrives 2 x one_link_s after its encode ends; one deserializer serves the two
    # whole-cache jobs (1000 tokens x 2048 B / 25 GB/s) one after the other
    work_s = 1000 * 2048 / 25e9
    a, b = _deser_run(tmp_path, "node", ingress_gbps=1.0)
    one_link_s = 8 * a.received_bytes / 1e9
    for r in (a, b):
        assert r.needed_arrival_t == pytest.approx(r.encode_end_t + 2 * one_link_s + 0.002,
                                                   rel=1e-12)
    assert sorted([a.needed_ready_t, b.needed_ready_t]) == pytest.approx(
        [a.needed_arrival_t + work_s, a.needed_arrival_t + 2 * work_s], rel=1e-12)


def test_node_deserializer_sees_layers_before_the_flow_through_the_ingress_is_done(tmp_path):
    # layer-wise, two requests 1 ms apart on two prefill links into one decode instance:
    # their layers arrive interleaved and one server takes them by arrival. An ingress that
    # is never the bottleneck (1000 Gbps) changes no arrival, so every time must equal the
    # run without it; this holds only if the ingress join hands each layer on as both links
    # carry it (a join that reported a flow's layers when it is done would queue the other
    # request's earlier layers behind them). A layer is 1000 x 2048 / 4 B: 4.1 ms on a
    # 1 Gbps link, 5.1 ms of work at 0.1 GB/s, so the server is the bottleneck and the
    # order of its jobs decides the ready times
    arrivals, slow = (0.0, 0.001), 0.1
    base = _deser_run(tmp_path, "node", "layerwise", arrivals, decode_gb_per_s=slow)
    joined = _deser_run(tmp_path, "node", "layerwise", arrivals, ingress_gbps=1000.0,
                        decode_gb_per_s=slow)
    # the two requests contend for the server: each is ready later than on its own one
    alone = _deser_run(tmp_path, "shared", "layerwise", arrivals, decode_gb_per_s=slow)
    assert all(b.needed_ready_t > a.needed_ready_t for a, b in zip(alone, base, strict=True))
    for b, j in zip(base, joined, strict=True):
        assert j.needed_arrival_t == pytest.approx(b.needed_arrival_t, rel=1e-12)
        assert j.needed_ready_t == pytest.approx(b.needed_ready_t, rel=1e-12)
        assert j.received_bytes == b.received_bytes


@pytest.mark.parametrize("mode", ["node", "shared"])
def test_an_ingress_that_is_the_bottleneck_is_the_link_it_replaces(tmp_path, mode):
    # one prefill node, two layer-wise requests whose transfers overlap (a 512 KB layer
    # takes 41 ms at 0.1 Gbps, the prefill releases one per 10 ms): a 0.2 Gbps egress into
    # a 0.1 Gbps ingress carries every message when a lone 0.1 Gbps egress would (the
    # ingress shares itself as that link would, and the egress is always ahead of it), so
    # every arrival and ready time is the same. The ingress's reports lag the egress's:
    # a join that handed messages on at the egress's report, or only once the flow is done
    # (node: checked, the first request's ready time moves), would not give these times
    common = dict(transfer="layerwise", arrivals=(0.0, 0.001), decode_gb_per_s=0.1,
                  prefill_nodes=1)
    alone = _deser_run(tmp_path, mode, egress_gbps=0.1, **common)
    joined = _deser_run(tmp_path, mode, egress_gbps=0.2, ingress_gbps=0.1, **common)
    for a, j in zip(alone, joined, strict=True):
        assert j.needed_arrival_t == pytest.approx(a.needed_arrival_t, rel=1e-12)
        assert j.needed_ready_t == pytest.approx(a.needed_ready_t, rel=1e-12)
        assert j.received_bytes == a.received_bytes
    # the two requests' transfers overlap: the second starts before the first is in
    assert alone[1].prefill_end_t < alone[0].needed_arrival_t


def test_node_deserializer_is_fifo_by_arrival_across_requests():
    # A: messages at 0, 1, 2 s of 0.5 s work; B: at 0.2, 0.4 s of 1 s work. One server,
    # by arrival: A0 0->0.5, B0 0.5->1.5, B1 1.5->2.5, A1 2.5->3.0, A2 3.0->3.5.
    node = NodeDeserializer([])
    a = SimpleNamespace(node_finish_t=-math.inf)
    b = SimpleNamespace(node_finish_t=-math.inf)
    node.offer(a, np.array([0.0, 1.0, 2.0]), np.full(3, 0.5))
    node.offer(b, np.array([0.2, 0.4]), np.full(2, 1.0))
    node.serve()
    assert (a.node_finish_t, b.node_finish_t) == pytest.approx((3.5, 2.5), rel=1e-12)
    # later reports queue behind the work so far
    node.offer(b, np.array([3.0]), np.array([1.0]))
    node.serve()
    assert b.node_finish_t == pytest.approx(4.5, rel=1e-12)
