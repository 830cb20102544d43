"""The real transport over loopback: frames, handshake, acknowledgements, resends, faults.

Runs a Receiver (decode side) in a thread or a process and a Sender against it, on synthetic
KV of SmolLM2-135M's shape with the timing-model decode (fast, no weights needed); the real
model's decode is exercised in test_transport_emulate.py."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hostile_client import malformed_messages
from transport_harness import RunningReceiver

from kvsim.core.compose import compose
from kvsim.transport import protocol as P
from kvsim.transport import session
from kvsim.transport.config import EmulateConfig
from kvsim.transport.rate_limiter import MAX_LAG_S, TokenBucket, Unlimited
from kvsim.transport.receiver import Receiver
from kvsim.transport.sender import OutgoingRequest, Sender

# transfer=seeds: monolithic / split_stream, the policies these tests check on the wire
BASE = ["transport.kv_source=synthetic", "transport.decode=timing", "workload.context_tokens=512",
        "workload.output_tokens=8", "transport.timeout_s=3", "transport.heartbeat_s=0.2",
        "speculative.acceptance=geometric:0.9", "transfer=seeds"]


def config(*overrides: str) -> EmulateConfig:
    cfg, _ = compose("transport", [*BASE, *overrides], EmulateConfig)
    cfg.validate()
    return cfg


def send(cfg: EmulateConfig, endpoint: str, limiter=None, **kw) -> list:
    session.warm_up(cfg, None)  # JIT-compile the codecs before anything is timed
    results = []
    for batch in session.outgoing_requests(cfg, None):
        sender = Sender(endpoint, limiter or Unlimited(), cfg.link.scheduling,
                        cfg.transport.timeout_s, cfg.transport.heartbeat_s, log=lambda m: None,
                        **kw)
        results += sender.run(batch)
    return results


def table_bytes(cfg: EmulateConfig, preset: str) -> tuple[int, list[int]]:
    from kvsim.kernels.presets import resolve_codec

    table = resolve_codec(preset).build().size_table(cfg.model.kv_shape(512))
    streams = table.stream_bytes
    streams[0] += table.header_bytes
    return table.total_bytes, streams


# ---- protocol -----------------------------------------------------------------------------
def test_chunk_frame_round_trip_and_crc_covers_header():
    payload = np.arange(1000, dtype=np.uint8)
    frames = P.chunk_frames(7, 1, 3, 2, 5, payload)
    msg = P.parse([bytes(f) for f in frames])
    assert msg.type == P.MsgType.CHUNK and msg.request_id == 7
    body = msg.body
    assert (body.stream, body.layer, body.page, body.seq) == (1, 3, 2, 5)
    assert bytes(body.payload) == payload.tobytes()
    for frame_i, byte_i in ((1, 2), (1, 4), (1, 8), (0, 9), (2, 500)):
        bad = [bytearray(bytes(f)) for f in frames]
        bad[frame_i][byte_i] ^= 0x01
        with pytest.raises(P.ProtocolError):
            P.parse([bytes(b) for b in bad])


def test_json_ack_nack_round_trip():
    doc = {"a": 1, "b": [1, 2], "c": "x"}
    assert P.parse(P.json_message(P.MsgType.HELLO, 3, doc)).body == doc
    msg = P.parse(P.ack_message(9, 12345, [4, 0, 7]))
    assert msg.body == (12345, [4, 0, 7])
    assert P.parse(P.nack_message(9, [(1, 4), (0, 2)])).body == [(1, 4), (0, 2)]
    assert P.parse(P.heartbeat()).type == P.MsgType.HEARTBEAT


@pytest.mark.parametrize("frames, why", [
    ([], "empty"), ([b"KVTP"], "control frame"),
    ([bytes([*b"KVTP", P.PROTOCOL_VERSION, 1, 1, 0]) + bytes(16), b"{}"], "reserved"),
    ([b"XXXX" + P.control(P.MsgType.HELLO, 1)[4:], b"{}"], "magic"),
    ([P.control(P.MsgType.HELLO, 1), b"[1,2]"], "JSON object"),
    ([P.control(P.MsgType.HELLO, 1), b"{\"a\": NaN}"], "not JSON"),
    ([P.control(P.MsgType.HELLO, 1), b"\xff\xfe"], "not JSON"),
    ([P.control(P.MsgType.ACK, 1), b"\0" * 9], "ACK"),
    ([P.control(P.MsgType.NACK, 1), b"\xff\xff\xff\xff"], "NACK"),
    ([P.control(P.MsgType.CHUNK, 1), b"\0" * 20], "frame"),
    ([bytes([*b"KVTP", P.PROTOCOL_VERSION, 99, 0, 0]) + bytes(16)], "unknown message type"),
    ([bytes([*b"KVTP", 1, 1, 0, 0]) + bytes(16), b"{}"], "version"),
    ([bytes([*b"KVTP", 1, 1, 0, 0]) + bytes(8), b"{}"], "control frame is 16 bytes"),
])
def test_malformed_messages_are_refused_with_a_reason(frames, why):
    with pytest.raises(P.ProtocolError) as err:
        P.parse(frames)
    if why:
        assert why in str(err.value)


def _fuzz_parse(n: int, seed: int) -> int:
    refused = 0
    for frames in malformed_messages(n, seed):
        try:
            P.parse(frames)
        except P.ProtocolError:
            refused += 1
    return refused


def test_parser_fuzz_fast():
    refused = _fuzz_parse(5000, 0)
    assert refused > 2500  # most mutations break the message; none raised anything else


@pytest.mark.slow
def test_parser_fuzz_100k():
    started = time.perf_counter()
    refused = _fuzz_parse(120_000, 1)
    assert refused > 60_000
    assert (time.perf_counter() - started) / 120_000 < 1e-3  # < 1 ms per frame


def test_token_bucket_paces_at_rate():
    clock = [0.0]
    bucket = TokenBucket(8e-6, clock=lambda: clock[0])  # 1000 bytes/s
    for _ in range(50):
        clock[0] += bucket.delay_s(100)
        assert bucket.delay_s(100) == 0
        bucket.consume(100)
    assert clock[0] == pytest.approx(5.0)  # each 100 bytes leave when they have crossed


def test_token_bucket_late_wakeups_lose_no_capacity():
    clock = [0.0]
    bucket = TokenBucket(8e-6, clock=lambda: clock[0])
    for _ in range(50):
        wait = bucket.delay_s(100, ready_t=0.0)  # all queued at t = 0 (a backlogged link)
        clock[0] += wait + 0.001  # ... but always woken 1 ms late
        assert bucket.delay_s(100) == 0
        bucket.consume(100)
    assert bucket.busy_until_t == pytest.approx(5.0)  # the link itself never idled
    assert clock[0] == pytest.approx(5.0 + 0.001)  # the lateness did not accumulate
    clock[0] = 100.0  # after an idle spell nothing was saved up: the next waits its time
    assert bucket.delay_s(100) == pytest.approx(0.1)
    bucket.consume(100)
    clock[0] = 200.0  # a message held back (credit) until now: its ready time is now, so
    assert bucket.delay_s(100, ready_t=200.0) == pytest.approx(0.1)  # no catch-up burst
    bucket.consume(100)
    clock[0] = 300.0  # the process stopped for 50 s with a message queued: idle beyond the
    assert bucket.delay_s(100, ready_t=150.0) == pytest.approx(0.1 - MAX_LAG_S)  # window
    # another message takes the head before that one went, ready (credit) only now: it
    # starts now, not at the first one's start
    assert bucket.delay_s(100, ready_t=300.0) == pytest.approx(0.1)
    bucket.consume(100)
    assert bucket.busy_until_t == pytest.approx(300.1)
    with pytest.raises(ValueError):
        TokenBucket(float("nan"))


def test_token_bucket_catches_up_a_thread_switch_interval():
    """A link loop kept off the interpreter for a whole switch interval (5 ms, while the
    encoder thread runs Python) loses no link time: the link had the message queued."""
    assert MAX_LAG_S >= 2 * 0.005
    clock = [0.0]
    bucket = TokenBucket(8e-3, clock=lambda: clock[0])  # 1e6 bytes/s: 100 B in 0.1 ms
    for i in range(1000):
        wait = bucket.delay_s(100, ready_t=0.0)
        clock[0] += wait + (0.005 if i % 100 == 0 else 0.0)  # every 100th wake 5 ms late
        assert bucket.delay_s(100) == 0
        bucket.consume(100)
    assert bucket.busy_until_t == pytest.approx(0.1)  # 1000 x 0.1 ms: never idle
    old = TokenBucket(8e-3, clock=lambda: clock[0], max_lag_s=0.002)  # caught up to 2 ms only
    clock[0] = 0.0
    for i in range(1000):
        clock[0] += old.delay_s(100, ready_t=0.0) + (0.005 if i % 100 == 0 else 0.0)
        old.consume(100)
    assert old.busy_until_t == pytest.approx(0.1 + 10 * 0.003)  # 3 ms lost to each


class _RecordingLimiter:
    """A token bucket that records each message's ready time as the link loop gives it."""

    def __init__(self, rate_gbps: float) -> None:
        self.bucket = TokenBucket(rate_gbps)
        self.ready_t: list[float] = []  # per message, at the first call for it
        self._asked = False

    def delay_s(self, size_bytes: int, ready_t: float | None = None) -> float:
        if not self._asked:
            self.ready_t.append(ready_t)
            self._asked = True
        return self.bucket.delay_s(size_bytes, ready_t)

    def consume(self, size_bytes: int) -> None:
        self._asked = False
        self.bucket.consume(size_bytes)


class _ReleaseRecordingSender(Sender):
    """A Sender that records the release time of each chunk it sends, in order."""

    released_t: list[float]

    def _send_chunk(self, sock, item) -> None:
        self.released_t.append(item.released_t)
        super()._send_chunk(sock, item)


def test_sender_gives_a_credit_held_message_the_time_it_found_credit():
    """Without a credit wait every message is ready at its release (a late link loop is
    caught up); with a credit window of two chunks (and a fast link) the loop waits for
    ACKs, and those messages are ready when it found credit, after their release (the link
    idled meanwhile: no burst follows)."""
    from kvsim.kernels.presets import resolve_codec

    cfg = config("codecs=[int8]")
    chunk = int(resolve_codec("int8").build().size_table(cfg.model.kv_shape(512))
                .chunk_bytes.max()) + P.CONTROL_BYTES + P.CHUNK_HEADER_BYTES
    session.warm_up(cfg, None)
    later = {}
    for window_chunks in (0, 2):
        limiter = _RecordingLimiter(50.0)
        kw = {"max_in_flight_bytes": window_chunks * chunk} if window_chunks else {}
        with RunningReceiver(cfg) as rx:
            [batch] = list(session.outgoing_requests(cfg, None))
            sender = _ReleaseRecordingSender(rx.endpoint, limiter, timeout_s=3.0,
                                             heartbeat_s=0.2, log=lambda m: None, **kw)
            sender.released_t = []
            [res] = sender.run(batch)
        assert res.status == "done", res.error
        assert len(limiter.ready_t) == len(sender.released_t) == sum(res.chunks)
        pairs = list(zip(limiter.ready_t, sender.released_t, strict=True))
        assert all(ready >= released for ready, released in pairs)
        later[window_chunks] = sum(1 for ready, released in pairs if ready > released)
    assert later[0] == 0  # exactly each message's release
    assert later[2] >= sum(res.chunks) // 5, later


def test_the_token_bucket_sender_may_use_the_receivers_whole_window():
    """The token bucket sends a chunk once it has crossed: nothing it has in flight is ahead
    of a later chunk, so its cap is the receiver's window (not rate x in_flight_ms), for
    every chunk and at every rate; over tc at the same rate the cap stays rate-bound."""
    for gbps in ("0.1", "1", "10"):
        bucket = config("transport.emulation=token_bucket", f"link.bandwidth_gbps={gbps}",
                        "transport.window_bytes=5000000")
        assert session.max_in_flight_bytes(bucket) == 5_000_000
        assert session.behind_in_flight_bytes(bucket) == 5_000_000
    shaped = config("transport.emulation=tc", "link.bandwidth_gbps=1",
                    "transport.window_bytes=5000000")
    assert session.max_in_flight_bytes(shaped) == 1_250_000  # 1 Gbps x 10 ms


def test_a_residual_waits_for_a_small_window_while_its_anchor_is_being_encoded():
    """A later stream's chunk goes into the shaper's FIFO ahead of the anchor chunks encoded
    after it: while its request's encoder runs it gets link rate x in_flight_ms (no 1 MiB
    floor); the anchor, and the residual once every chunk is released, the full cap."""
    from types import SimpleNamespace

    from kvsim.transport.scheduler import QueuedChunk

    cfg = config("transport.emulation=tc", "link.bandwidth_gbps=0.1")
    assert session.max_in_flight_bytes(cfg) == 1 << 20  # 10 ms is 125 kB: the floor
    assert session.behind_in_flight_bytes(cfg) == 125_000
    fast = config("transport.emulation=tc", "link.bandwidth_gbps=10")
    assert session.behind_in_flight_bytes(fast) == session.max_in_flight_bytes(fast)
    assert session.behind_in_flight_bytes(config("transport.emulation=none")) == \
        cfg.transport.window_bytes
    sender = Sender("tcp://127.0.0.1:1", Unlimited(), max_in_flight_bytes=1 << 20,
                    behind_in_flight_bytes=125_000)
    accepted = threading.Event()
    accepted.set()
    owner = SimpleNamespace(accepted=accepted, window_bytes=16 << 20, released_all=False)
    sender._reqs[7] = owner

    def chunk(stream: int) -> QueuedChunk:
        return QueuedChunk((stream,), 7, stream, 0, 0, 0, np.zeros(1, np.uint8), 100)

    assert sender._window(chunk(0)) == 1 << 20
    assert sender._window(chunk(1)) == 125_000
    owner.released_all = True  # every anchor chunk is queued ahead of it now
    assert sender._window(chunk(1)) == 1 << 20
    assert sender._window() == 1 << 20


# ---- end to end over loopback -------------------------------------------------------------
@pytest.mark.parametrize("codec", ["int8", "lynx"])
def test_loopback_transfer_delivers_the_size_table_and_a_row(codec):
    cfg = config(f"codecs=[{codec}]")
    total, streams = table_bytes(cfg, codec)
    with RunningReceiver(cfg) as rx:
        [res] = send(cfg, rx.endpoint, TokenBucket(1.0))
    assert res.status == "done", res.error
    row = res.row
    assert row["status"] == "done" and row["mode"] == "emulated" and row["decode"] == "timing"
    assert row["total_bytes"] == total
    assert list(row["stream_bytes"].values()) == streams
    assert row["chunks_received"] == row["chunks_expected"] == res.chunks
    assert 0 < row["ttft_s"] <= row["ttkt_s"]["8"]
    assert row["ttft_committed_s"] >= row["ttft_s"] - 1e-9
    # committed times from prefill end are the committed times (not the drafted ones)
    pe = row["ttft_committed_s"] - row["ttft_committed_from_prefill_end_s"]
    assert pe == pytest.approx(row["ttft_s"] - row["ttft_from_prefill_end_s"], abs=1e-9)
    assert row["ttkt_committed_from_prefill_end_s"]["8"] == pytest.approx(
        row["ttkt_committed_s"]["8"] - pe, abs=1e-9)
    assert 0 < row["goodput_gbps"] < 1.2
    # the parts cover the critical path up to the microseconds between two clock readings
    assert sum(row["breakdown_s"].values()) == pytest.approx(
        row["ttkt_from_prefill_end_s"]["8"], abs=2e-3)
    assert row["transfer"] == ("split_stream" if codec == "lynx" else "monolithic")
    # the HELLO to the encoder's start plus the first chunk's hand-off: a few ms here
    assert 0 < row["handshake_s"] < 1.0


def test_handshake_is_the_start_before_encoding_and_the_first_hand_off():
    from kvsim.transport.record import handshake_s

    fin = {"hello_start_t": 10.0, "encode_start_t": 10.004, "first_release_t": 10.010,
           "first_send_t": 10.011}
    assert handshake_s(fin) == pytest.approx(0.004 + 0.001)
    for missing in fin:  # a FIN without one of the times (an older sender): not measured
        assert math.isnan(handshake_s({k: v for k, v in fin.items() if k != missing}))
    assert math.isnan(handshake_s({**fin, "first_send_t": "soon"}))


def test_a_time_scaled_row_keeps_the_real_times_it_measured():
    """transport.time_scale=k: the link's and the modelled durations are reported / k, the
    encoder's work and the handshake (real CPU and round-trip time) as they ran."""
    from kvsim.transport.record import slowed_down

    row = {"ttft_s": 2.0, "encode_work_s": 0.03, "handshake_s": 0.004,
           "ttkt_s": {"8": 4.0}, "goodput_gbps": 0.5, "trace_spans": [["x", "p", 10.0, 12.0]]}
    out = slowed_down(row, 4.0, 10.0)
    assert (out["ttft_s"], out["ttkt_s"], out["goodput_gbps"]) == (0.5, {"8": 1.0}, 2.0)
    assert (out["encode_work_s"], out["handshake_s"]) == (0.03, 0.004)
    assert out["trace_spans"] == [["x", "p", 10.0, 10.5]] and out["time_scale"] == 4.0


def test_time_scale_runs_a_slower_link_and_reports_real_time():
    from kvsim.scenario.timing_model import TimingModel

    cfg = config("codecs=[int8]", "link.bandwidth_gbps=2", "transport.time_scale=4")
    with RunningReceiver(cfg) as rx:
        [res] = send(cfg, rx.endpoint, session.limiter_for(cfg))  # 0.5 Gbps on the wire
    row = res.row
    assert res.status == "done" and row["time_scale"] == 4
    tpot = TimingModel(cfg.model, cfg.hardware).tpot_s(512, 1)
    # the decode host's batch (decode_max_batch 64) reports its steps as they ran (x4 slower
    # on the clock), in real time again
    assert row["tpot_s"] == pytest.approx(tpot, rel=0.1)
    assert 1.0 < row["goodput_gbps"] < 2.2  # measured at 0.5 Gbps, reported x4
    # a request decoding alone (decode_max_batch 1) reports the modelled step itself
    alone = config("codecs=[int8]", "link.bandwidth_gbps=2", "transport.time_scale=4",
                   "workload.decode_max_batch=1")
    with RunningReceiver(alone) as rx:
        [res] = send(alone, rx.endpoint, session.limiter_for(alone))
    assert res.row["tpot_s"] == pytest.approx(tpot, rel=1e-6)
    with pytest.raises(ValueError, match="timing"):
        config("transport.time_scale=4", "transport.decode=real")


def test_anchor_goes_first_on_the_wire():
    cfg = config("codecs=[lynx]")
    with RunningReceiver(cfg) as rx:
        [res] = send(cfg, rx.endpoint, TokenBucket(0.5))
    streams = [stream for stream, _, _, _ in res.sends]
    # every anchor chunk (stream 0) leaves before the last residual layer is released
    assert streams.index(1) > 0 and max(i for i, s in enumerate(streams) if s == 0) < \
        len(streams) - 1
    row = res.row
    done = row["stream_complete_from_prefill_end_s"]
    assert done["anchor"] < done["residual"]
    # the sender's encoder time (FIN): within its encode span, not counting queue waits
    [(t0, t1)] = [(a, b) for name, _p, a, b in row["trace_spans"] if name == "encode"]
    assert 0 < row["encode_work_s"] <= t1 - t0 + 1e-3


def test_poisson_arrivals_share_one_link():
    cfg = config("codecs=[lynx]", "workload=poisson", "workload.prefill_nodes=1",
                 "workload.requests=3",
                 "workload.rate_per_s=4", "workload.context_dist=fixed",
                 "workload.context_tokens=512", "workload.output_tokens=8")
    with RunningReceiver(cfg) as rx:
        results = send(cfg, rx.endpoint, TokenBucket(0.5))
    assert [r.status for r in results] == ["done"] * 3
    arrivals = [r.times["arrival_t"] for r in results]
    assert arrivals == sorted(arrivals) and arrivals[-1] > arrivals[0]
    assert sorted(r.row["request_id"] for r in results) == sorted(P.id_hex(r.request_id)
                                                                  for r in results)


def test_corrupt_chunk_is_asked_for_again(monkeypatch):
    cfg = config("codecs=[int8]")
    real = P.chunk_frames
    corrupted = []

    def corrupt_once(request_id, stream, layer, page, seq, payload, crc=None):
        frames = real(request_id, stream, layer, page, seq, payload, crc)
        if seq == 3 and not corrupted:
            corrupted.append(seq)
            bad = bytearray(bytes(memoryview(frames[2]).cast("B")))
            bad[0] ^= 0xFF
            frames[2] = bytes(bad)
        return frames

    monkeypatch.setattr(P, "chunk_frames", corrupt_once)
    with RunningReceiver(cfg) as rx:
        [res] = send(cfg, rx.endpoint)
    assert corrupted and res.status == "done", res.error
    assert res.resent_chunks == 1
    assert res.row["refused_frames"] == {"checksum": 1}
    assert rx.refused["checksum"] == 1


def test_refuses_a_request_for_another_model():
    cfg = config("codecs=[int8]")
    with RunningReceiver(cfg) as rx:
        [batch] = session.outgoing_requests(cfg, None)
        batch[0].hello["model"] = "llama-3.1-8b"
        [res] = Sender(rx.endpoint, Unlimited(), timeout_s=3, log=lambda m: None).run(batch)
    assert res.status == "refused" and "model differs" in res.error


def test_a_busy_receiver_refuses_more_requests():
    cfg = config("codecs=[int8]", "workload=poisson", "workload.prefill_nodes=1",
                 "workload.requests=2",
                 "workload.rate_per_s=1000", "workload.context_dist=fixed",
                 "transport.max_active_requests=1", "workload.context_tokens=512")
    with RunningReceiver(cfg) as rx:
        # 6.3 MB at 0.02 Gbps: the first is still in progress (2.5 s) when the second's
        # HELLO comes, one modelled prefill (1.2 s) after the first's
        results = send(cfg, rx.endpoint, TokenBucket(0.02))
    assert sorted(r.status for r in results) == ["done", "refused"]
    assert "busy" in next(r.error for r in results if r.status == "refused")


def test_forged_chunks_never_harm_the_request(monkeypatch):
    """Frames with valid checksums but wrong coordinates, lengths, or duplicates are refused
    by reason; the request still completes with exactly its bytes."""
    cfg = config("codecs=[int8]")
    total, _ = table_bytes(cfg, "int8")
    real = P.chunk_frames
    extra = []

    def forge(request_id, stream, layer, page, seq, payload, crc=None):
        frames = real(request_id, stream, layer, page, seq, payload, crc)
        if seq == 1 and not extra:
            view = np.frombuffer(memoryview(payload).cast("B"), np.uint8)
            extra.extend([
                real(request_id, stream, layer, page, seq, view[:-1]),  # short
                real(request_id, stream, layer + 1, page, seq, view),  # seq names another
                real(request_id, 7, layer, page, seq, view),  # no such stream
                real(request_id + 1, stream, layer, page, seq, view),  # unknown request
            ])
        return frames

    monkeypatch.setattr(P, "chunk_frames", forge)
    orig_send = Sender._send_chunk

    def send_with_forgeries(self, sock, item):
        orig_send(self, sock, item)
        while extra:
            sock.send_multipart(extra.pop())
        if item.seq == 2:  # and a duplicate of a chunk already delivered
            sock.send_multipart(real(item.request_id, item.stream, item.layer, item.page,
                                     item.seq, item.payload))

    monkeypatch.setattr(Sender, "_send_chunk", send_with_forgeries)
    with RunningReceiver(cfg) as rx:
        [res] = send(cfg, rx.endpoint)
    assert res.status == "done", res.error
    assert res.row["total_bytes"] == total
    # counted by code (a fixed vocabulary), whatever the frame carried
    assert rx.refused == {"bad chunk": 3, "unknown request": 1, "duplicate chunk": 1}


class _Interrupt(Exception):
    pass


def test_resume_sends_only_what_the_receiver_lacks(monkeypatch):
    cfg = config("codecs=[int8]", "transport.timeout_s=10")
    [batch] = session.outgoing_requests(cfg, None)
    orig_send = Sender._send_chunk
    count = [0]

    def die_after_20(self, sock, item):
        if count[0] == 20:
            raise _Interrupt  # the sender process "dies" mid-transfer
        count[0] += 1
        orig_send(self, sock, item)

    with RunningReceiver(cfg) as rx:
        monkeypatch.setattr(Sender, "_send_chunk", die_after_20)
        first = Sender(rx.endpoint, TokenBucket(0.5), timeout_s=10, log=lambda m: None)
        with pytest.raises(_Interrupt):
            first.run(batch)
        monkeypatch.setattr(Sender, "_send_chunk", orig_send)
        time.sleep(0.3)  # let the receiver take in what was sent
        # another peer that knows the id is refused, and takes nothing over
        [other] = Sender(rx.endpoint, Unlimited(), timeout_s=10, log=lambda m: None).run(
            _same_id(cfg, batch))
        assert other.status == "refused" and other.error.startswith("not owner"), other.error
        # the same peer (its routing id, kept in its report) resumes
        [res] = Sender(rx.endpoint, Unlimited(), timeout_s=10, log=lambda m: None,
                       identity=first.identity).run(_same_id(cfg, batch))
    assert res.status == "done", res.error
    assert 0 < res.skipped_chunks <= 20
    assert res.row["chunks_received"] == res.row["chunks_expected"]
    assert rx.refused["not owner"] == 1


def _same_id(cfg: EmulateConfig, batch: list[OutgoingRequest]) -> list[OutgoingRequest]:
    """A fresh request object with the same id (the restarted sender)."""
    [again] = session.outgoing_requests(cfg, None)
    again[0].request_id = batch[0].request_id
    return again


# ---- a dead peer (separate processes, killed) ---------------------------------------------
def _child(cmd: str, cfg: EmulateConfig, tmp: Path) -> subprocess.Popen:
    import dataclasses

    path = tmp / f"{cmd}.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    return subprocess.Popen([sys.executable, "-m", "kvsim", cmd, f"--resolved={path}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_receiver_killed_mid_transfer_is_noticed(tmp_path):
    import dataclasses
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config("codecs=[bf16]", "transport.timeout_s=2", "workload.context_tokens=2048",
                 "transfer=layerwise")
    rx_cfg = dataclasses.replace(cfg, transport=dataclasses.replace(
        cfg.transport, bind=f"tcp://127.0.0.1:{port}", endpoint_file=str(tmp_path / "ep")))
    proc = _child("serve", rx_cfg, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ep").is_file():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        session.warm_up(cfg, None)
        [batch] = session.outgoing_requests(cfg, None)
        sender = Sender(f"tcp://127.0.0.1:{port}", TokenBucket(0.1), timeout_s=2,
                        log=lambda m: None)  # ~4 s of bytes
        out: list = []
        thread = threading.Thread(target=lambda: out.extend(sender.run(batch)))
        thread.start()
        while not any(sum(r.result.acked or [0]) for r in sender._reqs.values()):
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)  # the decode host dies mid-transfer
        killed = time.monotonic()
        thread.join(30)
        took = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait(10)
    [res] = out
    assert res.status == "peer_lost", (res.status, res.error)
    assert "acknowledged chunks per stream" in res.error
    assert 0 < res.acked[0] < res.chunks[0]
    assert took < 2 + 1.5  # noticed within timeout_s (+ a poll round)


def test_sender_killed_mid_transfer_leaves_a_partial_report(tmp_path):
    import dataclasses

    cfg = config("codecs=[bf16]", "transport.timeout_s=2", "workload.context_tokens=2048",
                 "link.bandwidth_gbps=0.1")
    with RunningReceiver(cfg) as rx:
        tx_cfg = dataclasses.replace(cfg, transport=dataclasses.replace(
            cfg.transport, connect=rx.endpoint))
        proc = _child("send", tx_cfg, tmp_path)
        try:
            deadline = time.monotonic() + 60
            while not any(a.streams[0].count for a in list(rx.requests.values())):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            deadline = time.monotonic() + 10
            while not rx.rows:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.wait(10)
        assert not rx.requests  # freed
    [row] = rx.rows
    assert row["status"] == "partial"
    assert 0 < row["chunks_received"][0] < row["chunks_expected"][0]
    assert "sender silent" in row["error"]


def test_emulate_command_tree_untouched(tmp_path):
    """`kvsim emulate` end to end through the CLI (two processes), timing decode."""
    before = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent).stdout
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kvsim", "emulate", *BASE,
                           "codecs=[int4,lynx]", f"report={out}",
                           f"trace_path={tmp_path / 'trace.json'}"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["codec"] for r in rows] == ["int4", "lynx"]
    assert all(r["status"] == "done" for r in rows)
    assert "TTFT" in proc.stdout
    names = {e["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]}
    assert {"prefill", "encode", "transfer anchor", "transfer residual", "transfer full",
            "verify" if rows[1]["proposed_tokens"] else "decode"} <= names
    # each draft step's end, rejected or not (none for the monolithic int4)
    assert rows[0]["draft_steps_from_arrival_s"] == []
    assert len(rows[1]["draft_steps_from_arrival_s"]) == rows[1]["proposed_tokens"]
    after = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                           cwd=Path(__file__).parent.parent).stdout
    assert before == after


def test_emulate_aggregates_a_multi_request_workload(tmp_path):
    """Poisson arrivals through `kvsim emulate`: one row per codec as `kvsim sim` writes it
    (means and percentiles over requests), the request rows kept beside it."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kvsim", "emulate", *BASE, "codecs=[int8]",
                           "workload=poisson", "link.sharing=shared",  # 4 prefill instances
                           "workload.requests=3", "workload.rate_per_s=2",
                           "workload.context_dist=fixed", "workload.context_tokens=512",
                           "workload.output_tokens=8", f"report={out}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["requests"] == 3 and row["failed_requests"] == 0
    per = row["per_request"]
    assert len(per) == 3 and all(r["status"] == "done" for r in per)
    assert row["ttft_s"] == pytest.approx(np.mean([r["ttft_s"] for r in per]))
    assert row["ttft_pct_s"]["p99"] >= row["ttft_pct_s"]["p50"]
    assert "TTFT p99" in proc.stdout


def test_model_preset_weights_drive_live_prefill_and_real_decode():
    """One model group: the preset's weights source decides `auto` (tiny-random's random init
    is here; a preset with no weights here falls back to synthetic KV and the timing model),
    and the transfer runs on the model `model=` names."""
    assert session.source_kind(config("model=llama-3.1-8b", "transport.kv_source=auto")) == \
        "synthetic"
    cfg = config("model=tiny-random", "transport.kv_source=auto", "transport.decode=auto",
                 "codecs=[int8]", "workload.context_tokens=64", "workload.output_tokens=4")
    assert (session.source_kind(cfg), session.decode_mode(cfg)) == ("live", "real")
    lm = session.load_model(cfg)
    assert lm.meta["weights"] == "random init" and lm.meta["layers"] == 3
    mode = session.decode_mode(cfg)
    rx = Receiver(session.receiver_settings(cfg, "tcp://127.0.0.1:*"),
                  session.decoder_factory(cfg, mode, lm), session.row_builder(mode),
                  log=lambda m: None, check_hello=session.hello_checker(cfg, mode))
    thread = threading.Thread(target=rx.serve, daemon=True)
    thread.start()
    try:
        assert rx.bound.wait(10)
        [batch] = session.outgoing_requests(cfg, lm)
        [res] = Sender(rx.endpoint, Unlimited(), cfg.link.scheduling, cfg.transport.timeout_s,
                       cfg.transport.heartbeat_s, log=lambda m: None).run(batch)
    finally:
        rx.stop.set()
        thread.join(10)
    assert res.status == "done", res.error
    assert res.row["decode"] == "real"
    assert res.row["kv_source"]["kv_source"] == "live"
    assert res.row["kv_source"]["live_model"] == "tiny-random"


def test_a_reused_prefill_is_the_first_ones_kv_and_time_booked_not_waited():
    """transport.reuse_prefill: the same prompt prefilled again in this process reuses the
    first prefill's KV, first token and measured time; the request's arrival moves back by
    that time (it is booked, not waited), so its TTFT from arrival still includes it. Only
    a lone request may (workload.kind=single)."""
    from kvsim.transport import source as src

    cfg = config("model=tiny-random", "transport.kv_source=live", "transport.decode=real",
                 "codecs=[int8,int8]", "workload.context_tokens=64", "workload.output_tokens=4",
                 "transport.reuse_prefill=true")
    lm = session.load_model(cfg)
    mode = session.decode_mode(cfg)
    src._PREFILLS.clear()
    rx = Receiver(session.receiver_settings(cfg, "tcp://127.0.0.1:*"),
                  session.decoder_factory(cfg, mode, lm), session.row_builder(mode),
                  log=lambda m: None, check_hello=session.hello_checker(cfg, mode))
    thread = threading.Thread(target=rx.serve, daemon=True)
    thread.start()
    results = []
    try:
        assert rx.bound.wait(10)
        for batch in session.outgoing_requests(cfg, lm):  # one variant per codec entry
            results += Sender(rx.endpoint, Unlimited(), cfg.link.scheduling,
                              cfg.transport.timeout_s, cfg.transport.heartbeat_s,
                              log=lambda m: None).run(batch)
    finally:
        rx.stop.set()
        thread.join(10)
        src._PREFILLS.clear()
    first, again = (r.row for r in results)
    assert [r.status for r in results] == ["done", "done"]
    assert "prefill" not in first["kv_source"] and again["kv_source"]["prefill"] == "reused"
    assert again["prefill_s"] == first["prefill_s"] > 0
    assert again["token_ids"] == first["token_ids"]  # the same KV: the same greedy tokens
    for row in (first, again):  # from arrival = prefill + from prefill end, either way
        assert row["ttft_s"] == pytest.approx(row["prefill_s"] + row["ttft_from_prefill_end_s"],
                                              abs=0.05)
    with pytest.raises(ValueError, match="workload.kind=single"):
        config("transport.reuse_prefill=true", "workload=poisson")


def test_held_prefills_outlive_a_sender_run_and_go_with_the_last_scope():
    """A sender run forgets its prefills when it ends (forget_prefills), unless prefills_held
    spans several runs (a validation's scenarios): then the same prompt is prefilled once,
    a different prompt is not taken for it, and the kept KV goes when the outermost scope
    ends."""
    import torch

    from kvsim.transport import source as src

    lm = session.load_model(config("model=tiny-random", "transport.kv_source=live"))
    prompt, other = list(range(3, 35)), list(range(4, 36))
    src._PREFILLS.clear()
    try:
        src.reused_live_source(lm, prompt)
        src.forget_prefills()  # a run ends outside any scope: nothing kept
        assert not src.reused_live_source(lm, prompt).reused
        src.forget_prefills()
        with src.prefills_held():
            first = src.reused_live_source(lm, prompt)
            src.forget_prefills()  # one scenario's run ends
            with src.prefills_held():  # nested: the outer scope still holds them
                pass
            again = src.reused_live_source(lm, prompt)  # the next scenario's
            fresh = src.reused_live_source(lm, other)
            assert not first.reused and again.reused and not fresh.reused
            assert again.prefill_s == first.prefill_s and again.first_token == first.first_token
            assert torch.equal(again.layer(0), first.layer(0))
            assert len(src._PREFILLS) == 2
        assert not src._PREFILLS  # the scope's end drops them
        assert not src.reused_live_source(lm, prompt).reused
    finally:
        src._PREFILLS.clear()


def test_the_simulators_contention_knob_is_refused_by_the_emulator():
    """The receiver dequantizes beside its drafts for real: the simulator's model of that
    (speculative.dequant_contention) has no meaning here and is refused, not ignored."""
    with pytest.raises(ValueError, match="dequant_contention"):
        config("speculative.dequant_contention=1")
    assert config("speculative.dequant_contention=0").speculative.dequant_contention == 0


def test_synthetic_source_is_generated_during_the_modelled_prefill():
    """A synthetic cache is generated by prepare() (the sender calls it while the modelled
    prefill runs) and then served whole; a source without `preparable` stays lazy."""
    from kvsim.core.layout import KVShape
    from kvsim.transport.source import KVSource, synthetic_source

    shape = KVShape(2, 1, 32, 8)
    src = synthetic_source(shape, 0.0, seed=3)
    assert src.prepare(1 << 20) and src._kv is not None
    assert src.layer(1).shape == (1, 2, 1, 32, 8)
    assert not synthetic_source(shape, 0.0).prepare(16)  # over the budget: stays lazy
    lazy = KVSource(shape, "synthetic", 0.0, False, _make_layer=lambda i: i)
    assert not lazy.prepare(1 << 30) and lazy.layer(1) == 1


def test_the_hello_busy_draft_overhead_is_checked():
    """A request's busy_draft_overhead_s (the sender's profile, for the timing decode) is
    null or a number of seconds in [0, 3600], its ingest_s_per_byte a number in [0, 1e-3];
    anything else is refused at HELLO."""
    cfg = config()
    check = session.hello_checker(cfg, "timing")
    shape = cfg.model.kv_shape(512)
    base = {"output_tokens": 8, "cap_tokens": 4}
    assert check(base, shape) == ""
    assert check({**base, "busy_draft_overhead_s": None}, shape) == ""
    assert check({**base, "busy_draft_overhead_s": 0.05}, shape) == ""
    for bad in (True, "0.1", -1.0, math.nan, 1e9, [0.1]):
        assert "busy_draft_overhead_s" in check({**base, "busy_draft_overhead_s": bad}, shape)
    # ... and its ingest_s_per_byte a number of s per byte in [0, 1e-3] (absent: 0)
    assert check({**base, "ingest_s_per_byte": 2e-8}, shape) == ""
    for bad in (True, None, "1e-8", -1e-9, math.nan, 1.0):
        assert "ingest_s_per_byte" in check({**base, "ingest_s_per_byte": bad}, shape)


def test_a_real_decode_node_refuses_a_first_token_beyond_its_vocabulary():
    """A real decode node's batch feeds every member in one forward: a first token its
    model cannot embed is refused at HELLO, not left to fail the batch's step."""
    cfg = config()
    check = session.hello_checker(cfg, "real", vocab_size=49152)
    shape = cfg.model.kv_shape(512)
    base = {"output_tokens": 8, "cap_tokens": 4}
    assert check({**base, "first_token": 49151}, shape) == ""
    assert "beyond the model's vocabulary (49152)" in check({**base, "first_token": 49152},
                                                            shape)


def test_batched_real_decoding_reserves_the_batch_row_too():
    """Copies of a request's cache reserved at admission: the dequantized one; a real
    decode's model cache too; in a batch of more than one, its row of the batch's."""
    assert session._cache_copies(config("transport.decode=timing")) == 1
    assert session._cache_copies(config("transport.decode=real",
                                        "workload.decode_max_batch=1")) == 2
    assert session._cache_copies(config("transport.decode=real",
                                        "workload.decode_max_batch=8")) == 3


def test_the_workloads_instances_queue_prefills_and_decode_slots():
    """Two requests arriving together: one prefill instance prefills them one after the
    other, two side by side (over a shared link); one decode instance of one slot decodes
    the second only once the first has ended, a batch of two decodes them together."""
    def run(*overrides: str) -> list:
        cfg = config("codecs=[int8]", "workload=poisson", "workload.requests=2",
                     "workload.rate_per_s=1000", "workload.context_dist=fixed",
                     "workload.output_tokens=16", "link.sharing=shared",
                     "workload.decode_nodes=1", *overrides)
        with RunningReceiver(cfg) as rx:
            results = send(cfg, rx.endpoint, TokenBucket(2.0),
                           prefill=session.prefill_instances(cfg))
        assert [r.status for r in results] == ["done"] * 2
        return sorted(results, key=lambda r: r.times["arrival_t"])

    def first_last(res) -> tuple[float, float]:  # Unix s of its first and 16th token
        t = res.times["arrival_t"]
        return t + res.row["ttft_s"], t + res.row["ttkt_s"]["16"]

    first, second = run("workload.prefill_nodes=1", "workload.decode_max_batch=64")
    assert second.times["prefill_start_t"] >= first.times["prefill_end_t"] - 1e-3
    first, second = run("workload.prefill_nodes=2", "workload.decode_max_batch=1")
    # side by side: both started at arrival (1.29 s prefills, the second's 2 ms later)
    assert second.times["prefill_start_t"] < first.times["prefill_end_t"] - 1.0
    # 16 steps of ~25 ms: one's first token after the other's last (whichever reached
    # the decode host first: the prefills end within ms of each other)
    a, b = sorted((first_last(first), first_last(second)))
    assert b[0] > a[1]
    first, second = run("workload.prefill_nodes=2", "workload.decode_max_batch=2")
    a, b = sorted((first_last(first), first_last(second)))
    assert b[0] < a[1]  # the two step together


def test_the_transport_refuses_instances_it_cannot_run_as_the_simulator_does():
    with pytest.raises(ValueError, match="link.sharing=shared"):
        config("workload.prefill_nodes=2")
    with pytest.raises(ValueError, match="kv_aware"):
        config("workload.routing=kv_aware", "prefix_cache.enabled=true",
               "workload.decode_nodes=2")
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        config("workload.prefill_chunk_tokens=256")
    with pytest.raises(ValueError, match="one prefix store"):
        config("prefix_cache.enabled=true", "workload.decode_nodes=2",
               "prefix_cache.prefill_capacity_gb=0", "prefix_cache.block_tokens=256")


def test_a_sender_sizes_its_encoders_kernels_to_its_share():
    """numba's thread count is per launching thread: a sender given kernel_threads (a
    pinned sender's CPUs) sets it in each request's producer thread, which encodes."""
    import numba

    cfg = config("codecs=[int8]")
    session.warm_up(cfg, None)  # JIT-compile the codecs first
    seen = []
    with RunningReceiver(cfg) as rx:
        for threads in (1, 0):
            [batch] = session.outgoing_requests(cfg, None)
            make = batch[0].make_source

            def recording(make=make):
                seen.append(numba.get_num_threads())
                return make()

            batch[0].make_source = recording
            [res] = Sender(rx.endpoint, Unlimited(), timeout_s=3, log=lambda m: None,
                           kernel_threads=threads).run(batch)
            assert res.status == "done", res.error
    assert seen == [1, numba.config.NUMBA_NUM_THREADS]
    with pytest.raises(ValueError, match="kernel_threads"):
        Sender("tcp://127.0.0.1:1", Unlimited(), kernel_threads=-1)
