"""Continuous batching on a decode instance (kvsim.sim.batch): hand-computed join / leave
timelines, mixed contexts, speculative members, and the end-to-end simulator."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import simpy
from sim_codecs import size_only_split_codec

from kvsim.model.hardware import HardwareSpec
from kvsim.model.spec import ModelSpec
from kvsim.scenario.config import SimConfig
from kvsim.scenario.timing_model import TimingModel
from kvsim.scenario.variants import variants
from kvsim.sim.batch import DecodeBatch
from kvsim.sim.run import Scenario

# tiny dense model: 1e8 params (2e8 bf16 weight bytes), KV 2 (K,V) x 2 heads x 64 x 4 layers
# x 2 bytes = 2048 bytes per token; memory bound at these contexts (checked below)
MODEL = ModelSpec(name="tiny", layers=4, attention_heads=4, kv_heads=2, head_dim=64,
                  hidden_size=256, params_total=1e8, params_active=1e8)
HW = HardwareSpec(name="test", hbm_gb_per_s=100.0, bf16_tflops=10.0, memory_gb=100.0,
                  step_overhead_s=0.001)
HBM = 100e9 * 0.7  # bytes/s a decode step reaches (decode_mbu 0.7)
KV_PER_TOKEN = 2048  # bytes


def step_s(*contexts: int, new_tokens: tuple[int, ...] = ()) -> float:
    """By hand: one memory-bound step reads the weights once and every member's KV
    (context + its new tokens), plus the step overhead."""
    new = new_tokens or (1,) * len(contexts)
    kv = sum((c + n) * KV_PER_TOKEN for c, n in zip(contexts, new, strict=True))
    return (2e8 + kv) / HBM + 0.001


def test_step_time_is_the_roofline_over_the_members():
    tm = TimingModel(MODEL, HW)
    assert tm.tpot_s(1000, 1) == pytest.approx(step_s(1000), rel=1e-12)
    assert tm.tpot_s(1000, 2) == pytest.approx(step_s(1000, 1000), rel=1e-12)
    f1, k1 = tm.member_work(1, 1000)
    f2, k2 = tm.member_work(1, 3000)
    assert k1 == (1000 + 1) * KV_PER_TOKEN and k2 == (3000 + 1) * KV_PER_TOKEN
    # memoized for every batch of a run: the same pair again, no new computation
    assert tm.member_work(1, 1000) is tm.member_work(1, 1000)
    assert tm.member_work(2, 1000)[1] == (1000 + 2) * KV_PER_TOKEN
    assert tm.batch_step_s(2, f1 + f2, k1 + k2, 2, 4000) == pytest.approx(
        step_s(1000, 3000), rel=1e-12)
    fv, kv = tm.member_work(5, 1000)  # verifying 5 drafts alone = verify_s
    assert tm.batch_step_s(5, fv, kv, 1, 1000) == pytest.approx(tm.verify_s(5, 1000), rel=1e-12)
    # memory bound: the FLOPs of the step take far less than its reads
    assert (f1 + f2) / (10e12 * 0.5) < 0.1 * step_s(1000, 3000)


def _run(joins):
    """joins: [(t_s, context, tokens)] -> token times [K] per member."""
    env = simpy.Environment()
    batch = DecodeBatch(env, TimingModel(MODEL, HW))
    out: dict[int, np.ndarray] = {}

    def request(i, t, ctx, k):
        yield env.timeout(t)
        m = batch.join(i, ctx, k)
        tl = yield m.done
        out[i] = tl.token_t

    for i, (t, ctx, k) in enumerate(joins):
        env.process(request(i, t, ctx, k))
    env.run()
    return out, batch


def test_single_member_keeps_batch_one_speed():
    out, _ = _run([(0.5, 1000, 8)])
    np.testing.assert_allclose(out[0], 0.5 + step_s(1000) * np.arange(1, 9), rtol=1e-12)


def test_join_slows_the_running_member_and_leave_speeds_it_up():
    # A (1000-token prompt, 10 tokens) decodes alone at s1; B (3000 tokens, 4 tokens)
    # becomes ready when A has done 2.5 steps and joins when A's third step ends (a step
    # boundary, as iteration-level scheduling admits it); both then run at s2 until B's
    # 4th token; A's last 3 steps run alone at s1 again.
    s1, s2 = step_s(1000), step_s(1000, 3000)
    tb = 2.5 * s1
    out, batch = _run([(0.0, 1000, 10), (tb, 3000, 4)])
    b_join = 3 * s1
    b_end = b_join + 4 * s2
    a = [s1, 2 * s1, 3 * s1,  # alone
         b_join + s2, b_join + 2 * s2, b_join + 3 * s2, b_end,  # tokens 4..7 shared
         b_end + s1, b_end + 2 * s1, b_end + 3 * s1]  # 8..10 alone
    np.testing.assert_allclose(out[0], a, rtol=1e-12)
    np.testing.assert_allclose(out[1], b_join + s2 * np.arange(1, 5), rtol=1e-12)
    # one timer per batch change, none per token
    assert batch.changes == 5  # A joins, B is ready, B joins, B leaves, A leaves


def test_a_member_ready_on_a_boundary_or_on_an_idle_batch_starts_at_once():
    s1, s2 = step_s(1000), step_s(1000, 1000)
    out, _ = _run([(0.0, 1000, 4), (2 * s1, 1000, 2)])  # B ready as A's 2nd step ends
    np.testing.assert_allclose(out[1], 2 * s1 + s2 * np.arange(1, 3), rtol=1e-12)
    np.testing.assert_allclose(out[0], [s1, 2 * s1, 2 * s1 + s2, 2 * s1 + 2 * s2],
                               rtol=1e-12)
    # the batch idles between A's end and C: C's steps count from its own start
    out, _ = _run([(0.0, 1000, 2), (2.7 * s1, 1000, 2)])
    np.testing.assert_allclose(out[1], 2.7 * s1 + s1 * np.arange(1, 3), rtol=1e-12)


def test_two_equal_members_share_the_batch_two_step():
    s1, s2 = step_s(1000), step_s(1000, 1000)
    out, _ = _run([(0.0, 1000, 4), (0.0, 1000, 4)])
    for i in (0, 1):
        np.testing.assert_allclose(out[i], s2 * np.arange(1, 5), rtol=1e-12)
    assert s1 < s2 < 2 * s1  # batching: slower per member, faster in total


def test_speculative_member_drafts_verifies_in_the_batch_then_decodes():
    # S drafts on the anchor beside a plain member P; its full cache is ready after 2.5
    # shared draft steps: the 3rd draft finishes, then one step verifies its 3 drafts
    # (its forward over 3 tokens, batched with P's decode step), 1 accepted.
    env = simpy.Environment()
    tm = TimingModel(MODEL, HW)
    batch = DecodeBatch(env, tm)
    o = 0.002  # draft overhead per drafted token (s)
    out = {}

    def plain():
        m = batch.join(0, 1000, 20)
        out["p"] = yield m.done

    def spec():
        m = batch.join(1, 2000, 6, cap=64, draft_overhead_s=o, sample_accepted=lambda n: 1)
        yield env.timeout(2.5 * (step_s(1000, 2000) + o))
        batch.full_ready(m)
        out["s"] = yield m.done

    env.process(plain())
    env.process(spec())
    env.run()
    sd = step_s(1000, 2000) + o  # draft step: both decode, plus S's dequantization overhead
    sv = step_s(1000, 2000, new_tokens=(1, 3))  # verification step: S's forward covers 3
    sp = step_s(1000, 2000)  # plain shared decode step
    s = out["s"]
    assert (s.proposed, s.accepted) == (3, 1)
    v_end = 3 * sd + sv
    np.testing.assert_allclose(s.token_t, [sd, v_end] + [v_end + j * sp for j in range(1, 5)],
                               rtol=1e-12)
    np.testing.assert_allclose(s.committed_t, [v_end, v_end] + list(s.token_t[2:]), rtol=1e-12)
    assert s.verify_s == pytest.approx(sv, rel=1e-12)
    # P: 3 draft-steps, the verify step, 4 shared steps, then alone at batch-1 speed
    p = out["p"].token_t
    end_s = v_end + 4 * sp
    expect = [sd, 2 * sd, 3 * sd, v_end] + [v_end + j * sp for j in range(1, 5)] + \
        [end_s + j * step_s(1000) for j in range(1, 13)]
    np.testing.assert_allclose(p, expect, rtol=1e-12)


def test_a_receivers_overhead_ends_when_the_full_cache_is_ready():
    # S drafts alone with overhead o until its full cache is ready, 1.5 draft steps in
    # (overhead_until_full: the overhead is the receiver's work beside it, over then): its
    # 2nd draft has half a step left, which runs at the plain step; then verification.
    # Without the flag the 2nd draft finishes at the draft step (the old model).
    tm = TimingModel(MODEL, HW)
    s1 = step_s(1000)
    o = 0.004
    sd = s1 + o
    sv = step_s(1000, new_tokens=(2,))

    def run(until_full: bool):
        env = simpy.Environment()
        batch = DecodeBatch(env, tm)
        out = {}

        def spec():
            m = batch.join(0, 1000, 3, cap=8, draft_overhead_s=o, sample_accepted=lambda n: 2,
                           overhead_until_full=until_full)
            yield env.timeout(1.5 * sd)
            batch.full_ready(m)
            out["s"] = yield m.done

        env.process(spec())
        env.run()
        return out["s"]

    tl = run(True)
    draft2 = 1.5 * sd + 0.5 * s1
    assert (tl.proposed, tl.accepted) == (2, 2)
    np.testing.assert_allclose(tl.token_t, [sd, draft2, draft2 + sv], rtol=1e-12)
    np.testing.assert_allclose(tl.committed_t, [draft2 + sv] * 3, rtol=1e-12)
    old = run(False)
    np.testing.assert_allclose(old.token_t, [sd, 2 * sd, 2 * sd + sv], rtol=1e-12)


def test_cap_reached_waits_out_of_the_batch():
    # cap 2: S drafts 2 tokens alone, then waits (computes nothing) until its full cache
    env = simpy.Environment()
    batch = DecodeBatch(env, TimingModel(MODEL, HW))
    out = {}

    def spec():
        m = batch.join(0, 1000, 4, cap=2, sample_accepted=lambda n: 2)
        yield env.timeout(1.0)
        batch.full_ready(m)
        out["s"] = yield m.done

    env.process(spec())
    env.run()
    s1 = step_s(1000)
    sv = step_s(1000, new_tokens=(2,))
    tl = out["s"]
    np.testing.assert_allclose(tl.token_t, [s1, 2 * s1, 1.0 + sv, 1.0 + sv + s1], rtol=1e-12)
    assert [k for k, _, _ in tl.segments] == ["draft_accepted", "draft_rejected", "wait",
                                              "verify", "decode"]


def _timing_file(tmp_path) -> str:
    p = tmp_path / "timing.json"
    entry = {"encode_gb_per_s": 50.0, "decode_gb_per_s": 25.0, "source": "assumed",
             "assumption": "test"}
    p.write_text(json.dumps({"version": 1, "hardware": "test", "default": entry}))
    return str(p)


def _two_request_cfg(tmp_path, second_arrival_s: float) -> SimConfig:
    cfg = SimConfig(model=MODEL, hardware=HW, codecs=["bf16"],
                    codec_timing=_timing_file(tmp_path))
    cfg.link = replace(cfg.link, bandwidth_gbps=100.0)
    cfg.workload = replace(cfg.workload, kind="trace", arrivals_t=[0.0, second_arrival_s],
                           arrivals_context_tokens=[1000, 3000], output_tokens=64,
                           prefill_nodes=2, decode_nodes=1)
    return cfg


def test_simulator_retimes_a_decoding_request_when_another_joins(tmp_path):
    cfg = _two_request_cfg(tmp_path, 0.02)
    sc = Scenario(cfg, variants(cfg)[0], 1000, 100.0)
    sc.run()
    a, b = sorted(sc.records, key=lambda r: r.seq)
    assert a.decode_start_t < b.decode_start_t < a.timeline.token_t[-1]  # B joins mid-decode
    s1, s2 = step_s(1000), step_s(1000, 3000)
    # B is ready mid-step: it joins when A's step in progress ends
    alone = int(np.ceil((b.decode_start_t - a.decode_start_t) / s1))  # A's steps alone
    assert alone > (b.decode_start_t - a.decode_start_t) / s1
    first = a.decode_start_t + np.arange(1, alone + 1) * s1
    np.testing.assert_allclose(a.timeline.token_t[:alone], first, rtol=1e-12)
    b_join = first[-1]
    # then both at the shared rate, A's steps and B's on the same boundaries
    np.testing.assert_allclose(a.timeline.token_t[alone:],
                               b_join + np.arange(1, 64 - alone + 1) * s2, rtol=1e-12)
    a_left = a.timeline.token_t[-1]
    np.testing.assert_allclose(b.timeline.token_t[:64 - alone],
                               b_join + np.arange(1, 64 - alone + 1) * s2, rtol=1e-12)
    # B decodes its last `alone` tokens alone
    assert b.timeline.token_t[-1] == pytest.approx(a_left + alone * step_s(3000), rel=1e-12)


size_only_split_codec("test-anchor-quarter", 2)  # an anchor of 1/4, a residual of 3/4


def test_draft_overhead_defaults_to_the_anchors_dequantization(tmp_path):
    # one request, anchor first on a slow link: it drafts while the residual arrives.
    # Default overhead per drafted token = anchor share x bf16 cache / decode throughput
    # (codec timing: 25 GB/s) = (anchor bytes / all bytes) x 1000 x 2048 B / 25e9 B/s.
    cfg = SimConfig(model=MODEL, hardware=HW, codecs=[{"name": "test-anchor-quarter"}],
                    codec_timing=_timing_file(tmp_path))
    cfg.link = replace(cfg.link, bandwidth_gbps=1.0)
    cfg.workload = replace(cfg.workload, context_tokens=1000, output_tokens=64)
    sc = Scenario(cfg, variants(cfg)[0], 1000, 1.0)
    sc.run()
    plan = sc.plan(1000)
    assert plan.speculative
    share = plan.stream_bytes[0] / plan.total_bytes
    assert share == pytest.approx(0.25, rel=3e-3)  # + chunk frame headers and the preamble
    overhead = share * 1000 * KV_PER_TOKEN / 25e9
    tl = sc.records[0].timeline
    assert tl.proposed > 0
    assert tl.draft_tpot_s == pytest.approx(step_s(1000) + overhead, rel=1e-9)
    # a configured overhead replaces it
    cfg.speculative = replace(cfg.speculative, draft_overhead_s=0.0)
    sc = Scenario(cfg, variants(cfg)[0], 1000, 1.0)
    sc.run()
    assert sc.records[0].timeline.draft_tpot_s == pytest.approx(step_s(1000), rel=1e-9)


def test_measured_profile_scales_the_batch_step(tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"model": "tiny", "prefill": {"tokens": [1, 4096],
                                                             "s": [0.01, 0.5]},
                                "tpot": {"context_tokens": [1, 4096], "s": [0.02, 0.03]}}))
    tm = TimingModel(MODEL, replace(HW, profile=str(prof)))
    f, k = tm.member_work(1, 2000)
    assert tm.batch_step_s(1, f, k, 1, 2000) == pytest.approx(tm.tpot_s(2000), rel=1e-12)
    assert tm.batch_step_s(2, 2 * f, 2 * k, 2, 4000) == pytest.approx(tm.tpot_s(2000, 2),
                                                                       rel=1e-12)
    assert tm.prefill_step_s([(1000, 0)]) == pytest.approx(tm.prefill_s(1000), rel=1e-12)


def test_a_full_cache_ready_while_joining_makes_the_one_pending_draft_then_verifies():
    # A decodes alone; S (speculative, cap 8) is ready mid-step and its full cache arrives
    # before the step ends: it still makes the one draft it joined for (as a decode loop
    # that posted it), then verifies it
    tm = TimingModel(MODEL, HW)
    s1, s2 = step_s(1000), step_s(1000, 1000)
    o = 0.002
    env = simpy.Environment()
    batch = DecodeBatch(env, tm)
    out = {}

    def plain():
        m = batch.join(0, 1000, 6)
        out["a"] = yield m.done

    def spec():
        yield env.timeout(0.5 * s1)
        m = batch.join(1, 1000, 3, cap=8, draft_overhead_s=o, sample_accepted=lambda n: n)
        yield env.timeout(0.2 * s1)
        assert m.phase == "join"
        batch.full_ready(m)
        out["s"] = yield m.done

    env.process(plain())
    env.process(spec())
    env.run()
    tl = out["s"]
    assert (tl.proposed, tl.accepted) == (1, 1)
    draft_t = s1 + s2 + o
    verify_end = draft_t + step_s(1000, 1000, new_tokens=(1, 1))
    np.testing.assert_allclose(tl.token_t[:2], [draft_t, verify_end], rtol=1e-12)


class _BesidePrefill(TimingModel):
    """The tiny model's roofline, with a step beside a colocated prefill costing 1.5x (one
    member) and 1.25x (two or more)."""

    def beside_prefill_ratio(self, batch: int) -> float:
        return 1.5 if batch == 1 else 1.25


def _beside_batch() -> tuple[simpy.Environment, DecodeBatch]:
    """A decode batch of the tiny model whose steps beside a prefill cost _BesidePrefill's."""
    env = simpy.Environment()
    return env, DecodeBatch(env, _BesidePrefill(MODEL, HW))


def _prefill(env, batch, t0, length_s):
    """A colocated prefill on the batch's host from t0 for length_s (a simpy process)."""
    yield env.timeout(t0)
    batch.prefills_running(+1)
    yield env.timeout(length_s)
    batch.prefills_running(-1)


def test_a_colocated_prefill_slows_the_steps_while_it_runs():
    # A (1000 tokens, 10 tokens) decodes alone at s1; a prefill on its host runs from 2.5
    # steps to 2.5 + 3 x 1.5 steps: the steps meanwhile take 1.5 s1 (3 of them: its 3rd to
    # its 5.5th token's time), then s1 again. A second prefill, after A left, changes
    # nothing.
    env, batch = _beside_batch()
    s1 = step_s(1000)
    out = {}

    def request():
        m = batch.join(0, 1000, 10)
        out[0] = (yield m.done).token_t

    env.process(request())
    env.process(_prefill(env, batch, 2.5 * s1, 4.5 * s1))
    env.process(_prefill(env, batch, 100 * s1, s1))  # after A left: no member to slow
    env.run()
    p0, p1 = 2.5 * s1, 7.0 * s1  # the prefill: 4.5 s1 = 3 steps at 1.5 s1
    want = [s1, 2 * s1,
            p0 + 0.5 * 1.5 * s1, p0 + 1.5 * 1.5 * s1, p0 + 2.5 * 1.5 * s1,  # beside it
            p1 + 0.5 * s1, p1 + 1.5 * s1, p1 + 2.5 * s1, p1 + 3.5 * s1, p1 + 4.5 * s1]
    np.testing.assert_allclose(out[0], want, rtol=1e-12)
    assert batch.changes == 4  # A joins, the prefill starts, ends, A leaves


def test_overlapping_colocated_prefills_slow_the_steps_once():
    env, batch = _beside_batch()
    s2 = step_s(1000, 1000)
    out = {}

    def request(i):
        m = batch.join(i, 1000, 6)
        out[i] = (yield m.done).token_t

    for i in (0, 1):
        env.process(request(i))
    env.process(_prefill(env, batch, s2, 1.25 * s2))  # the 2nd step, at 1.25 s2
    env.process(_prefill(env, batch, 1.5 * s2, 0.5 * s2))  # inside the first: no change
    env.run()
    want = [s2, 2.25 * s2, 3.25 * s2, 4.25 * s2, 5.25 * s2, 6.25 * s2]
    for i in (0, 1):
        np.testing.assert_allclose(out[i], want, rtol=1e-12)
    with pytest.raises(RuntimeError, match="never started"):
        batch.prefills_running(-1)


def _measured_cfg(tmp_path, entries: dict, **workload) -> SimConfig:
    """_two_request_cfg (B at 0.5 s) on a measured profile with `entries` added, and these
    workload settings."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({
        "model": "tiny", "prefill": {"tokens": [1, 4096], "s": [0.01, 0.4]},
        "tpot": {"context_tokens": [1, 4096], "s": [0.02, 0.03]}, **entries}))
    cfg = _two_request_cfg(tmp_path, 0.5)
    cfg.hardware = replace(HW, profile=str(prof))
    cfg.workload = replace(cfg.workload, **workload)
    return cfg


def _off_and_on(cfg_for, row_key: str) -> list[list]:
    """The records (by seq) of the scenario cfg_for(False), then cfg_for(True), whose row says
    `row_key` only when on."""
    runs = []
    for on in (False, True):
        cfg = cfg_for(on)
        sc = Scenario(cfg, variants(cfg)[0], 1000, 100.0)
        assert sc.run().get(row_key, False) is on
        runs.append(sorted(sc.records, key=lambda r: r.seq))
    return runs


def _colocated_cfg(tmp_path, colocated: bool, beside: dict | None) -> SimConfig:
    return _measured_cfg(tmp_path, {"tpot_beside_prefill": beside} if beside else {},
                         colocated_prefill=colocated)


def test_a_colocated_prefill_slows_a_decoding_request_while_it_runs(tmp_path):
    # A (1000 tokens) decodes alone when B arrives at 0.5 s: B's prefill (another prefill
    # instance) runs 0.5 s .. 0.5 + prefill_s(3000); A's steps meanwhile take 1.5x
    beside = {"context_tokens": 1000, "prefill_tokens": 3000, "batch": [1, 2],
              "ratio": [1.5, 1.2]}
    (a0, b0), (a1, b1) = _off_and_on(
        lambda on: _colocated_cfg(tmp_path, on, beside), "colocated_prefill")
    p0, p1 = b1.prefill_start_t, b1.prefill_end_t
    timing = TimingModel(MODEL, _colocated_cfg(tmp_path, True, beside).hardware)
    assert (p0, p1) == (b0.prefill_start_t, b0.prefill_end_t) == pytest.approx(
        (0.5, 0.5 + timing.prefill_s(3000)), rel=1e-12)
    assert a1.decode_start_t < p0 and a1.timeline.token_t[-1] > p1  # A decodes throughout
    t0, t1 = a0.timeline.token_t, a1.timeline.token_t
    step = float(np.diff(t0[:2])[0])
    before = t1 < p0
    np.testing.assert_allclose(t1[before], t0[before], rtol=1e-12)  # the same until then
    inside = np.flatnonzero((t1 > p0 + 1.5 * step) & (t1 < p1))
    assert len(inside) > 5
    np.testing.assert_allclose(np.diff(t1[inside]), 1.5 * step, rtol=1e-9)
    assert t1[-1] > t0[-1]
    # B's decode is unchanged by its own prefill (it decodes after it ends)
    assert b1.decode_start_t >= p1


def test_colocated_prefill_needs_the_step_measured_beside_a_prefill(tmp_path):
    from kvsim.transport.config import EmulateConfig

    cfg = _colocated_cfg(tmp_path, True, None)
    with pytest.raises(ValueError, match="beside_prefill_tokens"):
        Scenario(cfg, variants(cfg)[0], 1000, 100.0).run()
    cfg.workload = replace(cfg.workload, prefill_chunk_tokens=512)
    with pytest.raises(ValueError, match="chunked prefill"):
        cfg.workload.validate()
    ecfg = EmulateConfig(model=MODEL, hardware=HW)
    ecfg.workload = replace(ecfg.workload, colocated_prefill=True)
    with pytest.raises(ValueError, match="colocated_prefill tells the simulator"):
        ecfg._check_instances()


def test_a_colocated_prefill_is_counted_from_its_real_start_when_it_queued(tmp_path,
                                                                           monkeypatch):
    # three requests at once on one prefill instance: the second and third prefill start
    # when the one before ends (PrefillNode.start_at); each start and end is told to the
    # batch at the record's own prefill times
    beside = {"context_tokens": 1000, "prefill_tokens": 1000, "batch": [1, 2],
              "ratio": [1.5, 1.2]}
    cfg = _colocated_cfg(tmp_path, True, beside)
    cfg.workload = replace(cfg.workload, arrivals_t=[0.0, 0.0, 0.0],
                           arrivals_context_tokens=[1000, 1000, 1000], prefill_nodes=1)
    told = []
    real = DecodeBatch.prefills_running

    def spy(self, delta):
        told.append((self.env.now, delta))
        real(self, delta)
    monkeypatch.setattr(DecodeBatch, "prefills_running", spy)
    sc = Scenario(cfg, variants(cfg)[0], 1000, 100.0)
    sc.run()
    want = sorted([(r.prefill_start_t, +1) for r in sc.records] +
                  [(r.prefill_end_t, -1) for r in sc.records])
    assert sorted(told) == [pytest.approx(w) for w in want]
    starts = sorted(r.prefill_start_t for r in sc.records)
    assert starts[1] > starts[0] and starts[2] > starts[1]  # queued behind each other


def test_a_member_that_joins_during_a_colocated_prefill_steps_at_its_ratio():
    # the prefill starts while the batch is idle; A joins mid-prefill: its steps take 1.5 s1
    # until the prefill ends, then s1
    env, batch = _beside_batch()
    s1 = step_s(1000)
    out = {}

    def request():
        yield env.timeout(2.0 * s1)
        m = batch.join(0, 1000, 5)
        out[0] = (yield m.done).token_t

    env.process(_prefill(env, batch, 0.0, 2.0 * s1 + 3.0 * 1.5 * s1))
    env.process(request())
    env.run()
    t0, p1 = 2.0 * s1, 2.0 * s1 + 4.5 * s1
    np.testing.assert_allclose(out[0], [t0 + 1.5 * s1, t0 + 3.0 * s1, t0 + 4.5 * s1,
                                        p1 + s1, p1 + 2 * s1], rtol=1e-12)


class _BesideWorker(TimingModel):
    """The tiny model's roofline, a busy on-arrival worker adding step_s(1000) to a step
    (twice a lone step at 1,000 tokens)."""

    def beside_worker_extra_s(self) -> float:
        return step_s(1000)


def test_a_received_request_slows_the_steps_by_its_workers_busy_share():
    # A decodes alone at s1; B is received from 2 s1 to 2 s1 + 4.8 s1 with its worker busy
    # half the time: steps advance at 1 - 0.5 (1 - 1/2) = 0.75 of their rate, so they take
    # s1 / 0.75; C's reception (busy 0.9) overlaps B's last 2.4 s1: the shares add up to at
    # most 1 (steps at 1/2 the rate). A reception that ends without having begun, or one
    # that begins while the batch is idle, changes nothing.
    env = simpy.Environment()
    batch = DecodeBatch(env, _BesideWorker(MODEL, HW))
    s1 = step_s(1000)
    out = {}

    def request():
        m = batch.join(0, 1000, 12)
        out[0] = (yield m.done).token_t

    def reception(seq, t0, length_s, share):
        yield env.timeout(t0)
        batch.receiving(seq, share)
        yield env.timeout(length_s)
        batch.receiving(seq, None)

    env.process(request())
    env.process(reception(1, 2 * s1, 4.8 * s1, 0.5))
    env.process(reception(2, 4.4 * s1, 2.4 * s1 + 2 * s1, 0.9))
    env.run()
    # clock: 2 steps by 2 s1; 2.4 s1 at 0.75 -> 1.8 steps (3.8 by 4.4 s1); 2.4 s1 at 0.5
    # (shares 1.4 -> 1) -> 1.2 steps (5.0 by 6.8 s1); C alone, 2 s1 at 1 - 0.9/2 = 0.55 ->
    # 1.1 steps (6.1 by 8.8 s1); then at 1
    def t_of(v):
        if v <= 2:
            return v * s1
        if v <= 3.8:
            return 2 * s1 + (v - 2) * s1 / 0.75
        if v <= 5.0:
            return 4.4 * s1 + (v - 3.8) * s1 / 0.5
        if v <= 6.1:
            return 6.8 * s1 + (v - 5.0) * s1 / 0.55
        return 8.8 * s1 + (v - 6.1) * s1
    np.testing.assert_allclose(out[0], [t_of(v) for v in range(1, 13)], rtol=1e-12)
    batch.receiving(7, None)  # never began: nothing to undo
    with pytest.raises(ValueError, match="busy share must be in"):
        batch.receiving(8, 1.5)


def _worker_cfg(tmp_path, slows: bool, beside: dict | None,
                deserializer: str = "on_arrival") -> SimConfig:
    cfg = _measured_cfg(tmp_path, {"tpot_beside_worker": beside} if beside else {},
                        worker_slows_decode=slows)
    cfg.link = replace(cfg.link, bandwidth_gbps=0.1)  # B's reception overlaps A's decode
    cfg.deserializer = deserializer
    return cfg


def test_a_received_request_slows_a_decoding_request_while_its_worker_works(tmp_path,
                                                                            monkeypatch):
    # A (1000 tokens) decodes when B's cache arrives over 0.1 Gbps and is dequantized on
    # arrival: from B's first message to its last layer, A's steps cost
    # 1 / (1 - u e / (step + e)), e = 20 ms a busy worker adds to a step and u the share of
    # that time B's worker is projected busy (told to the batch)
    beside = {"context_tokens": 1000, "codec": "bf16", "batch": [1, 2], "ratio": [2.0, 1.5],
              "extra_s": 0.02}
    told = []
    real = DecodeBatch.receiving

    def spy(self, seq, share):
        told.append((self.env.now, seq, share))
        real(self, seq, share)
    monkeypatch.setattr(DecodeBatch, "receiving", spy)
    (a0, b0), (a1, b1) = _off_and_on(
        lambda on: _worker_cfg(tmp_path, on, beside), "worker_slows_decode")
    begins = {seq: (t, share) for t, seq, share in told if share is not None}
    ends = {seq: t for t, seq, share in told if share is None}
    assert set(begins) == set(ends) == {0, 1}
    t_on, share = begins[1]
    t_off = ends[1]
    assert t_off == pytest.approx(b1.full_ready_t, rel=1e-12)  # B's last layer dequantized
    assert b1.full_ready_t == b0.full_ready_t  # (the transfers themselves are unchanged)
    assert b1.prefill_start_t < t_on < b1.all_arrival_t  # its first message, not its last
    assert 0.0 < share < 1.0
    assert begins[0][0] < a1.decode_start_t  # A's own reception came before it decoded
    t0, t1 = a0.timeline.token_t, a1.timeline.token_t
    step = float(np.diff(t0[:2])[0])
    before = t1 < t_on
    np.testing.assert_allclose(t1[before], t0[before], rtol=1e-12)
    inside = np.flatnonzero((t1 > t_on + 2 * step) & (t1 < t_off))
    assert len(inside) > 5
    np.testing.assert_allclose(np.diff(t1[inside]), step / (1 - share * 0.02 / (step + 0.02)),
                               rtol=1e-9)
    assert t1[-1] > t0[-1]


def test_worker_slows_decode_needs_the_measurement_and_a_worker(tmp_path):
    from kvsim.transport.config import EmulateConfig

    cfg = _worker_cfg(tmp_path, True, None)
    with pytest.raises(ValueError, match="beside_worker_tokens"):
        Scenario(cfg, variants(cfg)[0], 1000, 100.0).run()
    beside = {"context_tokens": 1000, "codec": "bf16", "batch": [1], "ratio": [2.0],
              "extra_s": 0.02}
    cfg = _worker_cfg(tmp_path, True, beside, deserializer="shared")
    with pytest.raises(ValueError, match="deserializer=shared has no such worker"):
        cfg.validate()
    ecfg = EmulateConfig(model=MODEL, hardware=HW)
    ecfg.workload = replace(ecfg.workload, worker_slows_decode=True)
    with pytest.raises(ValueError, match="worker_slows_decode tells the simulator"):
        ecfg._check_instances()
