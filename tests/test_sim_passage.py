"""A request's passage without generator processes: decode admission (slot, then memory,
first come first served), readiness joins on receivers, the batch's leave callback, and
prefill queueing as a closed-form FIFO (kvsim.sim.nodes, kvsim.sim.batch, kvsim.sim.run)."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from test_sim_batch import MODEL, step_s

from kvsim.model.hardware import HardwareSpec
from kvsim.scenario.policy import FlowPlan
from kvsim.scenario.timing_model import TimingModel
from kvsim.sim.batch import DecodeBatch
from kvsim.sim.nodes import DecodeAdmission, Deserializer, when_all_ready

HW = HardwareSpec(name="test", hbm_gb_per_s=100.0, bf16_tflops=10.0, memory_gb=100.0,
                  step_overhead_s=0.001)


def test_admission_gives_slots_first_come_first_served():
    adm = DecodeAdmission(max_batch=2, kv_memory_bytes=100.0)
    log: list[tuple[str, float]] = []
    for name in "abc":
        adm.request(10.0, 0.0, lambda t_slot, name=name: log.append((name, t_slot)))
    assert log == [("a", 0.0), ("b", 0.0)]  # c waits for a slot
    adm.release(10.0, 5.0)
    assert log[-1] == ("c", 5.0)  # its slot came at the release
    assert adm.free_slots == 0 and adm.free_bytes == pytest.approx(80.0)


def test_admission_memory_blocks_the_queue_behind_its_head():
    """A request holding a slot whose cache does not fit waits, and a smaller one behind
    it waits too (no overtaking); both get in once the memory is back."""
    adm = DecodeAdmission(max_batch=3, kv_memory_bytes=10.0)
    log: list[tuple[str, float]] = []
    adm.request(6.0, 0.0, lambda t: log.append(("big1", t)))
    adm.request(6.0, 1.0, lambda t: log.append(("big2", t)))
    adm.request(2.0, 2.0, lambda t: log.append(("small", t)))
    assert log == [("big1", 0.0)]  # small would fit (4 free) but waits behind big2
    adm.release(6.0, 7.0)
    # both were given their slots on request: the callback reports when (1.0, 2.0)
    assert log == [("big1", 0.0), ("big2", 1.0), ("small", 2.0)]
    assert adm.free_bytes == pytest.approx(2.0) and adm.free_slots == 1


def test_admission_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="max_batch"):
        DecodeAdmission(max_batch=0, kv_memory_bytes=1.0)


def _receivers(env: simpy.Environment, n: int):
    plans = [FlowPlan(s, f"s{s}", np.array([1.0]), np.array([0]), np.array([0.0]))
             for s in range(n)]
    return Deserializer(env, plans, pipelined=True, mode="per_stream").receivers


def test_when_all_ready_waits_for_the_last_receiver():
    env = simpy.Environment()
    rx = _receivers(env, 2)
    fired: list[float] = []
    when_all_ready(rx, lambda: fired.append(env.now))
    rx[1].fire(3.0)
    rx[0].fire(1.5)
    env.run(until=2.0)
    assert rx[0].is_ready and not rx[1].is_ready and fired == []
    env.run()
    assert fired == [3.0]
    when_all_ready(rx, lambda: fired.append(-1.0))  # all ready already: called at once
    assert fired == [3.0, -1.0]


def test_when_all_ready_with_one_receiver_left_waits_for_it():
    """One receiver not ready (a split-stream request waits for its anchor alone): the
    callback waits for that one, once, in the order callbacks were registered on it."""
    env = simpy.Environment()
    rx = _receivers(env, 3)
    rx[0].fire(1.0)
    rx[2].fire(0.5)
    env.run(until=1.5)
    fired: list[tuple[str, float]] = []
    rx[1].when_ready(lambda: fired.append(("first", env.now)))
    when_all_ready(rx, lambda: fired.append(("all", env.now)))
    when_all_ready(rx[1:2], lambda: fired.append(("alone", env.now)))
    rx[1].fire(4.0)
    env.run()
    assert fired == [("first", 4.0), ("all", 4.0), ("alone", 4.0)]


def test_leave_callback_runs_after_the_batch_is_retimed_and_may_join():
    """on_leave may admit the next request into the same batch from inside the batch's
    update: it joins at the leave instant and decodes alone at batch-1 speed."""
    env = simpy.Environment()
    batch = DecodeBatch(env, TimingModel(MODEL, HW))
    out: dict[str, object] = {}

    def first_left(m):
        out["a"] = m.timeline
        out["b_member"] = batch.join(2, 1000, 2, on_leave=lambda m2: out.update(b=m2.timeline))

    batch.join(1, 1000, 3, on_leave=first_left)
    env.run()
    a, b = out["a"], out["b"]
    step = step_s(1000)
    np.testing.assert_allclose(a.token_t, step * np.arange(1, 4), rtol=1e-12)
    np.testing.assert_allclose(b.token_t, a.token_t[-1] + step * np.arange(1, 3), rtol=1e-12)
    assert batch.members == 0
    # the event form still works for a caller that asks for it after the member left
    assert out["b_member"].done.triggered and out["b_member"].done.value is b


def _trace_scenario(arrivals_t: list[float], contexts: list[int], prefill_nodes: int):
    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig
    from kvsim.scenario.variants import variants
    from kvsim.sim.run import Scenario

    cfg, _ = compose("sim", ["scenario=none", "link=25g", "workload=poisson",
                             "workload.kind=trace", f"workload.arrivals_t={arrivals_t}",
                             f"workload.arrivals_context_tokens={contexts}",
                             "workload.output_tokens=8", "metrics.ks=[1,8]",
                             f"workload.prefill_nodes={prefill_nodes}",
                             "workload.decode_nodes=1", "codecs=[int8]"], SimConfig)
    sc = Scenario(cfg, variants(cfg)[0], contexts[0], cfg.link.bandwidth_gbps)
    sc.run()
    return sc, sorted(sc.records, key=lambda r: r.seq)


def test_prefill_queue_is_first_come_first_served_in_closed_form():
    """Three requests at t=0 on one prefill instance: prefills back to back, each one's
    wait the sum of the ones before (no events of a queue)."""
    sc, recs = _trace_scenario([0.0, 0.0, 0.0], [4000, 4000, 4000], 1)
    p = sc.timing.prefill_s(4000)
    assert [r.prefill_start_t for r in recs] == pytest.approx([0.0, p, 2 * p], rel=1e-12)
    assert [r.prefill_end_t for r in recs] == pytest.approx([p, 2 * p, 3 * p], rel=1e-12)


def test_routing_counts_a_finished_prefill_out_of_its_queue():
    """Two instances: a short, a long and a short prompt at t=0 go to 0, 1, 0. A fourth
    arriving after both short prefills ended finds instance 0 empty and instance 1 busy:
    it goes to 0 and starts on arrival (counting the finished prefills as still queued
    would send it to 1, behind the long one)."""
    sc, _ = _trace_scenario([0.0], [1000], 1)
    short_s, long_s = sc.timing.prefill_s(1000), sc.timing.prefill_s(32000)
    t3 = (2 * short_s + long_s) / 2
    assert 2 * short_s < t3 < long_s
    _, recs = _trace_scenario([0.0, 0.0, 0.0, t3], [1000, 32000, 1000, 1000], 2)
    assert recs[3].prefill_start_t == pytest.approx(t3, rel=1e-12)
    assert recs[2].prefill_start_t == pytest.approx(short_s, rel=1e-12)
