"""speculative.dequant_contention: a device that dequantizes the residual while it drafts on
the anchor runs the two one after the other (c = 1), so the drafting window loses the
residual's dequantization time W, whatever the link's rate; c = 0 (the default) overlaps
them for free, as before. Figure 11(b)'s setting at 50 Gbps, every draft accepted (nothing
random), one lone request."""

from __future__ import annotations

import json

import pytest

from kvsim.cli.main import main
from kvsim.core.paths import DATA_DIR


def _lynx_row(tmp_path, contention: float | None) -> dict:
    report = tmp_path / f"c{contention}.json"
    extra = [] if contention is None else [f"speculative.dequant_contention={contention}"]
    assert main(["sim", "scenario=fig11-bandwidth", "link.bandwidth_gbps=50", "samples=1",
                 "min_samples=1", "codecs=[lynx]", "speculative.acceptance=geometric:1.0",
                 f"report={report}", f"hydra.run.dir={tmp_path}/run", *extra]) == 0
    return json.loads(report.read_text())["rows"][0]


def test_contention_costs_the_drafts_the_residuals_dequantization(tmp_path):
    default, free, serial = (_lynx_row(tmp_path, c) for c in (None, 0.0, 1.0))
    assert free["ttkt_s"] == default["ttkt_s"]  # c = 0 is today's model, exactly
    # W: the residual's byte share of the cache's dequantization (bf16 bytes at the codec
    # timing's decode GB/s), split over the instance's 2 devices (the scenario's)
    rate_gb_per_s = json.loads((DATA_DIR / "codec_timing" / "ascend-910b4.json").read_text()
                               )["codecs"]["lynx"]["decode_gb_per_s"]
    bf16_bytes = 2 * 32 * 8 * 128 * 65536 * 2  # Llama-3.1-8B, 64K tokens
    share = serial["stream_bytes"]["residual"] / sum(serial["stream_bytes"].values())
    w_s = bf16_bytes / (rate_gb_per_s * 1e9) * share / 2
    assert w_s == pytest.approx(0.1173, abs=1e-4)
    t = serial["tpot_s"]
    # every draft accepted: the window's lost drafts, W / t of them, each cost a step later
    assert serial["ttkt_s"]["64"] - free["ttkt_s"]["64"] == pytest.approx(w_s, abs=0.1 * t)
    assert free["proposed_tokens"] - serial["proposed_tokens"] == round(w_s / t)
    with pytest.raises(ValueError, match="dequant_contention"):
        from kvsim.scenario.config import SpeculativeConfig

        SpeculativeConfig(dequant_contention=1.5).validate()


def test_a_draft_step_with_its_own_overhead_loses_its_whole_length():
    from kvsim.scenario.speculative import contention_overhead_s

    # half the window busy, fully serialized: each draft step takes twice its length
    assert contention_overhead_s(0.1, 0.5, 1.0) == pytest.approx(0.1)
    assert contention_overhead_s(0.1 + 0.05, 0.5, 1.0) == pytest.approx(0.15)
    assert contention_overhead_s(0.1, 0.5, 0.0) == 0.0
