"""kvsim.transport.metrics: each call moves its own series (and only it), labels stay bounded,
two instances never share a registry, a real HTTP scrape sees what was counted, and the
per-chunk call stays cheap enough for the I/O thread."""

from __future__ import annotations

import math
import socket
import timeit

import pytest

from kvsim.transport.metrics import (
    MAX_KS,
    MAX_STREAMS,
    OUTCOMES,
    REFUSAL_REASONS,
    TransportMetrics,
    scrape,
)

P = "kvsim_transport_"


def _moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The series whose value changed (or appeared with a non-zero value): new - old."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_chunks_count_bytes_and_frames_per_direction_and_stream():
    m = TransportMetrics("serve")
    before = m.values()
    m.chunk("received", 0, 1000)
    m.chunk("received", 0, 500)
    m.chunk("received", 1, 36)
    m.chunk("sent", 1, 7)
    assert _moved(before, m.values()) == {
        f'{P}bytes_total{{direction="received",role="serve",stream="0"}}': 1500.0,
        f'{P}chunks_total{{direction="received",role="serve",stream="0"}}': 2.0,
        f'{P}bytes_total{{direction="received",role="serve",stream="1"}}': 36.0,
        f'{P}chunks_total{{direction="received",role="serve",stream="1"}}': 1.0,
        f'{P}bytes_total{{direction="sent",role="serve",stream="1"}}': 7.0,
        f'{P}chunks_total{{direction="sent",role="serve",stream="1"}}': 1.0,
    }


def test_event_counters_and_gauges_move_their_own_series():
    m = TransportMetrics("send")
    before = m.values()
    m.nack("received")
    m.resend()
    m.resend(2)
    m.refused("busy: requests")
    m.request_ended("done")
    m.request_ended("peer_lost")
    m.set_active(3)
    m.set_queue(5, 5000)
    m.set_credit(1 << 20, 4 << 20)
    m.set_memory(3 << 30, 8 << 30, 5 << 30, 70 << 30)
    assert _moved(before, m.values()) == {
        f'{P}nacks_total{{direction="received",role="send"}}': 1.0,
        f'{P}resent_chunks_total{{role="send"}}': 3.0,
        f'{P}refusals_total{{reason="busy: requests",role="send"}}': 1.0,
        f'{P}requests_total{{outcome="done",role="send"}}': 1.0,
        f'{P}requests_total{{outcome="peer_lost",role="send"}}': 1.0,
        f'{P}active_requests{{role="send"}}': 3.0,
        f'{P}queued_chunks{{role="send"}}': 5.0,
        f'{P}queued_bytes{{role="send"}}': 5000.0,
        f'{P}in_flight_bytes{{role="send"}}': float(1 << 20),
        f'{P}window_bytes{{role="send"}}': float(4 << 20),
        f'{P}memory_reserved_bytes{{role="send"}}': float(3 << 30),
        f'{P}memory_limit_bytes{{role="send"}}': float(8 << 30),
        f'{P}device_memory_reserved_bytes{{role="send"}}': float(5 << 30),
        f'{P}device_memory_limit_bytes{{role="send"}}': float(70 << 30),
    }
    m.set_queue(0, 0)  # gauges follow the last value set
    assert m.values()[f'{P}queued_chunks{{role="send"}}'] == 0.0


def test_observe_row_fills_the_histograms_and_the_goodput_gauge():
    m = TransportMetrics("send")
    # as a row arrives in a DONE message: ttkt_s keys are strings after JSON
    m.observe_row({"status": "done", "ttft_s": 0.3, "ttkt_s": {"32": 1.2, "64": 2.0},
                   "goodput_gbps": 0.93, "total_bytes": 3_000_000})
    m.observe_row({"status": "done", "ttft_s": 0.6, "ttkt_s": {32: 1.4},
                   "goodput_gbps": 0.97, "total_bytes": 5_000_000})
    # a failed request's row: nothing to observe, nothing raised
    m.observe_row({"status": "partial", "ttft_s": math.nan, "ttkt_s": {"32": math.nan}})
    v = m.values()
    assert v[f'{P}ttft_seconds_count{{role="send"}}'] == 2.0
    assert v[f'{P}ttft_seconds_sum{{role="send"}}'] == pytest.approx(0.9)
    assert v[f'{P}ttft_seconds_bucket{{le="0.5",role="send"}}'] == 1.0
    assert v[f'{P}ttkt_seconds_count{{k="32",role="send"}}'] == 2.0
    assert v[f'{P}ttkt_seconds_sum{{k="32",role="send"}}'] == pytest.approx(2.6)
    assert v[f'{P}ttkt_seconds_count{{k="64",role="send"}}'] == 1.0
    assert v[f'{P}last_goodput_gbps{{role="send"}}'] == pytest.approx(0.97)  # the last one
    assert v[f'{P}request_wire_bytes_count{{role="send"}}'] == 2.0
    assert v[f'{P}request_wire_bytes_sum{{role="send"}}'] == 8_000_000.0
    assert v[f'{P}request_wire_bytes_bucket{{le="4.194304e+06",role="send"}}'] == 1.0


def test_an_aggregate_row_observes_its_requests():
    m = TransportMetrics("serve")
    m.observe_row({"ttft_s": 9.0, "per_request": [{"ttft_s": 0.1}, {"ttft_s": 0.2}]})
    v = m.values()
    assert v[f'{P}ttft_seconds_count{{role="serve"}}'] == 2.0
    assert v[f'{P}ttft_seconds_sum{{role="serve"}}'] == pytest.approx(0.3)


def test_labels_stay_bounded():
    """Unknown reasons and outcomes count as "other"; stream indexes beyond MAX_STREAMS share
    "other"; at most MAX_KS TTKT series; every bounded series exists from the start."""
    m = TransportMetrics("serve")
    v0 = m.values()
    for reason in REFUSAL_REASONS:  # all present at 0 before anything happened
        assert v0[f'{P}refusals_total{{reason="{reason}",role="serve"}}'] == 0.0
    for outcome in OUTCOMES:
        assert v0[f'{P}requests_total{{outcome="{outcome}",role="serve"}}'] == 0.0
    for i in range(1000):
        m.refused(f"seq {i} is out of range")  # free text from a fuzzer: one series
        m.request_ended(f"weird {i}")
        m.chunk("received", MAX_STREAMS + i, 10)
        m.observe_row({"ttkt_s": {str(k): 1.0 for k in range(i, i + 3)}})
    m.chunk("received", -1, 10)
    v = m.values()
    assert v[f'{P}refusals_total{{reason="other",role="serve"}}'] == 1000.0
    assert v[f'{P}requests_total{{outcome="other",role="serve"}}'] == 1000.0
    assert v[f'{P}chunks_total{{direction="received",role="serve",stream="other"}}'] == 1001.0
    assert v[f'{P}bytes_total{{direction="received",role="serve",stream="other"}}'] == 10010.0
    ks = {k.split('k="')[1].split('"')[0] for k in v if k.startswith(f"{P}ttkt_seconds_count")}
    assert ks == {str(k) for k in range(MAX_KS)}  # the first ones seen
    assert len(v) == len(m.values())  # reading adds nothing
    assert len(v) < 400, len(v)


def test_programming_errors_fail_loudly():
    with pytest.raises(ValueError, match="role"):
        TransportMetrics("decode")
    with pytest.raises(ValueError, match="direction"):
        TransportMetrics("send").chunk("sideways", 0, 1)


def test_instances_have_their_own_registries():
    a, b = TransportMetrics("send"), TransportMetrics("send")
    a.chunk("sent", 0, 100)
    a.request_ended("done")
    key = f'{P}bytes_total{{direction="sent",role="send",stream="0"}}'
    assert a.values()[key] == 100.0
    assert key not in b.values()
    assert b.values()[f'{P}requests_total{{outcome="done",role="send"}}'] == 0.0


def test_port_zero_starts_no_server():
    m = TransportMetrics("serve")
    assert m.start_server(0, "127.0.0.1") is None
    m.close()  # nothing to stop


def test_a_real_scrape_sees_the_counts():
    port = _free_port()
    with TransportMetrics("serve") as m:
        server, thread = m.start_server(port, "127.0.0.1")
        assert thread.is_alive()
        m.chunk("received", 0, 4096)
        m.chunk("received", 1, 1024)
        m.refused("checksum")
        m.nack("sent")
        m.set_active(2)
        m.set_memory(1 << 30, 4 << 30)
        m.observe_row({"ttft_s": 0.25, "ttkt_s": {"32": 1.5}, "goodput_gbps": 0.9,
                       "total_bytes": 5120})
        got = scrape(f"http://127.0.0.1:{port}/metrics", timeout_s=5.0)
        assert got == m.values()  # the same parse, over HTTP
        assert got[f'{P}bytes_total{{direction="received",role="serve",stream="0"}}'] == 4096.0
        assert got[f'{P}chunks_total{{direction="received",role="serve",stream="1"}}'] == 1.0
        assert got[f'{P}refusals_total{{reason="checksum",role="serve"}}'] == 1.0
        assert got[f'{P}nacks_total{{direction="sent",role="serve"}}'] == 1.0
        assert got[f'{P}active_requests{{role="serve"}}'] == 2.0
        assert got[f'{P}memory_limit_bytes{{role="serve"}}'] == float(4 << 30)
        assert got[f'{P}ttkt_seconds_count{{k="32",role="serve"}}'] == 1.0
        assert got[f'{P}last_goodput_gbps{{role="serve"}}'] == 0.9
        m.chunk("received", 0, 4096)  # a second scrape sees the counter move
        again = scrape(f"http://127.0.0.1:{port}/", timeout_s=5.0)
        assert again[f'{P}bytes_total{{direction="received",role="serve",stream="0"}}'] == 8192.0
        with pytest.raises(RuntimeError, match="already running"):
            m.start_server(_free_port(), "127.0.0.1")
    assert not thread.is_alive()  # close() stopped the server
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{port}/metrics", timeout_s=1.0)


def test_per_chunk_calls_are_cheap():
    """The I/O thread calls chunk() per frame and set_queue / set_credit per round: each well
    under 2 us (measured ~0.2 us here; a frame's send or receive costs several us)."""
    m = TransportMetrics("send")
    n = 20000
    costs_us = {}
    for name, call in (("chunk", lambda: m.chunk("sent", 1, 65536)),
                       ("set_queue", lambda: m.set_queue(12, 786432)),
                       ("set_credit", lambda: m.set_credit(1 << 20, 16 << 20))):
        costs_us[name] = min(timeit.repeat(call, number=n, repeat=5)) / n * 1e6
    assert all(c < 2.0 for c in costs_us.values()), costs_us
    assert m.values()[f'{P}chunks_total{{direction="sent",role="send",stream="1"}}'] == 5 * n
