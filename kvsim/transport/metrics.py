"""Prometheus metrics of the real transport: what `kvsim serve` (role "serve") and `kvsim send`
or `kvsim emulate`'s sender (role "send") count while they run, served over HTTP on
`transport.metrics_port` (0: no server) at `transport.metrics_addr`.

Every series carries a constant label `role` ("serve" | "send"), so the two ends expose the
same names and one dashboard reads both. Each `TransportMetrics` owns its own
`CollectorRegistry` (never prometheus_client's global one): several can live in one process
(tests, `kvsim emulate`). Series, in base units (bytes, seconds) except goodput (Gbps, as in
kvsim's rows):

    kvsim_transport_bytes_total{role,direction,stream}     chunk frames' wire bytes
    kvsim_transport_chunks_total{role,direction,stream}    chunk frames
        direction: sent | received; stream: "0", "1", ... (stream 0 first), "other" beyond 8
    kvsim_transport_resent_chunks_total{role}              chunks queued again after a NACK
    kvsim_transport_nacks_total{role,direction}            NACK messages sent | received
    kvsim_transport_refusals_total{role,reason}            reason in REFUSAL_REASONS
    kvsim_transport_requests_total{role,outcome}           outcome in OUTCOMES
    kvsim_transport_active_requests{role}                  requests in progress (the
                                                           receiver's queue depth)
    kvsim_transport_queued_chunks{role}, _queued_bytes     sender: encoded, waiting for the link
    kvsim_transport_in_flight_bytes{role}, _window_bytes   sender: credit used / granted
    kvsim_transport_memory_reserved_bytes{role}, _memory_limit_bytes   receiver: memory budget
    kvsim_transport_device_memory_reserved_bytes{role}, _device_memory_limit_bytes
                                                           receiver: its device's (0: caches on
                                                           the host)
    kvsim_transport_last_goodput_gbps{role}                the last finished request's goodput
    kvsim_transport_request_wire_bytes{role}               histogram: bytes per request
    kvsim_transport_ttft_seconds{role}                     histogram: TTFT from arrival
    kvsim_transport_ttkt_seconds{role,k}                   histogram: TTKT from arrival, k from
                                                           the first 8 ks seen

Always counting, never a no-op variant: the per-chunk path is a dict lookup and two integer
adds (~0.2 us, tests/test_transport_metrics.py measures it) against a chunk frame's send or
receive of several us, and the counts also serve the end-of-run summary (`values()`). Only
the HTTP server is optional. What runs per chunk or per link-loop round (`chunk`,
`set_queue`, `set_credit`) is kept in plain Python numbers and read at scrape time by a
collector (a prometheus_client Counter child costs ~0.45 us per inc: a lock); call those from
one thread, the I/O thread that owns the socket. Everything else (per request, per refusal)
is a prometheus_client metric, safe from any thread. Unknown refusal reasons and outcomes
count as "other" (text from a peer never grows the label set, and never raises); a role or
direction outside its vocabulary is the caller's bug and raises.
"""

from __future__ import annotations

import math
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvsim.transport import protocol as P

PREFIX = "kvsim_transport_"
ROLES = ("serve", "send")
DIRECTIONS = ("sent", "received")
MAX_STREAMS = 8  # stream labels "0".."7"; a higher stream index counts as "other"
MAX_KS = 8  # TTKT series for the first 8 distinct ks observed; later ks are not observed
# what a request ended as (the sender's SendResult.status, the receiver's row status mapped
# by the caller: partial -> peer_lost); anything else counts as "other"
OUTCOMES = ("done", "refused", "peer_lost", "aborted", "error", "cancelled", "deadline",
            "other")
# why a frame or a HELLO was refused: the transport's fixed vocabulary (one home:
# protocol.REFUSAL_CODES); anything else counts as "other"
REFUSAL_REASONS = (*P.REFUSAL_CODES, "other")
# s: TTFT / TTKT, from 5 ms (loopback, small contexts) to 640 s (long contexts, slow links)
TIME_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# bytes per request: 64 KiB .. 64 GiB in powers of 4
WIRE_BYTES_BUCKETS = tuple(float(4 ** i * (1 << 16)) for i in range(11))


class _StreamCount:
    """Chunk frames and their wire bytes of one (direction, stream)."""

    __slots__ = ("bytes", "chunks")

    def __init__(self) -> None:
        self.bytes = 0
        self.chunks = 0


class _HotCollector(Collector):
    """The per-chunk and per-round numbers, plain ints written by the I/O thread and read
    here at scrape time (a read of an int the writer replaces is atomic)."""

    def __init__(self, role: str) -> None:
        self.role = role
        # (direction, stream index as passed) -> its count: the chunk path's lookup cache
        self.streams: dict[tuple[str, int], _StreamCount] = {}
        # (direction, stream label) -> count: what is exported (indexes >= MAX_STREAMS share
        # "other")
        self.series: dict[tuple[str, str], _StreamCount] = {}
        self.queued_chunks = 0
        self.queued_bytes = 0
        self.in_flight_bytes = 0
        self.window_bytes = 0

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "direction", "stream"]
        nbytes = CounterMetricFamily(PREFIX + "bytes", "Chunk frames' wire bytes (control + "
                                     "chunk header + payload)", labels=labels)
        chunks = CounterMetricFamily(PREFIX + "chunks", "Chunk frames", labels=labels)
        for (direction, stream), n in sorted(self.series.items()):
            nbytes.add_metric([self.role, direction, stream], n.bytes)
            chunks.add_metric([self.role, direction, stream], n.chunks)
        yield nbytes
        yield chunks
        for name, doc, value in (
                ("queued_chunks", "Encoded chunks waiting for the link", self.queued_chunks),
                ("queued_bytes", "Wire bytes of the chunks waiting for the link",
                 self.queued_bytes),
                ("in_flight_bytes", "Bytes sent and not yet processed by the receiver (credit "
                 "used)", self.in_flight_bytes),
                ("window_bytes", "Bytes the sender may have in flight (credit granted)",
                 self.window_bytes)):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["role"])
            gauge.add_metric([self.role], value)
            yield gauge


class TransportMetrics:
    """The metrics of one transport end (role "serve" or "send"), in its own registry."""

    def __init__(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self._hot = _HotCollector(role)
        self.registry.register(self._hot)
        self._new_stream_lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        reg = self.registry

        def child(metric: Any, *values: str) -> Any:
            return metric.labels(role, *values)

        resent = Counter(PREFIX + "resent_chunks", "Chunks queued again after a NACK",
                         ["role"], registry=reg)
        nacks = Counter(PREFIX + "nacks", "NACK messages (resend requests) sent or received",
                        ["role", "direction"], registry=reg)
        refusals = Counter(PREFIX + "refusals", "Frames or HELLOs refused, by reason",
                           ["role", "reason"], registry=reg)
        requests = Counter(PREFIX + "requests", "Requests ended, by outcome",
                           ["role", "outcome"], registry=reg)
        # every series of a bounded label exists from the start (at 0), as Prometheus advises
        self._resent = child(resent)
        self._nacks = {d: child(nacks, d) for d in DIRECTIONS}
        self._refusals = {r: child(refusals, r) for r in REFUSAL_REASONS}
        self._requests = {o: child(requests, o) for o in OUTCOMES}
        self._active = child(Gauge(PREFIX + "active_requests", "Requests in progress",
                                   ["role"], registry=reg))
        self._memory_reserved = child(Gauge(
            PREFIX + "memory_reserved_bytes", "Memory reserved by the requests in progress "
            "(the receiver's budget)", ["role"], registry=reg))
        self._memory_limit = child(Gauge(
            PREFIX + "memory_limit_bytes", "The receiver's memory budget", ["role"],
            registry=reg))
        self._device_memory_reserved = child(Gauge(
            PREFIX + "device_memory_reserved_bytes", "Device memory reserved for the "
            "dequantized caches of the requests in progress (0: caches on the host)", ["role"],
            registry=reg))
        self._device_memory_limit = child(Gauge(
            PREFIX + "device_memory_limit_bytes", "The receiver's device memory budget (0: "
            "caches on the host)", ["role"], registry=reg))
        self._goodput = child(Gauge(
            PREFIX + "last_goodput_gbps", "Goodput of the last finished request (Gbps: "
            "payload bits over its wire time)", ["role"], registry=reg))
        self._wire_bytes = child(Histogram(
            PREFIX + "request_wire_bytes", "Wire bytes per finished request", ["role"],
            registry=reg, buckets=WIRE_BYTES_BUCKETS))
        self._ttft = child(Histogram(
            PREFIX + "ttft_seconds", "Time to first valid token, from request arrival",
            ["role"], registry=reg, buckets=TIME_BUCKETS_S))
        self._ttkt_metric = Histogram(
            PREFIX + "ttkt_seconds", "Time to the k-th valid token, from request arrival",
            ["role", "k"], registry=reg, buckets=TIME_BUCKETS_S)
        self._ttkt: dict[int, Any] = {}  # k -> histogram child (at most MAX_KS)

    # ---- per chunk / per link-loop round: one thread (the I/O thread) --------------------
    def chunk(self, direction: str, stream: int, nbytes: int) -> None:
        """One chunk frame of `nbytes` wire bytes sent or received (direction "sent" |
        "received") on stream index `stream`. Call it for frames kept (receiver) or put on
        the socket (sender); refused ones go to `refused`."""
        try:
            n = self._hot.streams[(direction, stream)]
        except KeyError:
            n = self._new_stream(direction, stream)
        n.bytes += nbytes
        n.chunks += 1

    def _new_stream(self, direction: str, stream: int) -> _StreamCount:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        index = int(stream)
        label = str(index) if 0 <= index < MAX_STREAMS else "other"
        hot = self._hot
        with self._new_stream_lock:  # the scraper iterates the dicts: replace, never grow them
            series = dict(hot.series)
            n = series.setdefault((direction, label), _StreamCount())
            hot.series = series
            hot.streams = {**hot.streams, (direction, stream): n}
        return n

    def set_queue(self, chunks: int, nbytes: int) -> None:
        """Sender: encoded chunks (and their wire bytes) waiting for the link."""
        self._hot.queued_chunks = chunks
        self._hot.queued_bytes = nbytes

    def set_credit(self, in_flight_bytes: int, window_bytes: int) -> None:
        """Sender: bytes in flight (sent, not yet processed) and the window it may fill."""
        self._hot.in_flight_bytes = in_flight_bytes
        self._hot.window_bytes = window_bytes

    # ---- per event: any thread ---------------------------------------------------------
    def nack(self, direction: str) -> None:
        """One NACK message sent (receiver) or received (sender)."""
        self._nacks[direction].inc()

    def resend(self, chunks: int = 1) -> None:
        """Sender: chunks queued again after a NACK."""
        self._resent.inc(chunks)

    def refused(self, reason: str) -> None:
        """One frame or HELLO refused; `reason` from REFUSAL_REASONS (else "other")."""
        self._refusals.get(reason, self._refusals["other"]).inc()

    def request_ended(self, outcome: str) -> None:
        """One request ended; `outcome` from OUTCOMES (else "other")."""
        self._requests.get(outcome, self._requests["other"]).inc()

    def set_active(self, requests: int) -> None:
        """Requests in progress now."""
        self._active.set(requests)

    def set_memory(self, reserved_bytes: int, limit_bytes: int, device_reserved_bytes: int = 0,
                   device_limit_bytes: int = 0) -> None:
        """Receiver: bytes reserved by the requests in progress, and the budget; the same of
        its device's memory where the caches are dequantized to a device (else 0)."""
        self._memory_reserved.set(reserved_bytes)
        self._memory_limit.set(limit_bytes)
        self._device_memory_reserved.set(device_reserved_bytes)
        self._device_memory_limit.set(device_limit_bytes)

    def observe_row(self, row: dict) -> None:
        """A finished request's report row (kvsim.transport.record): `ttft_s`, `ttkt_s`
        ({k: s}; keys may be strings, as after JSON), `goodput_gbps`, `total_bytes`. Missing
        or non-finite fields are skipped (a failed request's row has no times). An aggregate
        row (`per_request`) observes its requests."""
        if isinstance(row.get("per_request"), list):
            for r in row["per_request"]:
                if isinstance(r, dict):
                    self.observe_row(r)
            return
        ttft = _finite(row.get("ttft_s"))
        if ttft is not None:
            self._ttft.observe(ttft)
        ttkt = row.get("ttkt_s")
        for k, t in (ttkt.items() if isinstance(ttkt, dict) else ()):
            s = _finite(t)
            hist = self._ttkt_child(k)
            if s is not None and hist is not None:
                hist.observe(s)
        goodput = _finite(row.get("goodput_gbps"))
        if goodput is not None:
            self._goodput.set(goodput)
        wire = _finite(row.get("total_bytes"))
        if wire is not None:
            self._wire_bytes.observe(wire)

    def _ttkt_child(self, k: Any) -> Any:
        try:
            key = int(k)
        except (TypeError, ValueError):
            return None
        hist = self._ttkt.get(key)
        if hist is None and len(self._ttkt) < MAX_KS:
            hist = self._ttkt[key] = self._ttkt_metric.labels(self.role, str(key))
        return hist

    # ---- reading ---------------------------------------------------------------------------
    def values(self) -> dict[str, float]:
        """Every series now, as `scrape` returns them (for a run's summary and tests)."""
        return parse_exposition(generate_latest(self.registry).decode())

    def start_server(self, port: int,
                     addr: str = "127.0.0.1") -> tuple[Any, threading.Thread] | None:
        """Serve this registry at http://addr:port/metrics (any path) from a daemon thread;
        port 0: no server (None). `close()` stops it."""
        if not port:
            return None
        if self._server is not None:
            raise RuntimeError("the metrics server is already running")
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return self._server, self._thread

    def close(self) -> None:
        """Stop the HTTP server, if one runs (the counts stay readable)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> TransportMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def parse_exposition(text: str) -> dict[str, float]:
    """{'name{label="value",...}': value} of a Prometheus text exposition (labels sorted;
    `name` alone without labels), without the `_created` timestamps."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def scrape(url: str, timeout_s: float) -> dict[str, float]:
    """Fetch a metrics endpoint (e.g. http://127.0.0.1:9400/metrics) and parse it
    (`parse_exposition`)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return parse_exposition(resp.read().decode())
