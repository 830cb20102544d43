"""`kvsim bench transport`: the command runs end to end on tiny sizes (real processes, real
frames over loopback), and the figures are computed as documented. No timing assertion
tighter than 'positive, finite, token bucket within (0.5, 1.1) of its rate': performance is
the benchmark's job, not the tests'."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvsim.bench import transport as bt
from kvsim.cli.main import main
from kvsim.commands.bench_transport import Config

TINY = ["parts=[loopback,token_bucket]", "loopback.mb=8", "loopback.repeats=1",
        "token_bucket.rates_gbps=[0.2]", "token_bucket.seconds=0.5", "shape.tokens=1024",
        "distinct_layers=1"]


def test_bench_runs_on_tiny_sizes(tmp_path):
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "kvsim", "bench", "transport", *TINY,
                           f"report={report}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "goodput GB/s" in done.stdout
    rows = {(r["part"], r["case"]): r for r in json.loads(report.read_text())["rows"]}
    assert set(rows) == {("loopback", "raw_zmq"), ("loopback", "transport"),
                         ("token_bucket", "transport")}
    for row in rows.values():
        assert row["status"] == "done", row
        for key in ("goodput_gb_per_s", "goodput_gbps", "tx_cpu_s_per_gb", "rx_cpu_s_per_gb"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["chunks"] > 0 and row["mb"] > 0
    raw, tr = rows["loopback", "raw_zmq"], rows["loopback", "transport"]
    assert tr["link_bytes"] == raw["link_bytes"] and tr["chunks"] == raw["chunks"]
    assert math.isclose(tr["ratio"], tr["goodput_gb_per_s"] / raw["goodput_gb_per_s"])
    tb = rows["token_bucket", "transport"]
    assert tb["rate_gbps"] == 0.2 and tb["baseline"] == "rate"
    assert 0.5 < tb["ratio"] < 1.1
    assert math.isclose(tb["ratio"], tb["goodput_gbps"] / 0.2)


def test_bench_curve_part_compares_like_with_like(tmp_path):
    """The CURVE part: raw ZeroMQ and the transport, both with CURVE (keys made for the run),
    the transport as a ratio of raw with CURVE, raw's cost against this run's plain raw."""
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "kvsim", "bench", "transport",
                           "parts=[loopback,curve]", "loopback.mb=8", "loopback.repeats=1",
                           "curve.mb=8", "curve.repeats=1", "shape.tokens=1024",
                           "distinct_layers=1", f"report={report}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["part"], r["case"]): r for r in json.loads(report.read_text())["rows"]}
    raw, tr = rows["curve", "raw_zmq"], rows["curve", "transport"]
    assert raw["status"] == tr["status"] == "done" and raw["curve"] and tr["curve"]
    assert tr["link_bytes"] == raw["link_bytes"] == rows["loopback", "raw_zmq"]["link_bytes"]
    assert math.isclose(tr["ratio"], tr["goodput_gb_per_s"] / raw["goodput_gb_per_s"])
    assert math.isclose(raw["vs_plain_raw_zmq"], raw["goodput_gb_per_s"] /
                        rows["loopback", "raw_zmq"]["goodput_gb_per_s"])


def _transport_result(first_send: float, arrivals: list[tuple[float, float, float]],
                      sizes: list[tuple[int, int]], first_chunk: int,
                      first_chunk_wait_s: float = 0.0) -> dict:
    streams = [{"name": f"s{i}", "chunks": n, "link_bytes": b, "first_arrival_t": a0,
                "last_arrival_t": a1, "complete_t": c}
               for i, ((a0, a1, c), (n, b)) in enumerate(zip(arrivals, sizes, strict=True))]
    last_send = max(a1 for _, a1, _ in arrivals)
    return {"name": "x", "kind": "transport", "status": "done", "first_chunk_bytes": first_chunk,
            "tx_cpu_s": 0.5, "first_chunk_send_t": first_send + first_chunk_wait_s,
            "last_send_t": last_send, "layers": 1,
            "row": {"streams": streams, "fin": {"first_send_t": first_send}, "rx_cpu_s": 0.25,
                    "rx_page_faults": 1000}}


def test_figures_goodput_cpu_and_first_chunk():
    # link start at 100 s, the bucket holds the first 200 MB chunk back 0.2 s, the last byte
    # arrives at 102 s
    r = _transport_result(100.0, [(100.21, 102.0, 102.0)], [(10, 2_000_000_000)], 200_000_000,
                          first_chunk_wait_s=0.2)
    f = bt.figures(r)
    assert f["wire_s"] == pytest.approx(2.0)
    assert f["goodput_gb_per_s"] == pytest.approx(1.0)
    assert f["goodput_gbps"] == pytest.approx(8.0)
    assert f["tx_cpu_s_per_gb"] == pytest.approx(0.25)
    assert f["rx_cpu_s_per_gb"] == pytest.approx(0.125)
    assert f["rx_page_faults_per_mb"] == pytest.approx(0.5)
    # the sender handed chunks 2..N (1.8 GB) to ZeroMQ from 100.2 s to 102 s
    assert f["send_gbps"] == pytest.approx(8.0)
    # pay before send: chunks 2..N (1.8 GB) after the first chunk's send (100.2 s)
    g = bt.figures(r, exclude_first_chunk=True)
    assert g["goodput_gb_per_s"] == pytest.approx(1.0)
    assert g["goodput_all_gbps"] == pytest.approx(8.0)
    h = bt.figures(_transport_result(100.0, [(100.21, 102.0, 102.0)], [(10, 2_000_000_000)],
                                     200_000_000, first_chunk_wait_s=0.4),
                   exclude_first_chunk=True)
    assert h["goodput_gb_per_s"] == pytest.approx(1.8 / 1.6)
    with pytest.raises(RuntimeError, match="peer_lost"):
        bt.figures({"name": "x", "status": "peer_lost", "error": "gone"})


def test_anchor_figures_against_ideal():
    # anchor: 125 MB complete 1.02 s after the first send at 1 Gbps (ideal 1.0 s)
    r = _transport_result(10.0, [(10.001, 11.02, 11.02), (10.5, 12.0, 12.0)],
                          [(100, 125_000_000), (100, 100_000_000)], 1_250_000)
    a = bt.anchor_figures(r, 1.0)
    assert a["ideal_s"] == pytest.approx(1.0)
    assert a["anchor_s"] == pytest.approx(1.02)
    assert a["ratio"] == pytest.approx(1.02)
    assert a["all_streams_s"] == pytest.approx(2.0)
    assert a["anchor_chunks"] == 100


def test_best_of_takes_fastest_and_median_cpu():
    runs = [_transport_result(0.0, [(0.0, t, t)], [(1, 1_000_000_000)], 1) for t in (1, 2, 4)]
    for r, cpu in zip(runs, (0.3, 0.1, 0.2), strict=True):
        r["tx_cpu_s"] = cpu
    best = bt.best_of(runs)
    assert best["goodput_gb_per_s"] == pytest.approx(1.0)
    assert best["goodput_median_gb_per_s"] == pytest.approx(0.5)
    assert best["tx_cpu_s_per_gb"] == pytest.approx(0.2)
    assert best["repeats"] == 3


def test_sizes_from_the_size_table():
    # bf16, 8 heads x 128 dims, 4096 tokens: 16 chunks of 1 MiB, each + 44 frame bytes
    # (24 control, 20 chunk header)
    assert bt.layer_wire_bytes("bf16", 8, 128, 4096) == [16 * ((1 << 20) + 44)]
    anchor, residual = bt.layer_wire_bytes("lynx", 8, 128, 4096)
    assert anchor > residual > 0
    assert bt.layers_for(1e9, 16 << 20) == 60
    assert bt.layers_for(1.0, 16 << 20) == 1


def test_tc_rows_say_skipped_without_namespaces(monkeypatch):
    import kvsim.transport.netns as netns

    monkeypatch.setattr(netns, "netns_available", lambda: (False, "not root (test)"))
    cfg = Config(parts=["tc"])
    rows = bt.run_bench(cfg)
    assert [(r["part"], r["case"], r["rate_gbps"]) for r in rows] == [
        ("tc", "raw_zmq", 0.1), ("tc", "transport", 0.1), ("tc", "raw_zmq", 1.0),
        ("tc", "transport", 1.0)]
    assert all(r["status"] == "skipped" and r["reason"] == "not root (test)" for r in rows)


@pytest.mark.parametrize(("override", "message"), [
    ("parts=[loopback,nope]", "parts must be"),
    ("policy=nope", "policy must be"),
    ("anchor.encode=[later]", "anchor.encode"),
    ("token_bucket.rates_gbps=[0]", "must be > 0"),
    ("max_queued_bytes=0", "max_queued_bytes must be > 0"),
    ("session_timeout_s=-1", "session_timeout_s must be > 0"),
])
def test_bad_config_is_refused(override, message, capsys):
    assert main(["bench", "transport", override]) == 2  # a usage error, caught before anything runs
    assert message in capsys.readouterr().err


def test_pre_encoded_codec_repeats_layers():
    codec = SimpleNamespace(name="c", exact_sizes=True)
    pre = bt._PreEncoded(codec, ["layer0", "layer1"])
    assert [pre.encode(i) for i in range(5)] == ["layer0", "layer1", "layer0", "layer1",
                                                 "layer0"]
    assert pre.name == "c" and pre.exact_sizes


def test_frame_overhead_is_the_protocol_framing():
    from kvsim.transport import protocol as P

    assert bt.FRAME_OVERHEAD_BYTES == P.CONTROL_BYTES + P.CHUNK_HEADER_BYTES
