"""Simulator end to end: analytic TTFT, speculative bounds, invariants, config groups, and
the seeds' orderings / trends (Table 1, Figure 11) from the simulator's output."""

from __future__ import annotations

import gc
import json
import math
from dataclasses import replace

import numpy as np
import pytest
from sim_codecs import size_only_split_codec

from kvsim.core.compose import compose
from kvsim.core.paths import CONF_DIR
from kvsim.kernels.codec import make_codec
from kvsim.kernels.wire import CHUNK_HEADER_BYTES
from kvsim.model.hardware import HardwareSpec
from kvsim.model.spec import ModelSpec
from kvsim.scenario.config import SimConfig
from kvsim.scenario.timing_model import TimingModel
from kvsim.scenario.variants import variants
from kvsim.sim.run import Scenario, run_all

LYNX = {"name": "lynx", "label": "lynx"}  # inline entry: independent of conf/codec presets


_TwoHalves = size_only_split_codec("test-two-halves", 4)  # two streams, half each


def _timing_file(tmp_path, enc_gbs, dec_gbs):
    p = tmp_path / "timing.json"
    entry = {"encode_gb_per_s": enc_gbs, "decode_gb_per_s": dec_gbs, "source": "assumed",
             "assumption": "test"}
    p.write_text(json.dumps({"version": 1, "hardware": "test", "default": entry}))
    return str(p)


def _cfg(tmp_path, codecs, enc_gbs=50.0, dec_gbs=25.0, **over) -> SimConfig:
    model = ModelSpec(name="tiny", layers=4, attention_heads=4, kv_heads=2, head_dim=64,
                      hidden_size=256, params_total=1e8, params_active=1e8)
    hw = HardwareSpec(name="test", hbm_gb_per_s=100.0, bf16_tflops=10.0, memory_gb=100.0,
                      step_overhead_s=0.001)
    # transfer=seeds: the hand-computed times below are of monolithic / split_stream transfer
    cfg = SimConfig(model=model, hardware=hw, codecs=codecs, transfer="seeds",
                    codec_timing=_timing_file(tmp_path, enc_gbs, dec_gbs))
    cfg.link = replace(cfg.link, bandwidth_gbps=1.0, latency_s=0.002)
    cfg.workload = replace(cfg.workload, context_tokens=1000, output_tokens=130)
    for key, value in over.items():
        setattr(cfg, key, value)
    return cfg


def test_monolithic_ttft_is_prefill_encode_transfer_decode_tpot(tmp_path):
    cfg = _cfg(tmp_path, ["bf16"])
    (row,), _ = run_all(cfg)
    shape = cfg.model.kv_shape(1000)
    bf16 = shape.bf16_bytes  # 4 layers * 2 * 2 heads * 1000 * 64 * 2 B = 2,048,000
    table = make_codec("bf16", {"page_tokens": 256}).size_table(shape)
    wire = table.total_bytes
    tm = TimingModel(cfg.model, cfg.hardware)
    expected = (tm.prefill_s(1000) + bf16 / 50e9 + 0.002 + 8 * wire / 1e9 + bf16 / 25e9
                + tm.tpot_s(1000, 1))
    assert row["ttft_s"] == pytest.approx(expected, rel=1e-12)
    assert row["ttkt_s"][128] == pytest.approx(expected + 127 * tm.tpot_s(1000, 1), rel=1e-12)
    assert row["total_bytes"] == wire
    bd = row["breakdown_s"]
    assert sum(bd.values()) == pytest.approx(row["ttkt_from_prefill_end_s"][32], rel=1e-12)
    assert bd["serialize"] == pytest.approx(bf16 / 50e9, rel=1e-9)
    assert bd["exposed_communication"] == pytest.approx(0.002 + 8 * wire / 1e9, rel=1e-9)


def _split_row(tmp_path, acceptance, cap=64):
    cfg = _cfg(tmp_path, [{"name": "test-two-halves"}], enc_gbs=1e9, dec_gbs=1e9)
    cfg.link = replace(cfg.link, latency_s=0.0)
    cfg.speculative = replace(cfg.speculative, acceptance=acceptance, cap_tokens=cap)
    cfg.metrics = replace(cfg.metrics, ks=list(range(1, 129)))
    (row,), _ = run_all(cfg)
    tm = TimingModel(cfg.model, cfg.hardware)
    shape = cfg.model.kv_shape(1000)
    table = _TwoHalves().size_table(shape)
    b0 = table.stream_bytes[0] + table.header_bytes
    b1 = table.stream_bytes[1]
    t_pe = tm.prefill_s(1000)
    t_anchor, t_full = t_pe + 8 * b0 / 1e9, t_pe + 8 * (b0 + b1) / 1e9  # codec time ~ 0
    return row, tm, t_pe, t_anchor, t_full


def test_split_stream_acceptance_one_is_the_lower_bound(tmp_path):
    row, tm, t_pe, t_a, t_f = _split_row(tmp_path, "geometric:1.0")
    tpot = tm.tpot_s(1000, 1)
    n = math.ceil((t_f - t_a) / tpot)
    assert row["proposed_tokens"] == row["accepted_tokens"] == n
    tol = 1e-9
    assert n >= 2
    for k in range(1, n + 1):  # accepted drafts count when drafted
        assert row["ttkt_s"][k] == pytest.approx(t_a + k * tpot, abs=tol)
    v_end = max(t_f, t_a + n * tpot) + tm.verify_s(n, 1000)
    assert row["ttkt_s"][64] == pytest.approx(v_end + (64 - n - 1) * tpot, abs=tol)
    # committed: the n accepted drafts and the bonus token all count at verification's end
    for k in range(1, n + 2):
        assert row["ttkt_committed_s"][k] == pytest.approx(v_end, abs=tol)
    assert row["ttft_committed_s"] == pytest.approx(v_end, abs=tol)
    assert row["ttft_committed_from_prefill_end_s"] == pytest.approx(v_end - t_pe, abs=tol)
    for k in range(n + 2, 129):
        assert row["ttkt_committed_s"][k] == row["ttkt_s"][k]


def test_split_stream_acceptance_zero_is_the_upper_bound(tmp_path):
    row, tm, t_pe, t_a, t_f = _split_row(tmp_path, "geometric:0.0")
    tpot = tm.tpot_s(1000, 1)
    n = math.ceil((t_f - t_a) / tpot)
    assert (row["proposed_tokens"], row["accepted_tokens"]) == (n, 0)
    v_end = max(t_f, t_a + n * tpot) + tm.verify_s(n, 1000)
    assert row["ttft_s"] == pytest.approx(v_end, abs=1e-9)
    assert row["ttkt_s"][32] == pytest.approx(v_end + 31 * tpot, abs=1e-9)
    assert row["breakdown_s"]["rejected_speculative"] == pytest.approx(n * tpot, abs=1e-9)
    best, *_ = _split_row(tmp_path, "geometric:1.0")
    for k in (1, 8, 32, 64, 128):
        assert best["ttkt_s"][k] <= row["ttkt_s"][k]


def test_cap_zero_waits_for_the_full_cache(tmp_path):
    row, tm, t_pe, t_a, t_f = _split_row(tmp_path, "geometric:1.0", cap=0)
    assert row["proposed_tokens"] == 0
    assert row["ttft_s"] == pytest.approx(t_f + tm.tpot_s(1000, 1), abs=1e-9)
    assert row["ttkt_committed_s"] == row["ttkt_s"]  # nothing drafted: nothing to wait for


def test_breakdown_sums_and_trace_spans_within_the_run(tmp_path):
    cfg = _cfg(tmp_path, ["bf16", {"name": "test-two-halves"}],
               transfer=["monolithic", "layerwise", "split_stream", "split_stream_layerwise"],
               trace_path=str(tmp_path / "trace.json"))
    rows, trace = run_all(cfg)
    assert len(rows) == 6  # bf16 has one stream: no row under the split-stream policies
    for r in rows:
        k = r["breakdown_k"]
        assert sum(r["breakdown_s"].values()) == pytest.approx(
            r["ttkt_from_prefill_end_s"][k], rel=1e-9)
        assert all(v >= -1e-12 for v in r["breakdown_s"].values())
        t = [r["ttkt_s"][k] for k in sorted(r["ttkt_s"])]
        assert all(b >= a for a, b in zip(t, t[1:], strict=False))
        # the run ends with the last (130th) token: no event after it
        assert r["sim_end_s"] == pytest.approx(r["ttkt_s"][128] + 2 * r["tpot_s"], rel=1e-12)
    doc = json.loads((tmp_path / "trace.json").read_text())
    ends = [(e["ts"] + e["dur"]) / 1e6 for e in doc["traceEvents"]]
    assert doc["traceEvents"] and max(ends) <= max(r["sim_end_s"] for r in rows) + 1e-9
    assert all(e["dur"] >= 0 for e in doc["traceEvents"])


def test_layerwise_overlaps_prefill_and_beats_monolithic(tmp_path):
    cfg = _cfg(tmp_path, ["bf16"], transfer=["monolithic", "layerwise"])
    mono, layer = run_all(cfg)[0]
    assert layer["ttft_s"] < mono["ttft_s"]
    assert layer["total_bytes"] == mono["total_bytes"]


def test_multi_request_fifo_vs_anchors_first_and_percentiles(tmp_path):
    cfg = _cfg(tmp_path, [{"name": "test-two-halves"}], granularity="layer")
    cfg.workload = replace(cfg.workload, kind="poisson", requests=40, rate_per_s=30.0,
                           context_dist="uniform", context_min_tokens=500,
                           context_max_tokens=3000, prefill_nodes=2, decode_nodes=2)
    out = {}
    for sched in ("anchors_first", "fifo"):
        cfg.link = replace(cfg.link, scheduling=sched)
        (row,), _ = run_all(cfg)
        out[sched] = row
        pct = row["ttft_pct_s"]
        assert pct["p50"] <= pct["p90"] <= pct["p99"]
        assert row["requests"] == 40 and row["throughput_rps"] > 0
        # committed never earlier than drafted, for the mean and every percentile
        assert row["ttft_committed_s"] >= row["ttft_s"]
        cpct = row["ttft_committed_pct_s"]
        assert all(cpct[q] >= pct[q] for q in ("p50", "p90", "p99"))
        assert all(row["ttkt_committed_s"][k] >= row["ttkt_s"][k] for k in row["ttkt_s"])
    # all anchors first gets first tokens out sooner on average under contention
    assert out["anchors_first"]["ttft_s"] <= out["fifo"]["ttft_s"]
    (again,), _ = run_all(cfg)  # same seed, same result
    assert again["ttft_s"] == out["fifo"]["ttft_s"]


def test_qwen3_235b_128k_bf16_is_23_5_gib():
    cfg, _ = compose("sim", ["model=qwen3-235b-a22b"], SimConfig)
    assert cfg.model.kv_bytes_bf16(131072) == 2 * 94 * 131072 * 4 * 128 * 2
    assert cfg.model.kv_bytes_bf16(131072) / 2**30 == pytest.approx(23.5, abs=0.01)
    assert cfg.model.kv_shape(131072).bf16_bytes == cfg.model.kv_bytes_bf16(131072)


def test_mla_cache_has_k_factor_one():
    cfg, _ = compose("sim", ["model=deepseek-v3"], SimConfig)
    assert cfg.model.kv_bytes_bf16(1000) == 1 * 1000 * 576 * 61 * 2
    assert cfg.model.kv_shape(1000).bf16_bytes == cfg.model.kv_bytes_bf16(1000)


def test_every_config_group_option_composes():
    groups = {g: sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml"))
              for g in ("model", "hardware", "link", "workload", "scenario")}
    assert all(groups.values())
    for group, options in groups.items():
        for option in options:
            cfg, _ = compose("sim", [f"{group}={option}"], SimConfig)
            assert isinstance(cfg, SimConfig)
            cfg.link.validate()
            cfg.workload.validate()
            if (group, option) == ("model", "custom"):  # shape read from real weights
                with pytest.raises(ValueError, match="cannot be simulated"):
                    cfg.model.validate()
                continue
            TimingModel(cfg.model, cfg.hardware).tpot_s(1024)
    with pytest.raises(Exception, match="bandwidth_gbpz|not in"):
        compose("sim", ["link.bandwidth_gbpz=3"], SimConfig)


def test_bad_policy_and_missing_timing_are_clear(tmp_path):
    cfg = _cfg(tmp_path, ["bf16"], transfer="teleport")
    with pytest.raises(ValueError, match="unknown policy 'teleport'"):
        variants(cfg)
    cfg = _cfg(tmp_path, ["bf16"], codec_timing=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="no codec timing file"):
        Scenario(cfg, variants(cfg)[0], 1000, 1.0)


# ---- the seeds' results, from the simulator ------------------------------------------------
def _rows(scenario: str, codecs: list, overrides: tuple[str, ...] = ()) -> list[dict]:
    cfg, _ = compose("sim", [f"scenario={scenario}", *overrides], SimConfig)
    cfg.codecs = codecs
    return run_all(cfg)[0]


def _grid_rows(scenario: str, codecs: list) -> list[dict]:
    """Every point of the grid the scenario declares (hydra.sweeper.params), as `kvsim sim -m
    scenario=...` runs them: one composed config per point."""
    from kvsim.cli.help import declared_grid
    from kvsim.core.paths import CONF_DIR

    grid = declared_grid(CONF_DIR / "scenario" / f"{scenario}.yaml")
    assert len(grid) == 1, grid
    (key, values), = grid.items()
    return [row for v in values.split(",") for row in _rows(scenario, codecs, (f"{key}={v}",))]


def test_table1_ordering_bf16_int8_lynx_int4():
    rows = {r["codec"]: r for r in _rows("table1-qwen32b-16k", ["bf16", "int8", "int4", LYNX])}
    ttft = {c: r["ttft_from_prefill_end_s"] for c, r in rows.items()}
    assert ttft["bf16"] > ttft["int8"] > ttft["lynx"] >= ttft["int4"]
    tt32 = {c: r["ttkt_from_prefill_end_s"][32] for c, r in rows.items()}
    assert tt32["bf16"] > tt32["int8"] > tt32["lynx"]
    assert rows["lynx"]["transfer"] == "split_stream" and rows["int8"]["transfer"] == "monolithic"


def _gain(rows, key):
    assert all(r["samples"] == 32 for r in rows)  # means over 32 acceptance draws
    by = {}
    for r in rows:
        by.setdefault(r[key], {})[r["codec"]] = r["ttkt_from_prefill_end_s"][64]
    return [by[x]["int8"] - by[x]["lynx"] for x in sorted(by)]


def test_fig11_lynx_gain_grows_with_context():
    # seeds: 0.22 s (32K) -> 0.84 s (128K); this calibration: ~0.28 -> 0.51 -> 0.88 s
    gains = _gain(_grid_rows("fig11-context", ["int8", LYNX]), "context_tokens")
    assert len(gains) == 3 and all(g > 0 for g in gains)
    assert gains[0] < gains[1] < gains[2]


def test_fig11_lynx_gain_shrinks_with_bandwidth():
    # seeds: 0.86 s (10 Gbps) -> 0.18 s (50 Gbps); this calibration: ~0.89 -> 0.51 -> 0.30 s
    gains = _gain(_grid_rows("fig11-bandwidth", ["int8", LYNX]), "bandwidth_gbps")
    assert len(gains) == 3 and all(g > 0 for g in gains)
    assert gains[0] > gains[1] > gains[2]


def test_framing_overhead_and_trace_link_conserve_bytes(tmp_path):
    cfg = _cfg(tmp_path, ["bf16", {"name": "test-two-halves"}])
    cfg.link = replace(cfg.link, message_overhead_bytes=64.0, latency_s=0.01,
                       trace=[[0.05, 0.5], [0.07, 2.0]])
    plain = _cfg(tmp_path, ["bf16", {"name": "test-two-halves"}])
    for framed, base in zip(run_all(cfg)[0], run_all(plain)[0], strict=True):
        assert framed["total_bytes"] == base["total_bytes"]  # codec bytes unchanged
        assert framed["ttft_s"] > base["ttft_s"]  # framing, latency and the slow step cost
        assert 0 < framed["link_utilisation"] <= 1 + 1e-9


def test_codec_entry_pins_its_own_acceptance_and_transfer(tmp_path):
    two = "test-two-halves"
    cfg = _cfg(tmp_path, [{"name": two, "label": "sure", "acceptance": "geometric:1.0"},
                          {"name": two, "label": "never", "acceptance": "geometric:0.0"},
                          {"name": two, "label": "mono", "transfer": "monolithic"}])
    rows = {r["codec"]: r for r in run_all(cfg)[0]}
    assert rows["sure"]["accepted_tokens"] == rows["sure"]["proposed_tokens"] > 0
    assert rows["never"]["accepted_tokens"] == 0 < rows["never"]["proposed_tokens"]
    assert rows["sure"]["acceptance"] == "geometric-1" and rows["mono"]["transfer"] == "monolithic"
    assert rows["mono"]["proposed_tokens"] == 0
    assert rows["sure"]["ttkt_s"][8] < rows["never"]["ttkt_s"][8]


# ---- breakdown attribution and the decode-side deserializer (analytic) ---------------------
def test_encoder_bound_pipeline_books_encoding_as_serialize(tmp_path):
    # bf16 sent as one pipelined flow: the engine's split_stream pipeline with one stream
    # (encoding after prefill, chunk i on the wire while i+1 is encoded; what each stream of a
    # split-stream codec does). No config gives a one-stream codec this policy (variants()
    # skips it), so the variant is built here. 4 layers x 4 pages of 256 tokens:
    # 16 chunks of 2 (K,V) * 2 heads * 256 * 64 * 2 B = 131,072 B. Encoder 0.01 GB/s: 13.1 ms
    # per chunk; link 1 Gbps: 1.05 ms per chunk -> every chunk leaves as soon as it is
    # encoded: the last byte arrives at t_pe + 16 e + s_last + latency (s: the chunk and its
    # 20-byte frame header on the wire).
    cfg = _cfg(tmp_path, [{"name": "bf16", "params": {"page_tokens": 256}}], enc_gbs=0.01,
               dec_gbs=1.0)
    cfg.workload = replace(cfg.workload, context_tokens=1024)
    variant = replace(variants(cfg)[0], policy="split_stream")

    def run_one() -> dict:
        return Scenario(cfg, variant, 1024, cfg.link.bandwidth_gbps).run_samples(1)

    row = run_one()
    tm = TimingModel(cfg.model, cfg.hardware)
    chunk = 2 * 2 * 256 * 64 * 2
    e, d, lat = chunk / 0.01e9, chunk / 1e9, 0.002
    s = 8 * (chunk + CHUNK_HEADER_BYTES) / 1e9
    bd = row["breakdown_s"]
    assert bd["serialize"] == pytest.approx(16 * e, rel=1e-9)
    assert bd["exposed_communication"] == pytest.approx(s + lat, rel=1e-9)
    assert bd["deserialize"] == pytest.approx(d, rel=1e-9)
    assert row["ttft_from_prefill_end_s"] == pytest.approx(16 * e + s + lat + d + tm.tpot_s(1024),
                                                           rel=1e-9)
    # link-bound (encoder 100 GB/s, 1.3 us per chunk): only the first chunk's encoding is
    # exposed; the rest is the link's: 16 chunks (+ the preamble) + latency
    cfg.codec_timing = _timing_file(tmp_path, 100.0, 1.0)
    fast = run_one()
    bd = fast["breakdown_s"]
    wire = fast["total_bytes"]
    assert bd["serialize"] == pytest.approx(chunk / 100e9, rel=1e-9)
    assert bd["exposed_communication"] == pytest.approx(8 * wire / 1e9 + lat, rel=1e-9)


def _deser_row(tmp_path, mode):
    # two streams of 64 messages (4 layers x 16 pages of 64 tokens) of 16,384 B (+ 20 B frame
    # header) each; link 1 Gbps (s = 131 us per message), no latency, encoding ~0,
    # deserialization 0.01 GB/s of bf16 input: d = 16,384 B / 1e7 B/s = 1.64 ms per message
    # (the deserializer is the bottleneck); no drafting (cap 0): the first token needs the
    # whole cache.
    cfg = _cfg(tmp_path, [{"name": "test-two-halves"}], enc_gbs=1e9, dec_gbs=0.01,
               deserializer=mode)
    cfg.link = replace(cfg.link, latency_s=0.0)
    cfg.workload = replace(cfg.workload, context_tokens=1024)
    cfg.speculative = replace(cfg.speculative, cap_tokens=0)
    (row,), _ = run_all(cfg)
    table = _TwoHalves().size_table(cfg.model.kv_shape(1024))
    msg = 16384 + CHUNK_HEADER_BYTES
    s0, s, d, n = 8 * (msg + table.header_bytes) / 1e9, 8 * msg / 1e9, 16384 / 1e7, 64
    return row, TimingModel(cfg.model, cfg.hardware).tpot_s(1024), s0, s, d, n


def test_shared_deserializer_serves_anchor_then_residual(tmp_path):
    row, tpot, s0, s, d, n = _deser_row(tmp_path, "shared")
    # anchors arrive every s < d: the server works from the first arrival (s0) on, all 64
    # anchors first (higher priority; every residual arrives while anchors still wait),
    # then the 64 residual messages
    assert row["anchor_ready_from_prefill_end_s"] == pytest.approx(s0 + n * d, abs=1e-9)
    assert row["full_ready_from_prefill_end_s"] == pytest.approx(s0 + 2 * n * d, abs=1e-9)
    assert row["ttft_from_prefill_end_s"] == pytest.approx(s0 + 2 * n * d + tpot, abs=1e-9)


def test_per_stream_deserializers_run_in_parallel(tmp_path):
    row, tpot, s0, s, d, n = _deser_row(tmp_path, "per_stream")
    assert row["anchor_ready_from_prefill_end_s"] == pytest.approx(s0 + n * d, abs=1e-9)
    # the residual server starts when its first message arrives (after all 64 anchors)
    assert row["full_ready_from_prefill_end_s"] == pytest.approx(s0 + n * s + n * d, abs=1e-9)
    shared, *_ = _deser_row(tmp_path, "shared")
    assert row["ttft_s"] < shared["ttft_s"]


@pytest.mark.parametrize("max_work_s", [0.08, 0.002])  # queueing / mostly none (closed form)
def test_priority_server_matches_a_job_by_job_simulation(max_work_s):
    from kvsim.sim.nodes import priority_server

    rng = np.random.default_rng(7)
    for _ in range(30):
        classes = int(rng.integers(1, 4))
        arr = [np.sort(rng.uniform(0, 1, int(rng.integers(0, 25)))) for _ in range(classes)]
        work = [rng.uniform(0, max_work_s, len(a)) for a in arr]
        if not any(len(a) for a in arr):
            continue
        # reference: at each decision instant pick the best class with a job waiting
        heads, free, ref = [0] * classes, -math.inf, [np.zeros(len(a)) for a in arr]
        while any(h < len(a) for h, a in zip(heads, arr, strict=True)):
            soonest = min(a[h] for h, a in zip(heads, arr, strict=True) if h < len(a))
            t = max(free, soonest)
            c = next(c for c in range(classes) if heads[c] < len(arr[c])
                     and arr[c][heads[c]] <= t)
            free = t + work[c][heads[c]]
            ref[c][heads[c]] = free
            heads[c] += 1
        got = priority_server(arr, work)
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-12)


def test_size_calibration_names_its_source_and_changes_estimated_bytes(tmp_path):
    """Exact codecs ignore size_calibration; cachegen's bytes come from the shipped file
    (labelled 'error unknown') or from a sample encode of synthetic KV of the model's shape
    (labelled with its held-out error), and the row says which."""
    from kvsim.kernels.cachegen.size import CacheGenSizeModel
    from kvsim.kernels.codec import make_codec
    from kvsim.kv.synthetic import generate_kv

    rows = {}
    for calibration in ("file", "synthetic"):
        cfg = _cfg(tmp_path, ["int8", "cachegen"], size_calibration=calibration)
        rows[calibration] = {r["codec"]: r for r in run_all(cfg)[0]}
    assert rows["file"]["int8"]["size_estimate"] == "exact"
    assert rows["file"]["int8"]["total_bytes"] == rows["synthetic"]["int8"]["total_bytes"]
    assert "error unknown" in rows["file"]["cachegen"]["size_estimate"]
    note = rows["synthetic"]["cachegen"]["size_estimate"]
    assert "synthetic" in note and "held-out error" in note
    file_bytes = rows["file"]["cachegen"]["total_bytes"]
    synthetic_bytes = rows["synthetic"]["cachegen"]["total_bytes"]
    assert file_bytes != synthetic_bytes
    # the synthetic estimate is the one that matches synthetic KV of this shape
    shape = cfg.model.kv_shape(1000)
    real = make_codec("cachegen", {}).encode(generate_kv(shape)).total_bytes
    assert abs(synthetic_bytes / real - 1) < 0.05
    assert CacheGenSizeModel.load().expected_error is None
    with pytest.raises(ValueError, match="size_calibration"):
        run_all(_cfg(tmp_path, ["cachegen"], size_calibration="no-such-capture"))


def test_requests_path_writes_one_row_per_request_and_sample(tmp_path):
    import pandas as pd

    cfg = _cfg(tmp_path, ["bf16", {"name": "test-two-halves"}], samples=2,
               requests_path=str(tmp_path / "requests.parquet"))
    cfg.workload = replace(cfg.workload, kind="poisson", requests=7, rate_per_s=20.0)
    rows, _ = run_all(cfg)
    table = pd.read_parquet(tmp_path / "requests.parquet")
    assert len(table) == 2 * 2 * 7  # codecs x samples x requests
    for row in rows:
        mine = table[table["codec"] == row["codec"]]
        assert sorted(mine["request"].unique()) == list(range(7))
        # the scenario row is the mean over samples of the mean over requests
        assert mine["ttft_s"].mean() == pytest.approx(row["ttft_s"], rel=1e-12)
        assert mine["ttft_committed_s"].mean() == pytest.approx(row["ttft_committed_s"],
                                                               rel=1e-12)
        assert (mine["ttft_committed_s"] >= mine["ttft_s"]).all()
        phases = ["arrival_t", "prefill_start_t", "prefill_end_t", "needed_ready_t",
                  "decode_start_t", "first_token_t", "last_token_t"]
        assert (mine[phases].diff(axis=1).iloc[:, 1:] >= -1e-12).all().all()
        assert (mine["ttkt_s.128"] >= mine["ttkt_s.1"]).all()
    csv = tmp_path / "requests.csv"
    cfg.requests_path = str(csv)
    run_all(cfg)
    assert len(pd.read_csv(csv)) == 28
    cfg.requests_path = str(tmp_path / "requests.json")
    with pytest.raises(ValueError, match="requests_path"):
        run_all(cfg)


def test_weighted_and_aging_policies_between_anchors_first_and_fifo(tmp_path):
    """Under contention, weighted shares (residual weight 1: equal per stream) and aging
    (age 0: by arrival) move the residual's delivery from anchors_first toward fifo; the
    same bytes cross the link whatever the policy."""
    cfg = _cfg(tmp_path, [{"name": "test-two-halves"}], granularity="layer")
    # link-bound: one shared 0.3 Gbps link, four prefill nodes, drafts never accepted
    cfg.workload = replace(cfg.workload, kind="poisson", requests=30, rate_per_s=60.0,
                           prefill_nodes=4)
    cfg.link = replace(cfg.link, bandwidth_gbps=0.3, sharing="shared")
    cfg.speculative = replace(cfg.speculative, acceptance="geometric:0.0")
    rows = {}
    for sched, extra in (("anchors_first", {}), ("fifo", {}),
                         ("weighted", {"residual_weight": 0.25}),
                         ("aging", {"residual_age_s": 0.0})):
        cfg.link = replace(cfg.link, scheduling=sched, **extra)
        rows[sched] = run_all(cfg)[0][0]
    af, ff, wt, ag = (rows[k] for k in ("anchors_first", "fifo", "weighted", "aging"))
    for r in rows.values():
        assert r["total_bytes"] == af["total_bytes"]
        assert 0.0 < r["link_busy_utilisation"] <= 1.0 + 1e-9
    # residuals starve under anchors_first: its committed times are the worst; weighted
    # shares lie between it and fifo (measured: 1.92 s, 1.87 s, 1.11 s)
    assert af["link_busy_utilisation"] == pytest.approx(1.0, rel=1e-6)
    for k in (1, 128):
        assert af["ttkt_committed_s"][k] > wt["ttkt_committed_s"][k] > \
            ff["ttkt_committed_s"][k]
    # aging with age 0 orders by arrival time, which is fifo's request order
    assert ag["ttft_s"] == pytest.approx(ff["ttft_s"], rel=1e-12)
    assert ag["ttkt_committed_s"] == pytest.approx(ff["ttkt_committed_s"], rel=1e-12)


def test_decode_memory_admits_only_what_fits_and_reports_the_wait(tmp_path):
    """Weights + sum of the decoding requests' bf16 caches never exceed the instance's
    memory: with room for two caches, four simultaneous requests decode two at a time,
    the others wait (memory_wait_s > 0); with ample memory nobody waits."""
    import pandas as pd

    def run(memory_gb):
        cfg = _cfg(tmp_path, ["bf16"], requests_path=str(tmp_path / f"r{memory_gb}.csv"))
        cfg.hardware = replace(cfg.hardware, memory_gb=memory_gb)
        cfg.workload = replace(cfg.workload, kind="poisson", requests=4, rate_per_s=1e6)
        (row,), _ = run_all(cfg)
        return row, pd.read_csv(tmp_path / f"r{memory_gb}.csv"), cfg

    _, _, cfg = run(100.0)
    cache = cfg.model.kv_bytes_bf16(1000 + 130)
    tight_gb = (cfg.model.weight_bytes + 2.5 * cache) / 1e9
    row, log, _ = run(tight_gb)
    starts, ends = log["decode_start_t"].to_numpy(), log["last_token_t"].to_numpy()
    for t in starts:  # caches resident at each admission
        assert ((starts <= t) & (ends > t)).sum() <= 2
    assert (log["memory_wait_s"] > 0).sum() == 2 and row["memory_wait_s"] > 0
    assert row["memory_wait_pct_s"]["p99"] > 0
    assert (log["decode_kv_bytes"] == cache).all()
    roomy, roomy_log, _ = run(100.0)
    assert roomy["memory_wait_s"] == 0.0 and (roomy_log["memory_wait_s"] == 0).all()
    assert roomy["ttkt_s"][128] < row["ttkt_s"][128]
    # a cache that can never fit is an error naming the fix, not a hang
    with pytest.raises(ValueError, match="never fits"):
        run((cfg.model.weight_bytes + 0.95 * cache) / 1e9)  # context fits, + output not


def test_request_trace_csv_drives_arrivals_contexts_and_outputs(tmp_path):
    """A generated file in the Azure LLM inference trace format: each request arrives at its
    TIMESTAMP (relative to the first), with its context, and decodes its own
    GeneratedTokens; TTKT(k) averages the requests that decode k tokens."""
    import pandas as pd

    trace = tmp_path / "trace.csv"
    stamps = pd.to_datetime("2023-11-16 18:15:46.6805900") + pd.to_timedelta(
        [0.0, 0.25, 0.25, 1.5], unit="s")
    pd.DataFrame({"TIMESTAMP": stamps.strftime("%Y-%m-%d %H:%M:%S.%f"),
                  "ContextTokens": [800, 1000, 1200, 900],
                  "GeneratedTokens": [40, 130, 8, 64]}).to_csv(trace, index=False)
    cfg = _cfg(tmp_path, ["bf16"], requests_path=str(tmp_path / "r.csv"))
    cfg.workload = replace(cfg.workload, kind="trace", trace_path=str(trace))
    (row,), _ = run_all(cfg)
    log = pd.read_csv(tmp_path / "r.csv").sort_values("request")
    assert log["arrival_t"].tolist() == pytest.approx([0.0, 0.25, 0.25, 1.5], abs=1e-6)
    assert log["context_tokens"].tolist() == [800, 1000, 1200, 900]
    assert log["output_tokens"].tolist() == [40, 130, 8, 64]
    assert row["requests"] == 4
    assert row["ttkt_requests"][1] == 4 and row["ttkt_requests"][64] == 2
    assert row["ttkt_requests"][128] == 1
    assert row["ttkt_s"][128] == pytest.approx(float(log["ttkt_s.128"].iloc[1]), rel=1e-12)
    assert row["ttkt_s"][64] == pytest.approx(float(log["ttkt_s.64"].dropna().mean()),
                                              rel=1e-12)
    assert np.isnan(log["ttkt_s.16"].iloc[2])  # request 2 decodes 8 tokens
    # seconds instead of date-times, replayed twice as fast, first 2 rows
    secs = tmp_path / "secs.csv"
    pd.DataFrame({"TIMESTAMP": [10.0, 12.0], "ContextTokens": [500, 600],
                  "GeneratedTokens": [16, 16]}).to_csv(secs, index=False)
    cfg.workload = replace(cfg.workload, trace_path=str(secs), trace_time_scale=0.5,
                           trace_max_requests=2)
    cfg.metrics = replace(cfg.metrics, ks=[], breakdown_k=0)
    run_all(cfg)
    assert pd.read_csv(tmp_path / "r.csv")["arrival_t"].tolist() == pytest.approx([0.0, 1.0])


@pytest.mark.parametrize("body, match", [
    ("TIMESTAMP,ContextTokens\n0,5\n", "missing column"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,5,3\n0,5,3\n", "back in time at row 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,5,3\n1,x,3\n", "ContextTokens row 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,5,0\n", "GeneratedTokens row 0"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,3\n", "TIMESTAMP"),
])
def test_bad_request_traces_are_refused_with_the_row(tmp_path, body, match):
    from kvsim.scenario.request_trace import load_request_trace

    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(ValueError, match=match):
        load_request_trace(path)


@pytest.mark.parametrize(("deserializer", "chunk_tokens"),
                         [("shared", 0), ("node", 0), ("shared", 2048)])
def test_a_run_leaves_no_cyclic_garbage(tmp_path, deserializer, chunk_tokens):
    """A finished request is freed by reference counting: the run's flows, receivers and
    deserializers form no reference cycle (the cyclic collector's pass over them after a
    run took ~10% of a 10,000-request run), whatever the request count."""
    cfg = _cfg(tmp_path, [{"name": "test-two-halves"}], granularity="layer",
               deserializer=deserializer)
    garbage = []
    for requests in (20, 20, 80):  # the first run also makes one-off garbage (imports)
        cfg.workload = replace(cfg.workload, kind="poisson", requests=requests,
                               rate_per_s=30.0, prefill_nodes=2, decode_nodes=2,
                               prefill_chunk_tokens=chunk_tokens)
        scenario = Scenario(cfg, variants(cfg)[0], cfg.workload.context_tokens,
                            cfg.link.bandwidth_gbps)
        gc.collect()
        gc.disable()
        try:
            row = scenario.run()
            garbage.append(gc.collect())
        finally:
            gc.enable()
        assert row["requests"] == requests
    assert garbage[1] < 20 and garbage[2] < 20  # none per request
    # nor does the finished run hold itself: dropped, the scenario (its records, links,
    # nodes) is freed by reference counting, not left to a full collection
    gc.collect()
    gc.disable()
    try:
        del scenario
        left = gc.collect()
    finally:
        gc.enable()
    assert left < 20, f"a dropped scenario left {left} objects in reference cycles"


# ---- transfer: which policy each codec runs under ------------------------------------------
def test_auto_transfer_is_the_best_policy_each_codec_supports(tmp_path):
    """auto: layer-wise encoding for a one-stream codec, split streams with layer-wise
    encoding for a several-stream one; seeds: the seeds' pairing (monolithic / split_stream).
    Under auto no one-stream codec waits for the whole prefill before sending, so it is never
    slower than under seeds."""
    two = {"name": "test-two-halves"}
    auto = {v.spec.label: v.policy for v in variants(_cfg(tmp_path, ["bf16", two],
                                                          transfer="auto"))}
    assert auto == {"bf16": "layerwise", "test-two-halves": "split_stream_layerwise"}
    # a codec whose layers do not encode alone is encoded whole, as the transport sends it
    whole = variants(_cfg(tmp_path, ["cachegen"], transfer="auto"))
    assert [v.policy for v in whole] == ["monolithic"]
    seeds = {v.spec.label: v.policy for v in variants(_cfg(tmp_path, ["bf16", two]))}
    assert seeds == {"bf16": "monolithic", "test-two-halves": "split_stream"}
    fast = {r["codec"]: r for r in run_all(_cfg(tmp_path, ["bf16"], transfer="auto"))[0]}
    slow = {r["codec"]: r for r in run_all(_cfg(tmp_path, ["bf16"]))[0]}
    assert fast["bf16"]["ttkt_committed_s"][32] < slow["bf16"]["ttkt_committed_s"][32]


def test_a_policy_a_codec_cannot_use_gives_no_row(tmp_path):
    """A one-stream codec has nothing to split: under a split-stream policy it gives no row
    (plan_variants names it); pinned on the entry, or with no codec left, it is an error."""
    from kvsim.scenario.variants import plan_variants

    two = {"name": "test-two-halves"}
    cfg = _cfg(tmp_path, ["bf16", two], transfer=["layerwise", "split_stream"])
    assert [(v.spec.label, v.policy) for v in variants(cfg)] == [
        ("bf16", "layerwise"), ("test-two-halves", "layerwise"),
        ("test-two-halves", "split_stream")]
    assert plan_variants(cfg.codecs, cfg.transfer)[1] == ["bf16/split_stream"]
    rows = run_all(cfg)[0]
    assert sorted((r["codec"], r["transfer"]) for r in rows) == sorted(
        [("bf16", "layerwise"), ("test-two-halves", "layerwise"),
         ("test-two-halves", "split_stream")])
    with pytest.raises(ValueError, match="bf16: transfer split_stream needs several streams"):
        variants(_cfg(tmp_path, [{"name": "bf16", "transfer": "split_stream"}]))
    with pytest.raises(ValueError, match="no listed codec can use it.*bf16/split_stream"):
        variants(_cfg(tmp_path, ["bf16"], transfer="split_stream"))
