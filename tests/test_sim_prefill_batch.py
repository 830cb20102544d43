"""Chunked prefill batching (kvsim.sim.prefill_batch): hand-computed steps."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvsim.model.hardware import HardwareSpec
from kvsim.model.spec import ModelSpec
from kvsim.scenario.config import SimConfig, WorkloadConfig
from kvsim.scenario.timing_model import TimingModel
from kvsim.scenario.variants import variants
from kvsim.sim.run import Scenario

MODEL = ModelSpec(name="tiny", layers=4, attention_heads=4, kv_heads=2, head_dim=64,
                  hidden_size=256, params_total=1e8, params_active=1e8)
HW = HardwareSpec(name="test", hbm_gb_per_s=100.0, bf16_tflops=10.0, memory_gb=100.0,
                  step_overhead_s=0.001)


def step_s(*parts: tuple[int, int]) -> float:
    """By hand: parts (n new tokens, c earlier tokens of the prompt). FLOPs: 2 x 1e8 params
    per token + 4 x layers x heads x head_dim (4096) per (query, key) pair, causal; reads:
    2e8 weight bytes once + 2048 KV bytes per token of c + n; 5e12 FLOP/s, 7e10 B/s."""
    flops = sum(2e8 * n + 4096 * (n * c + n * (n + 1) / 2) for n, c in parts)
    read = 2e8 + sum(2048 * (c + n) for n, c in parts)
    return max(flops / 5e12, read / 7e10) + 0.001


def _run(tmp_path, chunk_tokens: int, contexts=(1000, 300)):
    timing = tmp_path / "timing.json"
    entry = {"encode_gb_per_s": 50.0, "decode_gb_per_s": 25.0, "source": "assumed",
             "assumption": "test"}
    timing.write_text(json.dumps({"version": 1, "hardware": "test", "default": entry}))
    cfg = SimConfig(model=MODEL, hardware=HW, codecs=["bf16"], codec_timing=str(timing))
    cfg.link = replace(cfg.link, bandwidth_gbps=10.0)
    cfg.workload = replace(cfg.workload, kind="trace", arrivals_t=[0.0] * len(contexts),
                           arrivals_context_tokens=list(contexts), output_tokens=4,
                           prefill_chunk_tokens=chunk_tokens)
    sc = Scenario(cfg, variants(cfg)[0], contexts[0], 10.0)
    sc.run()
    return sorted(sc.records, key=lambda r: r.seq)


def test_step_time_of_one_fresh_prompt_is_its_prefill():
    tm = TimingModel(MODEL, HW)
    assert tm.prefill_step_s([(1000, 0)]) == pytest.approx(tm.prefill_s(1000), rel=1e-12)
    assert tm.prefill_step_s([(488, 512), (24, 0)]) == pytest.approx(
        step_s((488, 512), (24, 0)), rel=1e-12)


def test_chunks_fill_steps_first_come_first_served(tmp_path):
    # chunks of 512: step 1 = A[0:512]; step 2 = A[512:1000] + B[0:24]; step 3 = B[24:300]
    a, b = _run(tmp_path, 512)
    s1, s2, s3 = step_s((512, 0)), step_s((488, 512), (24, 0)), step_s((276, 24))
    assert (a.prefill_start_t, a.prefill_end_t) == pytest.approx((0.0, s1 + s2), rel=1e-12)
    assert (b.prefill_start_t, b.prefill_end_t) == pytest.approx((s1, s1 + s2 + s3),
                                                                 rel=1e-12)
    # bf16 is monolithic: encoding starts when the step with the last chunk ends
    assert a.encode_end_t > a.prefill_end_t


def test_one_chunk_per_prompt_is_the_unchunked_prefill(tmp_path):
    off = _run(tmp_path, 0, contexts=(1000,))[0]
    big = _run(tmp_path, 4096, contexts=(1000,))[0]
    assert big.prefill_end_t == pytest.approx(off.prefill_end_t, rel=1e-12)
    assert big.timeline.token_t == pytest.approx(off.timeline.token_t, rel=1e-12)


def test_chunk_tokens_is_validated():
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be an integer >= 0"):
        WorkloadConfig(prefill_chunk_tokens=-1).validate()
