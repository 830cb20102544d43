"""Simulator inputs: codec timing files, hardware roofline / measured profile, the policy
plan's byte accounting, the serial-pipeline closed form, and `kvsim bench sim` plumbing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvsim.kernels.presets import resolve_codec
from kvsim.model.hardware import HardwareSpec
from kvsim.model.spec import ModelSpec
from kvsim.scenario.codec_timing import TIMING_DIR, from_bench_report, load_codec_timing
from kvsim.scenario.policy import build_plan, serial_pipeline
from kvsim.scenario.timing_model import TimingModel

MODEL = ModelSpec(name="m", layers=2, attention_heads=4, kv_heads=2, head_dim=64,
                  hidden_size=256, params_total=1e9, params_active=1e9)


def _write(tmp_path, doc):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    return p


def test_every_shipped_timing_file_loads_and_states_its_source():
    files = sorted(TIMING_DIR.glob("*.json"))
    assert {p.stem for p in files} >= {"h100", "h200", "a100", "h20", "ascend-910b4",
                                       "local-cpu"}
    for p in files:
        table = load_codec_timing(p.stem)
        # a default entry (for codecs not listed) is optional: lookup then fails clearly
        for entry in [*table.entries.values(), *([table.default] if table.default else [])]:
            assert entry.source in ("measured", "assumed") and entry.note


def test_timing_entries_without_provenance_are_refused(tmp_path):
    base = {"encode_gb_per_s": 1.0, "decode_gb_per_s": 2.0}
    for entry, msg in (({**base, "source": "assumed"}, "assumption"),
                       ({**base, "source": "measured"}, "command"),
                       ({**base, "source": "guess"}, "source must be"),
                       ({"encode_gb_per_s": 1.0, "source": "assumed", "assumption": "x"},
                        "decode_gb_per_s")):
        p = _write(tmp_path, {"version": 1, "codecs": {"c": entry}})
        with pytest.raises(ValueError, match=msg):
            load_codec_timing("x", p)
    p = _write(tmp_path, {"version": 1, "codecs": {}})
    with pytest.raises(ValueError, match="no codec timing for"):
        load_codec_timing("x", p).lookup("lynx", "lynx")


def test_layer_job_fit_is_fixed_plus_bytes_and_checked(tmp_path):
    """The optional on-arrival layer-job fit: a job costs fixed + bytes / rate (the
    anchor's with its own pair), tensor-parallel devices share the bytes, not the fixed
    part; without a fit the plain rates time it; a half pair or a bad number is refused."""
    base = {"encode_gb_per_s": 1.0, "decode_gb_per_s": 0.1, "anchor_decode_gb_per_s": 0.2,
            "source": "assumed", "assumption": "x"}
    fit = {"layer_job_fixed_s": 0.004, "layer_job_gb_per_s": 0.5,
           "anchor_layer_job_fixed_s": 0.003, "anchor_layer_job_gb_per_s": 1.0}
    t = load_codec_timing("x", _write(tmp_path, {"version": 1, "codecs": {
        "c": {**base, **fit}}})).lookup("c", "c")
    assert t.layer_job_s(1e6) == pytest.approx(0.004 + 0.002)
    assert t.layer_job_s(1e6, devices=2) == pytest.approx(0.004 + 0.001)
    assert t.layer_job_s(1e6, anchor=True) == pytest.approx(0.003 + 0.001)
    np.testing.assert_allclose(t.layer_job_s(np.array([0.0, 2e6])), [0.004, 0.008])
    plain = load_codec_timing("x", _write(tmp_path, {"version": 1, "codecs": {
        "c": base}})).lookup("c", "c")
    assert plain.layer_job_s(1e6) == pytest.approx(0.01)
    assert plain.layer_job_s(1e6, anchor=True) == pytest.approx(0.005)
    for bad, msg in (({"layer_job_fixed_s": 0.004}, "go together"),
                     ({**fit, "layer_job_fixed_s": -1.0}, "finite and >= 0"),
                     ({**fit, "anchor_layer_job_gb_per_s": 0}, "finite and > 0"),
                     ({**fit, "layer_job_gb_per_s": float("nan")}, "finite"),
                     ({**fit, "layer_job_fixed_s": True}, "finite"),
                     ({**fit, "layer_job_fixed_s": "1"}, "finite")):
        p = _write(tmp_path, {"version": 1, "codecs": {"c": {**base, **bad}}})
        with pytest.raises(ValueError, match=msg):
            load_codec_timing("x", p)


def test_bench_report_becomes_a_measured_timing_file(tmp_path):
    report = _write(tmp_path, {"rows": [{"codec": "int8", "encode_gbps": 3.0,
                                         "decode_gbps": 6.0, "device": "cpu"}]})
    doc = from_bench_report(report, "local-cpu", "kvsim bench codecs")
    out = tmp_path / "local.json"
    out.write_text(json.dumps(doc))
    t = load_codec_timing("local-cpu", out).lookup("int8", "uniform")
    assert (t.encode_gb_per_s, t.decode_gb_per_s, t.source) == (3.0, 6.0, "measured")
    assert t.encode_s(6e9, devices=2) == pytest.approx(1.0)


def test_roofline_memory_bound_decode_and_compute_bound_prefill():
    hw = HardwareSpec(name="h", hbm_gb_per_s=1000.0, bf16_tflops=100.0, memory_gb=80.0,
                      prefill_mfu=0.5, decode_mbu=0.5)
    tm = TimingModel(MODEL, hw)
    kv = MODEL.kv_bytes_bf16(1001)  # context + the new token
    assert tm.tpot_s(1000) == pytest.approx((2e9 + kv) / (1000e9 * 0.5), rel=1e-12)
    flops = MODEL.forward_flops(4096, 0)
    assert tm.prefill_s(4096) == pytest.approx(flops / (100e12 * 0.5), rel=1e-12)
    two = TimingModel(MODEL, HardwareSpec(name="h2", hbm_gb_per_s=1000.0, bf16_tflops=100.0,
                                          memory_gb=80.0, prefill_mfu=0.5, decode_mbu=0.5,
                                          devices=2))
    assert two.tpot_s(1000) == pytest.approx(tm.tpot_s(1000) / 2, rel=1e-12)
    assert tm.verify_s(8, 1000) > tm.verify_s(1, 1000) > 0
    with pytest.raises(ValueError, match=r"raise hardware.devices \(hardware.devices=3 fits\)"):
        TimingModel(MODEL, HardwareSpec(name="s", hbm_gb_per_s=1.0, bf16_tflops=1.0,
                                        memory_gb=1.0)).check_fits(1000)


def test_measured_profile_overrides_the_roofline(tmp_path):
    prof = _write(tmp_path, {"model": "m", "prefill": {"tokens": [1000, 3000], "s": [1.0, 2.0]},
                             "tpot": {"context_tokens": [0, 10000], "s": [0.01, 0.03]}})
    hw = HardwareSpec(name="h", hbm_gb_per_s=1000.0, bf16_tflops=100.0, memory_gb=80.0,
                      profile=str(prof))
    tm = TimingModel(MODEL, hw)
    assert tm.prefill_s(2000) == pytest.approx(1.5)
    assert tm.tpot_s(5000) == pytest.approx(0.02)
    wrong = _write(tmp_path, {"model": "other", "prefill": {}, "tpot": {}})
    with pytest.raises(ValueError, match="not 'm'"):
        TimingModel(MODEL, HardwareSpec(name="h", hbm_gb_per_s=1.0, bf16_tflops=1.0,
                                        memory_gb=1.0, profile=str(wrong)))


def test_serial_pipeline_matches_the_recurrence():
    rng = np.random.default_rng(0)
    ready = np.sort(rng.uniform(0, 1, 50))
    work = rng.uniform(0, 0.05, 50)
    f, out = 0.3, []
    for r, w in zip(ready, work, strict=True):
        f = max(f, r) + w
        out.append(f)
    np.testing.assert_allclose(serial_pipeline(ready, work, 0.3), out, rtol=1e-12)


@pytest.mark.parametrize("policy", ["monolithic", "layerwise", "split_stream"])
@pytest.mark.parametrize("granularity", ["page", "layer"])
def test_plan_carries_exactly_the_codec_bytes(policy, granularity):
    spec = resolve_codec({"name": "bf16", "params": {"page_tokens": 96}})
    shape = MODEL.kv_shape(1000)
    table = spec.build().size_table(shape)
    timing = load_codec_timing("local-cpu").lookup("bf16", "bf16")
    plan = build_plan(table, shape, policy, timing, 1, granularity)
    assert sum(float(f.sizes_bytes.sum()) for f in plan.flows) == table.total_bytes
    assert plan.total_bytes == table.total_bytes == sum(plan.stream_bytes)
    deser = sum(float(f.deserialize_s.sum()) for f in plan.flows)
    assert deser == pytest.approx(shape.bf16_bytes / (timing.decode_gb_per_s * 1e9), rel=1e-12)
    assert plan.encode_s.sum() == pytest.approx(
        shape.bf16_bytes / (timing.encode_gb_per_s * 1e9), rel=1e-12)


def test_bench_sim_runs_small_cases(capsys):
    from kvsim.commands import bench_sim

    cfg = bench_sim.Config(
        cases={"tiny": ["scenario=none", "model=smollm2-135m", "hardware=h100",
                        "workload.context_tokens=2048", "codecs=[int8]"],
               "tiny-multi": ["scenario=none", "model=smollm2-135m", "hardware=h100",
                              "workload=poisson", "workload.requests=30",
                              "workload.prefill_nodes=2", "workload.decode_nodes=2",
                              "codecs=[int8]", "granularity=layer"]},
        targets_s={"tiny": 100.0}, repeats=2, baseline_events=1000,
        scaling={"tiny-multi": bench_sim.Scaling(base="tiny", max_ratio=1e6)})
    rows = bench_sim.run(cfg)
    assert [r["case"] for r in rows] == ["tiny", "tiny-multi"]
    assert rows[0]["meets_target"] is True and rows[1]["requests"] == 30
    # the scaling ratio divides the two cases' best times of this run
    assert rows[1]["scaling_ratio"] == pytest.approx(rows[1]["wall_s"] / rows[0]["wall_s"])
    assert rows[1]["scaling_base"] == "tiny" and rows[1]["meets_scaling"] is True
    assert rows[0]["scaling_ratio"] is None and rows[0]["meets_scaling"] is None
    assert all(r["events"] > 0 and r["messages"] > 0 and r["wall_s"] > 0 for r in rows)
    assert rows[1]["ms_per_request"] == pytest.approx(1e3 * rows[1]["wall_s"] / 30)
    out = capsys.readouterr().out
    assert "events/s" in out and "ms/request" in out
    assert "scaling: tiny-multi took" in out and "30x its requests" in out and "met)" in out


@pytest.mark.parametrize("max_ratio", [0.0, -1.0, float("nan")])
def test_bench_sim_refuses_a_scaling_goal_that_is_not_positive(max_ratio):
    from kvsim.commands import bench_sim

    cfg = bench_sim.Config(cases={"tiny": ["scenario=none"]}, repeats=1,
                           scaling={"tiny": bench_sim.Scaling(base="tiny", max_ratio=max_ratio)})
    with pytest.raises(ValueError, match="max_ratio must be > 0"):
        bench_sim.run(cfg)


def test_bench_sim_alternates_repeats_and_notes_a_scaling_whose_case_is_left_out(
        monkeypatch, capsys):
    from kvsim.commands import bench_sim

    order = []

    class FakeScenario:  # records the order of the timed runs
        def __init__(self, cfg, variant, context_tokens, bandwidth_gbps):
            self.name = "multi" if cfg.workload.requests > 1 else "single"

        def run(self):
            order.append(self.name)
            return {"model": "m", "codec": "c", "transfer": "t", "requests": 1,
                    "context_tokens": 1, "events": 1, "messages": 1, "ttft_s": 0.0,
                    "sim_end_s": 0.0, "link_utilisation": 0.0}

    monkeypatch.setattr(bench_sim, "Scenario", FakeScenario)
    cfg = bench_sim.Config(
        cases={"a": ["scenario=none"], "b": ["scenario=none", "workload=poisson"]},
        repeats=3, baseline_events=100,
        scaling={"c": bench_sim.Scaling(base="a", max_ratio=12.0)})
    rows = bench_sim.run(cfg)
    assert order == ["single", "multi"] * 3  # a, b, a, b, ...: not a, a, a, b, b, b
    assert "note: scaling.c not measured: no case 'c'" in capsys.readouterr().out
    assert all(r["scaling_ratio"] is None for r in rows)
