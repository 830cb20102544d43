"""Simulator configuration: NaN / inf / out-of-range values are refused with the key named,
at the CLI (non-zero exit, no traceback) and in the config objects and the link."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import simpy

from kvsim.cli.main import main
from kvsim.model.hardware import HardwareSpec
from kvsim.model.spec import ModelSpec
from kvsim.scenario.config import MetricsConfig, SimConfig, SpeculativeConfig
from kvsim.sim.link import Link

SMALL = ["scenario=none", "model=smollm2-135m", "hardware=h100", "workload.context_tokens=512",
         "codecs=[int8]"]


@pytest.mark.parametrize("override, key", [
    ("link.bandwidth_gbps=nan", "link.bandwidth_gbps must be finite"),
    ("link.bandwidth_gbps=inf", "link.bandwidth_gbps must be finite"),
    ("link.latency_s=nan", "link.latency_s must be finite"),
    ("link.message_overhead_bytes=-1", "link.message_overhead_bytes must be >= 0"),
    ("link.trace=[[0.5,nan]]", r"link.trace\[0\] gbps must be finite"),
    ("link.trace=[[1.0,5.0],[0.5,5.0]]", "non-decreasing"),
    ("metrics.ks=[0,8]", "metrics.ks: 0 is not a token index in 1..128"),
    ("metrics.ks=[1,-3]", "metrics.ks: -3"),
    ("metrics.ks=[1,129]", "metrics.ks: 129"),
    ("metrics.breakdown_k=200", "metrics.breakdown_k: 200"),
    ("speculative.cap_tokens=-1", "speculative.cap_tokens"),
    ("speculative.draft_overhead_s=nan", "speculative.draft_overhead_s must be finite"),
    ("workload.rate_per_s=nan", "workload.rate_per_s must be finite"),
    ("workload.azure_trace=chat", "workload.azure_trace must be one of"),
    ("workload.azure_arrivals=bursty", "workload.azure_arrivals must be one of"),
    ("hardware.hbm_gb_per_s=nan", "hbm_gb_per_s must be finite"),
    ("hardware.step_overhead_s=inf", "step_overhead_s must be finite"),
    ("model.params_total=inf", "params_total must be finite"),
    ("deserializer=teleport", "deserializer must be one of"),
])
def test_cli_refuses_bad_numbers_with_the_key(capsys, override, key):
    rc = main(["sim", *SMALL, override])
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    assert re.search(key, err), err


def test_cli_still_runs_the_small_case(capsys):
    assert main(["sim", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "int8" in out and " nan" not in out


def _model():
    return ModelSpec(name="m", layers=2, attention_heads=4, kv_heads=2, head_dim=64,
                     hidden_size=256, params_total=1e9, params_active=1e9)


def _hw(**kw):
    return HardwareSpec(name="h", hbm_gb_per_s=1000.0, bf16_tflops=100.0, memory_gb=80.0, **kw)


def test_config_objects_validate_ranges():
    cfg = SimConfig(model=_model(), hardware=_hw())
    cfg.validate()  # the defaults are valid
    with pytest.raises(ValueError, match="speculative.cap_tokens"):
        SpeculativeConfig(cap_tokens=-2).validate()
    with pytest.raises(ValueError, match="speculative.draft_overhead_s must be >= 0"):
        SpeculativeConfig(draft_overhead_s=-0.1).validate()
    SpeculativeConfig(cap_tokens=0).validate()  # 0: no drafting, allowed
    with pytest.raises(ValueError, match=r"metrics.ks: 9 is not a token index in 1..8"):
        MetricsConfig(ks=[1, 9], breakdown_k=1).resolve(output_tokens=8)
    with pytest.raises(ValueError, match=r"metrics.breakdown_k: 9 is not"):
        MetricsConfig(ks=[1], breakdown_k=9).resolve(output_tokens=8)
    auto = MetricsConfig()  # empty ks / breakdown_k 0: the standard k's that are decoded
    auto.resolve(output_tokens=40)
    assert (auto.ks, auto.breakdown_k) == ([1, 8, 16, 32], 32)
    auto = MetricsConfig()
    auto.resolve(output_tokens=5)
    assert (auto.ks, auto.breakdown_k) == ([1], 5)
    for link in (replace(cfg.link, bandwidth_gbps=math.nan), replace(cfg.link, latency_s=-1.0),
                 replace(cfg.link, trace=[[math.inf, 1.0]]), replace(cfg.link, trace=[[1.0]])):
        with pytest.raises(ValueError, match="link"):
            replace(cfg, link=link).validate()
    with pytest.raises(ValueError, match="samples"):
        replace(cfg, samples=0).validate()
    with pytest.raises(ValueError, match="decode_mbu must be finite"):
        _hw(decode_mbu=math.nan)
    with pytest.raises(ValueError, match="prefill_mfu is a fraction"):
        _hw(prefill_mfu=1.5)
    with pytest.raises(ValueError, match="params_active must be finite"):
        replace(_model(), params_active=math.nan)


def test_link_refuses_non_finite_numbers_and_accepts_equal_trace_times():
    env = simpy.Environment()
    for kw, msg in ((dict(bandwidth_gbps=math.nan), "bandwidth_gbps must be finite"),
                    (dict(bandwidth_gbps=-1.0), "bandwidth_gbps must be > 0"),
                    (dict(bandwidth_gbps=1.0, latency_s=math.nan), "latency_s must be finite"),
                    (dict(bandwidth_gbps=1.0, message_overhead_bytes=math.inf), "finite"),
                    (dict(bandwidth_gbps=1.0, trace=[[math.nan, 1.0]]), "t_s must be finite"),
                    (dict(bandwidth_gbps=1.0, trace=[[0.5, 0.0]]), "gbps must be > 0"),
                    (dict(bandwidth_gbps=1.0, trace=[[0.5, 1.0], [0.2, 1.0]]),
                     "non-decreasing")):
        with pytest.raises(ValueError, match=msg):
            Link(env, **kw)
    # equal times: the last entry holds from then on
    link = Link(env, 8.0, trace=[[0.5, 4.0], [0.5, 16.0]])
    assert link.capacity_at(0.7) == 16e9 / 8
    assert link.capacity_bytes(0.0, 1.0) == pytest.approx(0.5e9 + 0.5 * 2e9, rel=1e-12)


def test_base_defaults_without_a_scenario_fit_and_run(capsys):
    from kvsim.core.compose import compose

    cfg, _ = compose("sim", [], SimConfig)  # no scenario unless one is named
    assert (cfg.model.name, cfg.hardware.name, cfg.hardware.devices) == ("llama-3.1-8b",
                                                                         "h100", 1)
    assert main(["sim", "codecs=[int8]", "samples=1"]) == 0
    # every scenario names the model and hardware it was calibrated for
    table1, _ = compose("sim", ["scenario=table1-qwen32b-16k"], SimConfig)
    assert (table1.model.name, table1.hardware.name, table1.hardware.devices) == (
        "qwen3-32b", "ascend-910b4", 4)


def test_memory_error_names_the_override_that_fixes_it(capsys):
    rc = main(["sim", "scenario=none", "model=qwen3-32b", "hardware=ascend-910b4",
               "codecs=[int8]"])
    err = capsys.readouterr().err
    # 32.8e9 params * 2 B + 64 layers * 2 * 16384 * 1024 * 2 B = 69.9 GB > 32 GB; 3 NPUs fit
    assert rc != 0 and "hardware.devices=3 fits" in err and "69.9 GB" in err
    assert main(["sim", "scenario=none", "model=qwen3-32b", "hardware=ascend-910b4",
                 "hardware.devices=3", "codecs=[int8]", "samples=1"]) == 0
