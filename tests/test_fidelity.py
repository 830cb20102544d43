"""kvsim validate's error arithmetic (kvsim.fidelity.errors) and the simulator's
deserializer=on_demand, the receiver model validation runs with."""

from __future__ import annotations

import json
import math

import pytest

from kvsim.fidelity import errors


def test_value_reads_int_and_string_keys_and_compare_signs_the_error():
    m32 = errors.Metric("tt32t", "ttkt_from_prefill_end_s", "32")
    assert errors.value({"ttkt_from_prefill_end_s": {32: 2.0}}, m32) == 2.0
    assert errors.value({"ttkt_from_prefill_end_s": {"32": 2.5}}, m32) == 2.5
    assert math.isnan(errors.value({"ttkt_from_prefill_end_s": {"8": 1.0}}, m32))
    assert math.isnan(errors.value({}, errors.Metric("ttft", "ttft_s")))
    rows = errors.compare({"codec": "int8"}, {"ttft_s": 2.0}, {"ttft_s": 2.2},
                          [errors.Metric("ttft", "ttft_s")])
    assert rows == [{"codec": "int8", "metric": "ttft", "measured_s": 2.0, "simulated_s": 2.2,
                     "error_pct": pytest.approx(10.0)}]
    low = errors.compare({}, {"ttft_s": 4.0}, {"ttft_s": 3.0}, [errors.Metric("t", "ttft_s")])
    assert low[0]["error_pct"] == pytest.approx(-25.0)


def test_repeated_requests_give_the_mean_and_how_far_apart_they_land():
    """A measured row aggregated over repeated requests (aggregate_rows: `per_request`)
    carries their range over their mean; the summary averages it (the noise floor)."""
    m = errors.Metric("tt32t", "ttkt_from_prefill_end_s", "32")
    per = [{"ttkt_from_prefill_end_s": {"32": v}} for v in (2.7, 3.0, 3.3)]
    measured = {"ttkt_from_prefill_end_s": {"32": 3.0}, "per_request": per}
    row, = errors.compare({}, measured, {"ttkt_from_prefill_end_s": {"32": 3.3}}, [m])
    assert row["error_pct"] == pytest.approx(10.0)
    assert row["measured_spread_pct"] == pytest.approx(20.0)  # (3.3 - 2.7) / 3.0
    assert math.isnan(errors.spread_pct([1.0])) and math.isnan(errors.spread_pct([]))
    other = {**row, "measured_spread_pct": 10.0, "error_pct": 2.0}
    s = errors.summary([row, other, {"error_pct": 1.0, "metric": "x"}])
    assert s["mean_measured_spread_pct"] == pytest.approx(15.0)
    assert math.isnan(errors.summary([{"error_pct": 1.0}])["mean_measured_spread_pct"])


def test_summary_means_absolute_errors_and_counts_missing():
    rows = [{"metric": "a", "error_pct": -4.0, "measured_s": 1, "simulated_s": 1},
            {"metric": "b", "error_pct": 2.0, "measured_s": 1, "simulated_s": 1},
            {"metric": "c", "error_pct": math.nan, "measured_s": 1, "simulated_s": 1}]
    s = errors.summary(rows)
    assert s["mean_abs_pct_error"] == pytest.approx(3.0)
    assert s["max_abs_pct_error"] == pytest.approx(4.0)
    assert (s["compared"], s["missing"]) == (2, 1)
    assert s["worst"]["metric"] == "a"
    empty = errors.summary([])
    assert empty["compared"] == 0 and math.isnan(empty["mean_abs_pct_error"])


def test_single_metrics_cover_drafted_and_committed():
    names = [m.name for m in errors.single_metrics([32, 64])]
    assert names == ["ttft", "tt32t", "tt64t", "ttft_c", "tt32t_c", "tt64t_c"]


def test_markdown_table_one_line_per_scenario_and_codec():
    single = errors.compare({"case": "single", "emulation": "tc", "bandwidth_gbps": 0.1,
                             "context_tokens": 1024, "codec": "int8"},
                            {"ttft_from_prefill_end_s": 1.0}, {"ttft_from_prefill_end_s": 1.1},
                            errors.single_metrics([])[:1])
    multi = errors.compare({"case": "multi", "emulation": "tc", "bandwidth_gbps": 0.2,
                            "context_tokens": 1024, "codec": "lynx", "rate_per_s": 0.3},
                           {"ttft_pct_s": {"p50": 2.0}}, {"ttft_pct_s": {"p50": 1.9}},
                           errors.MULTI_METRICS[:1])
    text = errors.markdown_table(single + multi)
    assert "| tc | 0.1 | 1024 | int8 | 1.000 / 1.100 (ttft) | +10.0 |" in text
    assert "| tc | 0.2 | 1024 | 0.3 | lynx | 2.000 / 1.900 (ttft_p50) | -5.0 |" in text


def test_the_decode_step_is_compared_once_per_scenario_and_codec():
    # TT<k>T of a long decode is mostly k steps: the rows carry both engines' step, the
    # table shows it, and the summary averages its error once per (scenario, codec)
    scenario = {"case": "single", "emulation": "tc", "bandwidth_gbps": 1.0,
                "context_tokens": 1024, "codec": "int8", "tpot_measured_s": 0.080,
                "tpot_simulated_s": 0.088}
    rows = errors.compare(scenario, {"ttft_from_prefill_end_s": 1.0,
                                     "ttkt_from_prefill_end_s": {"32": 3.0}},
                          {"ttft_from_prefill_end_s": 1.0, "ttkt_from_prefill_end_s": {32: 3.3}},
                          errors.single_metrics([32])[:2])
    other = errors.compare({**scenario, "codec": "bf16", "tpot_simulated_s": 0.076},
                           {"ttft_from_prefill_end_s": 1.0}, {"ttft_from_prefill_end_s": 1.0},
                           errors.single_metrics([])[:1])
    assert errors.step_error_pct(rows[0]) == pytest.approx(10.0)
    s = errors.summary(rows + other)
    assert s["step_mean_abs_pct_error"] == pytest.approx(7.5)  # (10 + 5) / 2, not 3 rows
    assert s["step_max_abs_pct_error"] == pytest.approx(10.0)
    text = errors.markdown_table(rows + other)
    assert "| link | Gbps | ctx | codec | measured / simulated s | step ms | ttft % |" in text
    assert "| tc | 1 | 1024 | int8 | 3.000 / 3.300 (tt32t) | 80.0 / 88.0 | +0.0 | +10.0 |" in text
    # read back from fidelity.json, where a NaN is null: the same table and summary
    from kvsim.core.report import json_safe

    missing = {**rows[0], "metric": "tt64t", "simulated_s": math.nan, "error_pct": math.nan,
               "measured_spread_pct": math.nan}
    back = json.loads(json.dumps(json_safe(rows + other + [missing])))
    assert back[-1]["error_pct"] is None
    assert errors.summary(back)["step_mean_abs_pct_error"] == pytest.approx(7.5)
    assert errors.summary(back)["missing"] == 1
    assert "| 80.0 / 88.0 | +0.0 | +10.0 |" in errors.markdown_table(back)
    # without steps in the rows (a multi-request case, older reports): no column, no figure
    assert math.isnan(errors.summary([{"error_pct": 1.0}]).get("step_mean_abs_pct_error",
                                                                 math.nan))
    assert "step ms" not in errors.markdown_table(
        errors.compare({"case": "single", "emulation": "tc", "bandwidth_gbps": 1.0,
                        "context_tokens": 1024, "codec": "int8"},
                       {"ttft_from_prefill_end_s": 1.0}, {"ttft_from_prefill_end_s": 1.0},
                       errors.single_metrics([])[:1]))


def test_plot_kind_fidelity_draws_a_validate_report(tmp_path):
    import json

    from kvsim.cli.main import main

    rows = errors.compare({"case": "single", "emulation": "token_bucket",
                           "bandwidth_gbps": 0.1, "context_tokens": 1024, "codec": "int8"},
                          {"ttft_from_prefill_end_s": 1.0, "ttkt_from_prefill_end_s": {"32": 3.0}},
                          {"ttft_from_prefill_end_s": 1.05,
                           "ttkt_from_prefill_end_s": {"32": 2.9}},
                          errors.single_metrics([32])[:2])
    report = tmp_path / "validate.json"
    report.write_text(json.dumps({"command": "validate", "rows": rows,
                                  "fidelity": errors.summary(rows)}))
    out = tmp_path / "fidelity.png"
    assert main(["plot", "kind=fidelity", f"input={report}", f"out={out}",
                 "formats=[png]"]) == 0
    assert out.is_file() and out.stat().st_size > 1000


def test_both_engines_run_the_receiver_mode_the_codec_timing_was_measured_in(tmp_path):
    import json

    from kvsim.fidelity.runner import find_profiles, scenario_overrides, sim_overrides

    for d in ("hardware", "codec_timing", "link"):
        (tmp_path / d).mkdir()
    (tmp_path / "hardware" / "p.json").write_text("{}")
    (tmp_path / "link" / "p-token-bucket.json").write_text("{}")
    ct = tmp_path / "codec_timing" / "p.json"
    for doc, mode in (({}, "on_demand"), ({"receiver_dequantize": "on_arrival"}, "on_arrival")):
        ct.write_text(json.dumps(doc))
        prof = find_profiles(tmp_path, "p", ["token_bucket"])
        assert prof.dequantize == mode
        common = scenario_overrides("smollm2-135m", "token_bucket", 0.1, ["int8"], [], [32],
                                    prof)
        assert f"transport.dequantize={mode}" in common
        # both engines read the link profile (the emulator's timing decode: its draft step)
        assert f"link.profile={tmp_path / 'link' / 'p-token-bucket.json'}" in common
        # the draft step is the receiver mode's (kvsim.scenario.speculative.receiver_draft_s)
        assert not any(o.startswith("speculative.draft_overhead_s") for o in common)
        sim = sim_overrides(common, prof, "x", 1)
        assert f"deserializer={mode}" in sim
        assert not any(o.startswith("transport.") for o in sim)


def test_step_probe_scales_the_step_curves_and_the_hosts_other_work_to_the_probe(tmp_path):
    import json

    from kvsim.calibrate.host_probe import StepProbe
    from kvsim.fidelity.step_probe import probed_companions, probed_profile
    from kvsim.model.hardware_profile import load_profile
    from kvsim.model.presets import load_model_preset

    doc = {"model": "m", "prefill": {"tokens": [100, 300], "s": [1.0, 3.0]},
           "tpot": {"context_tokens": [100, 300], "s": [0.1, 0.2]},
           "tpot_batch": {"context_tokens": 300, "batch": [1, 2], "s": [0.2, 0.3]},
           "verify": {"context_tokens": 300, "drafted_tokens": [1], "s": [0.4]},
           "first_step_extra": {"context_tokens": [100, 300], "s": [0.01, 0.01]},
           "cache_build": {"gb_per_s": 3.0}}
    src, out = tmp_path / "hw.json", tmp_path / "probed" / "hw.json"
    src.write_text(json.dumps(doc))
    scale = probed_profile(src, 200, 0.3, out)  # calibrated 0.15 s at 200: twice as slow now
    assert scale == pytest.approx(2.0)
    got = load_profile(str(out), "m")
    assert got["tpot"]["s"] == pytest.approx([0.2, 0.4])
    assert got["tpot_batch"]["s"] == pytest.approx([0.4, 0.6])
    assert got["verify"]["s"] == pytest.approx([0.8])
    assert got["prefill"]["s"] == [1.0, 3.0]  # not a decode step: as calibrated
    assert got["first_step_extra"]["s"] == [0.01, 0.01]
    assert got["step_probe"]["probe_s"] == 0.3 and got["step_probe"]["from_profile"] == str(src)
    assert got["cache_build"]["gb_per_s"] == pytest.approx(1.5)  # the receiver's work too
    with pytest.raises(ValueError, match="probe"):
        probed_profile(src, 200, float("nan"), out)
    # the codecs' and the link's CPU work scaled with the step; the link's own terms, the
    # ratios to a step and a drift rescale's record as they were
    timing = {"source": "measured", "codecs": {"int8": {
        "encode_gb_per_s": 2.0, "decode_gb_per_s": 4.0, "layer_job_fixed_s": 0.001,
        "layer_job_gb_per_s": 1.0, "name": "int8"}}, "drift": {"factor": 1.1}}
    link = {"name": "l-tc", "efficiency": 0.95, "latency_s": 0.001, "handshake_s": 0.004,
            "draft_step": {"ratio": 1.3, "busy_ratio": 2.5, "ingest_s_per_byte": 2e-9}}
    (tmp_path / "ct.json").write_text(json.dumps(timing))
    (tmp_path / "link.json").write_text(json.dumps(link))
    ct_path, link_path = probed_companions(tmp_path / "ct.json", tmp_path / "link.json", scale,
                                           tmp_path / "probed", "s1", {"step_s": 0.3})
    assert ct_path.name == "s1-codec-timing.json" and link_path.name == "s1-link.json"
    ct, lk = (json.loads(p.read_text()) for p in (ct_path, link_path))
    assert ct["codecs"]["int8"].pop("name") == "int8"
    assert ct["codecs"]["int8"] == pytest.approx({
        "encode_gb_per_s": 1.0, "decode_gb_per_s": 2.0, "layer_job_fixed_s": 0.002,
        "layer_job_gb_per_s": 0.5})
    assert ct["drift"] == {"factor": 1.1} and "drift" not in lk
    for doc, path in ((ct, "ct.json"), (lk, "link.json")):
        what = doc["step_level"].pop("what")
        assert doc["step_level"] == {"step_s": 0.3, "from_profile": str(tmp_path / path),
                                     "factor": pytest.approx(2.0)}
        assert " x 2" in what
    assert lk["handshake_s"] == pytest.approx(0.008)
    assert lk["draft_step"] == {"ratio": 1.3, "busy_ratio": 2.5,
                                "ingest_s_per_byte": pytest.approx(4e-9)}
    assert (lk["efficiency"], lk["latency_s"]) == (0.95, 0.001)
    # the probe times the real model's steps (tiny random model here)
    probe = StepProbe(load_model_preset("tiny-random"), steps=3)
    first = probe.step_s(32)
    held = probe._kv[32]
    assert 0 < first < 5 and probe.step_s(32) > 0
    assert list(probe._kv) == [32] and probe._kv[32] is held  # the prompt's KV is reused
