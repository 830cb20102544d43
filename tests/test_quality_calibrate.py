"""Calibrating the synthetic KV generator: recover known parameters from generated KV."""

from __future__ import annotations

import pytest
import torch

from kvsim.core.layout import KVShape
from kvsim.kv.synthetic import SyntheticKVParams, _rope, generate_kv
from kvsim.quality.calibrate import (
    calibrate,
    count_sinks,
    load_calibration,
    save_calibration,
    unrope,
)


def test_unrope_inverts_rope():
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    assert torch.allclose(unrope(_rope(x, 500.0), 500.0), x, atol=1e-10)


def test_recovers_generator_parameters(tmp_path):
    truth = SyntheticKVParams(k_scale=1.5, k_outlier_channel_fraction=0.125,
                              k_outlier_magnitude=8.0, k_channel_bias=0.5, v_scale=0.7,
                              layer_scale_first=0.5, layer_scale_last=2.0, sink_tokens=2,
                              sink_key_norm_ratio=0.1, sink_value_norm_ratio=0.3,
                              k_token_correlation=0.8, v_token_correlation=0.3,
                              rope_base=10000.0)
    kv = generate_kv(KVShape(6, 2, 512, 64, "float32"), truth, seed=1)
    fit = calibrate(kv, rope_base=10000.0)
    assert fit.sink_tokens == 2 and fit.rope
    assert fit.k_outlier_channel_fraction == pytest.approx(0.125, abs=0.02)
    for name, rel in [("k_scale", 0.1), ("k_outlier_magnitude", 0.1), ("v_scale", 0.1),
                      ("layer_scale_first", 0.1), ("layer_scale_last", 0.1),
                      ("sink_key_norm_ratio", 0.1), ("sink_value_norm_ratio", 0.1),
                      ("k_token_correlation", 0.05), ("v_token_correlation", 0.15),
                      ("k_channel_bias", 0.2)]:
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=rel), name
    path = save_calibration(fit, "fit", {"model": "synthetic"}, tmp_path)
    assert load_calibration(str(path)) == fit
    with pytest.raises(ValueError, match="unknown synthetic calibration"):
        load_calibration("no-such-calibration")


def test_no_sinks_and_short_input():
    kv = generate_kv(KVShape(2, 1, 64, 16, "float32"), SyntheticKVParams(sink_tokens=0), seed=0)
    assert count_sinks(kv) == 0
    with pytest.raises(ValueError, match="16 tokens"):
        calibrate(kv[:, :, :, :8])
