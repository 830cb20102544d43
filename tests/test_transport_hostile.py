"""`kvsim serve` under a hostile client (tests/hostile_client.py): every class of abuse is a
bounded flood against an in-process Receiver (timing decode, SmolLM2-135M's shape, a
256-token context), after which the receiver thread is alive, its refusals are counted by
code from P.REFUSAL_CODES, its log stayed short, its memory stayed bounded, and a good
request from kvsim's own Sender still completes with status "done"."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hostile_client import (
    REPLIES,
    HostileClient,
    LogCapture,
    RequestKit,
    flood_from_process,
    junk_hellos,
    malformed_messages,
    peak_rss_bytes,
    request_kit,
    reset_peak_rss,
    rss_bytes,
    unknown_fins,
)
from transport_harness import RunningReceiver

from kvsim.core.compose import compose
from kvsim.core.layout import KVShape
from kvsim.kernels.codec import make_codec
from kvsim.kernels.encoded import preamble_meta
from kvsim.transport import protocol as P
from kvsim.transport import session
from kvsim.transport.config import EmulateConfig
from kvsim.transport.rate_limiter import Unlimited
from kvsim.transport.receiver import LOGGED_PER_CODE, Receiver
from kvsim.transport.sender import Sender, SendResult

ARGS = ["transport.kv_source=synthetic", "transport.decode=timing", "codecs=[int8]",
        "workload.context_tokens=256", "workload.output_tokens=8", "transport.timeout_s=3",
        "transport.heartbeat_s=0.2", "speculative.acceptance=geometric:0.9"]
MIB = 1 << 20
RSS_SLACK_BYTES = 128 * MIB  # after a flood and a good request, RSS is within this of before
MAX_LOG_CHARS = 320  # "at most ~300 characters" a log line
GOOD_REQUEST_S = 60.0  # a good request's Sender, joined with this timeout
# the codes an admission failure may carry (a HELLO the receiver cannot or will not serve)
ADMISSION_CODES = {"incompatible", "admission error", "busy: memory", "busy: device memory"}


def config(*overrides: str) -> EmulateConfig:
    cfg, _ = compose("transport", [*ARGS, *overrides], EmulateConfig)
    cfg.validate()
    return cfg


@pytest.fixture(scope="module")
def cfg() -> EmulateConfig:
    c = config()
    session.warm_up(c, None)  # JIT-compile the codecs once, before anything is timed
    return c


@pytest.fixture(scope="module")
def kit(cfg: EmulateConfig) -> RequestKit:
    return request_kit(cfg)


class Harness(RunningReceiver):
    """The in-process receiver, its log captured, with what these tests ask of it."""

    def __init__(self, cfg: EmulateConfig, **limits: Any) -> None:
        self.log = LogCapture()
        super().__init__(cfg, log=self.log, **limits)

    @property
    def endpoint(self) -> str:
        return self.rx.endpoint

    def refused_total(self) -> int:
        return sum(dict(self.rx.refused).values())

    def settle(self, quiet_s: float = 0.3, timeout_s: float = 30.0) -> None:
        """Wait until the refusal counters stop moving (the receiver took in the flood)."""
        deadline = time.monotonic() + timeout_s
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            now_total = self.refused_total()
            if now_total != last:
                last, since = now_total, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.05)

    def good_request(self, timeout_s: float = GOOD_REQUEST_S) -> SendResult:
        return good_request(self.cfg, self.endpoint, timeout_s)

    def assert_healthy(self, rss_before: int | None = None) -> SendResult:
        """The thread is alive, a good request completes, refusals use the vocabulary,
        the log stayed short, and memory came back near where it was."""
        assert self.thread.is_alive(), "the receiver thread ended"
        res = self.good_request()
        assert res.status == "done", (res.status, res.error)
        assert res.row["status"] == "done", res.row.get("error")
        assert self.thread.is_alive(), "the receiver thread ended"
        assert_vocabulary(self.rx)
        assert_log_bounded(self.log.lines)
        if rss_before is not None:
            grown = rss_bytes(trim=True) - rss_before
            assert grown < RSS_SLACK_BYTES, f"RSS grew by {grown / MIB:.0f} MiB"
        return res


@pytest.fixture
def serve(cfg: EmulateConfig):
    started: list[Harness] = []

    def start(**limits: Any) -> Harness:
        h = Harness(cfg, **limits).start()
        started.append(h)
        return h

    yield start
    stuck = [h for h in started if not h.stop()]
    assert not stuck, "a receiver did not stop within 10 s of being told to"


def good_request(cfg: EmulateConfig, endpoint: str, timeout_s: float) -> SendResult:
    """One request of cfg's workload from kvsim's own Sender (in a thread: a Sender whose
    receiver keeps heartbeating but never answers would otherwise wait forever)."""
    [batch, *_] = session.outgoing_requests(cfg, None)
    sender = Sender(endpoint, Unlimited(), cfg.link.scheduling, cfg.transport.timeout_s,
                    cfg.transport.heartbeat_s, log=lambda m: None)
    out: list[SendResult] = []
    thread = threading.Thread(target=lambda: out.extend(sender.run(batch[:1])), daemon=True,
                              name="hostile-test-good-sender")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        sender._lose_peer(f"test: no DONE within {timeout_s} s")  # ends its link loop
        thread.join(10)
    assert out, "the good request's Sender did not return"
    return out[0]


def assert_vocabulary(rx: Receiver) -> None:
    unknown = set(dict(rx.refused)) - set(P.REFUSAL_CODES)
    assert not unknown, f"refusals counted outside the vocabulary: {sorted(unknown)[:5]}"


def assert_log_bounded(lines: list[str], floods_of: int | None = None) -> None:
    long = [line for line in lines if len(line) > MAX_LOG_CHARS]
    assert not long, f"{len(long)} log line(s) over {MAX_LOG_CHARS} chars: {long[0][:120]!r}"
    if floods_of is not None:  # a flood of one class of message: at most a few lines each
        assert len(lines) <= LOGGED_PER_CODE * len(P.REFUSAL_CODES), \
            f"{len(lines)} log lines for a flood of {floods_of} messages: {lines[:3]}"


def refusal(msg: P.Message | None) -> tuple[str, str]:
    """(code, reason) of a REFUSE (fails the test for anything else)."""
    assert msg is not None, "no reply"
    assert msg.type == P.MsgType.REFUSE, f"expected REFUSE, got {msg.type.name}: {msg.body}"
    body = msg.body
    code, reason = body.get("code"), body.get("reason")
    assert isinstance(reason, str) and len(reason) <= P.__dict__.get("MAX_REASON_CHARS", 256)
    assert code in P.REFUSAL_CODES, f"code {code!r} (reason {reason[:120]!r})"
    return code, reason


def open_request(client: HostileClient, kit: RequestKit, rid: int, timeout_s: float = 5.0,
                 **changes: Any) -> P.Message | None:
    client.send(kit.hello_frames(rid, **changes))
    return client.wait(rid, REPLIES, timeout_s)


def send_all(client: HostileClient, kit: RequestKit, rid: int, which=None) -> None:
    for frames in kit.chunk_frames(rid, which):
        assert client.send(frames)


def wait_until(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


# ---- the classes ---------------------------------------------------------------------------
def test_malformed_frame_flood(serve):
    h = serve()
    before = rss_bytes()
    with HostileClient(h.endpoint) as c:
        flood = c.flood(malformed_messages(3000, seed=7))
    assert flood.sent == 3000
    h.settle()
    assert h.rx.refused["malformed"] >= 1500, dict(h.rx.refused)
    h.assert_healthy(before)
    assert_log_bounded(h.log.lines, floods_of=3000)


def _bf16(tokens: int, page_tokens: Any, layers: int = 30, heads: int = 3,
          dim: int = 64) -> dict:
    return preamble_meta("bf16", {"page_tokens": page_tokens},
                         KVShape(layers, heads, tokens, dim), page_tokens, ["full"])


def _cachegen(**params: Any) -> dict:
    doc = {**make_codec("cachegen").params_dict(), **params}
    return preamble_meta("cachegen", doc, KVShape(30, 3, 256, 64), doc["page_tokens"],
                         make_codec("cachegen").stream_names())


def _hostile_hellos(kit: RequestKit) -> dict[str, tuple[tuple[str, ...], Any]]:
    shape = kit.hello["preamble"]["shape"]
    nested: Any = 1
    for _ in range(400):  # deep, yet under the recursion limit of the builders here
        nested = [nested]
    return {
        "bf16 page_tokens 2**63": (("preamble",), _bf16(256, 2**63)),
        "bf16 page_tokens 2**62": (("preamble",), _bf16(256, 2**62)),
        "bf16 page_tokens -1": (("preamble",), _bf16(256, -1)),
        "bf16 page_tokens 1.5": (("preamble",), _bf16(256, 1.5)),
        "bf16 page_tokens nested": (("preamble",), _bf16(256, nested)),
        "cachegen page_tokens 2**40": (("preamble",), _cachegen(page_tokens=2**40)),
        "cachegen group_tokens 2**40": (("preamble",), _cachegen(group_tokens=2**40)),
        "cachegen group_tokens 2**63": (("preamble",), _cachegen(group_tokens=2**63)),
        "cachegen band_edges 100k": (("preamble",), _cachegen(band_edges=[0.5] * 100_000)),
        # 2 layers x 2M pages of 1 token: 4M chunks in a 16 MB cache
        "4M chunks": (("preamble",), _bf16(2**21, 1, layers=2, heads=1, dim=1)),
        "tokens 2**40": (("preamble", "shape"), {**shape, "tokens": 2**40}),
        "tokens 2**63": (("preamble", "shape"), {**shape, "tokens": 2**63}),
        "layers 2**31": (("preamble", "shape"), {**shape, "layers": 2**31}),
        "head_dim 0": (("preamble", "shape"), {**shape, "head_dim": 0}),
        "tokens a string": (("preamble", "shape"), {**shape, "tokens": "256"}),
        "tokens true": (("preamble", "shape"), {**shape, "tokens": True}),
        "dtype 64 KiB": (("preamble", "shape"), {**shape, "dtype": "x" * 65536}),
        "shape a list": (("preamble", "shape"), [30, 3, 256, 64]),
        "preamble a string": (("preamble",), "bf16"),
        "output_tokens 2**63": (("output_tokens",), 2**63),
        "cap_tokens -1": (("cap_tokens",), -1),
        "time_scale 1e308": (("time_scale",), 1e308),
        "seq 2**100": (("seq",), 2**100),
        "ks 100k": (("ks",), list(range(1, 100_001))),
        "draft_overhead_s a list": (("draft_overhead_s",), [1.0]),
        "wire_version 2**70": (("wire_version",), 2**70),
    }


def test_oversized_hello_parameters_are_refused_quickly(serve, kit):
    h = serve()
    before = rss_bytes()
    reset_peak_rss()
    slow, codes = {}, {}
    with HostileClient(h.endpoint) as c:
        for name, (path, value) in _hostile_hellos(kit).items():
            rid = P.new_request_id()
            t0 = time.monotonic()
            c.send(kit.hello_with(rid, path, value))
            msg = c.wait(rid, REPLIES, timeout_s=10)
            took = time.monotonic() - t0
            assert h.thread.is_alive(), f"the receiver thread ended on {name!r}"
            assert msg is not None, f"no reply to {name!r}"
            assert msg.type == P.MsgType.REFUSE, f"{name!r} was taken: {msg.type.name}"
            codes[name] = refusal(msg)[0]
            if took > 1.0:
                slow[name] = round(took, 2)
    peak = peak_rss_bytes() - before
    assert not slow, f"refusals slower than 1 s: {slow}"
    assert set(codes.values()) <= ADMISSION_CODES, codes
    assert peak < 64 * MIB, f"admission peaked {peak / MIB:.0f} MiB above the start"
    h.assert_healthy(before)


# ---- acceptance: an inline curve, never a path ----------------------------------------------
_WATCHED: set[str] = set()
_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _WATCHED and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path in _WATCHED or os.path.abspath(path) in _WATCHED:
            _OPENED.append(path)


sys.addaudithook(_audit)  # process-wide and permanent; idle while _WATCHED is empty


def test_acceptance_must_be_an_inline_curve_never_a_path(serve, kit, tmp_path):
    marker = f"SECRET-{P.new_request_id():x}"
    secret = tmp_path / "secret.json"  # a well-formed acceptance file, named by the marker
    secret.write_text(json.dumps({"version": 1, "name": marker, "survival": [1.0, 0.5],
                                  "source": marker}))
    missing = tmp_path / "missing.json"
    paths = [str(secret), str(missing), "/etc/hostname", "../../../../etc/hostname"]
    _WATCHED.update({*paths, os.path.abspath(paths[-1]), "/etc/hostname"})
    h = serve()
    try:
        replies = {}
        with HostileClient(h.endpoint) as c:
            for value in [*paths, "geometric:0.9", "seeds-fig10"]:
                rid = P.new_request_id()
                replies[value] = refusal(open_request(c, kit, rid, acceptance=value))
            # the sender's own form of an inline curve: a list, or an object with one
            ref = kit.hello["acceptance"]
            assert not isinstance(ref, str), "the sender itself sends a name or a path"

            def curve(survival: Any) -> Any:
                return {**ref, "survival": survival} if isinstance(ref, dict) else survival

            bad_curves = {"starts below 1": curve([0.5, 0.4]),
                          "increasing": curve([1.0, 0.5, 0.7]), "above 1": curve([1.0, 1.5]),
                          "negative": curve([1.0, -0.1]), "too long": curve([1.0] * 4097),
                          "not numbers": curve([1.0, "x"]), "null entry": curve([1.0, None]),
                          "empty": curve([]), "survival a path": curve(str(secret)),
                          "a number": 0.9, "a list of lists": [[1.0]]}
            for name, value in bad_curves.items():
                rid = P.new_request_id()
                replies[name] = refusal(open_request(c, kit, rid, acceptance=value))
            for good in (ref, curve([1.0, 0.9, 0.81, 0.5])):  # inline curves are taken
                rid = P.new_request_id()
                msg = open_request(c, kit, rid, acceptance=good)
                assert msg is not None and msg.type == P.MsgType.ACCEPT, msg and msg.body
                c.send(P.json_message(P.MsgType.ABORT, rid, {"reason": "test"}))
    finally:
        opened = list(_OPENED)
        _WATCHED.clear()
        _OPENED.clear()
    assert not opened, f"the receiver opened {opened}"
    assert {code for code, _ in replies.values()} == {"incompatible"}, replies
    everything = json.dumps(replies) + "\n".join(h.log.lines) + json.dumps(h.rx.rows)
    assert marker not in everything
    # an existing and a missing file are refused alike (no probe of the filesystem)
    same = [reason.replace(p, "<path>") for p, (_, reason) in replies.items() if p in paths[:2]]
    assert same[0] == same[1], same
    h.assert_healthy()
    assert marker not in json.dumps(h.rx.rows) + "\n".join(h.log.lines)


# ---- ownership -------------------------------------------------------------------------------
def test_another_peer_cannot_take_over_a_request(serve, kit):
    h = serve()
    rid = P.new_request_id()
    half = len(kit.chunks) // 2
    with HostileClient(h.endpoint) as victim, HostileClient(h.endpoint) as attacker:
        accept = open_request(victim, kit, rid)
        assert accept is not None and accept.type == P.MsgType.ACCEPT, accept and accept.body
        send_all(victim, kit, rid, range(half))
        victim.pump(0.2)
        # the attacker knows the id and the preamble: HELLO again (a "reconnect"), then
        # every message of a sender for the request
        assert refusal(open_request(attacker, kit, rid))[0] == "not owner"
        other = kit.hello_with(rid, ("output_tokens",), 1)
        attacker.send(other)
        assert refusal(attacker.wait(rid, REPLIES, 5))[0] == "not owner"
        for frames in kit.chunk_frames(rid, range(half, len(kit.chunks))):
            attacker.send(frames)
        attacker.send(kit.fin_frames(rid))
        attacker.send(P.json_message(P.MsgType.ABORT, rid, {"reason": "taken over"}))
        attacker.send(P.heartbeat())
        assert wait_until(lambda: h.rx.refused["not owner"] >= 2 + len(kit.chunks) - half + 2, 5), \
            dict(h.rx.refused)
        # the victim carries on and is answered
        send_all(victim, kit, rid, range(half, len(kit.chunks)))
        victim.send(kit.fin_frames(rid))
        done = victim.wait(rid, {P.MsgType.DONE, P.MsgType.ABORT}, timeout_s=20)
        assert done is not None and done.type == P.MsgType.DONE, done and done.body
        assert done.body["status"] == "done", done.body.get("error")
        attacker.pump(0.3)
        leaked = [m.type.name for m in attacker.take(rid)
                  if m.type not in (P.MsgType.REFUSE,)]
        assert not leaked, f"the attacker got {leaked} for the victim's request"
    assert h.rx.refused["duplicate chunk"] == 0  # none of the attacker's chunks was kept
    h.assert_healthy()


# ---- memory, credit, floods --------------------------------------------------------------------
def test_memory_budget_refuses_what_does_not_fit(serve, kit):
    budget = int(2.5 * kit.reserved_bytes)  # two requests fit, not three
    h = serve(max_memory_bytes=budget, max_requests_per_peer=64)
    before = rss_bytes()
    peers = [HostileClient(h.endpoint) for _ in range(5)]
    try:
        rids = [P.new_request_id() for _ in peers]
        replies = []
        for c, rid in zip(peers[:4], rids, strict=False):
            replies.append(open_request(c, kit, rid))
        kinds = [m.type.name if m is not None else None for m in replies]
        assert kinds.count("ACCEPT") == 2, kinds
        assert [refusal(m)[0] for m in replies if m.type == P.MsgType.REFUSE] == \
            ["busy: memory"] * 2
        # a cache of 64K tokens (1.5 GB bf16, under max_request_bytes) does not fit either
        shape = {**kit.hello["preamble"]["shape"], "tokens": 65536}
        peers[4].send(kit.hello_with(rids[4], ("preamble", "shape"), shape))
        assert refusal(peers[4].wait(rids[4], REPLIES, 5))[0] == "busy: memory"
        held = [(c, rid) for c, rid, m in zip(peers, rids, replies, strict=False)
                if m.type == P.MsgType.ACCEPT]
        for c, rid in held:  # fill them: what was reserved is used
            send_all(c, kit, rid)
        for c, rid in held:
            c.send(P.json_message(P.MsgType.ABORT, rid, {"reason": "test"}))
        assert wait_until(lambda: not h.rx.requests, 10), "aborted requests were not freed"
    finally:
        for c in peers:
            c.close()
    h.assert_healthy(before)  # the budget was given back: the good request fits again


def test_caches_on_a_device_are_reserved_against_the_devices_budget(serve, kit):
    """A decode node whose caches go to a CUDA device (device=cuda) reserves their bytes
    against that device's budget and only the wire bytes against the host's; a request whose
    caches do not fit the device is refused "busy: device memory" though the host has room.
    (No kernel runs here: the requests are aborted before any chunk arrives, so this holds
    on a host without CUDA too.)"""
    h = serve(device="cuda", max_device_memory_bytes=int(1.5 * kit.fp32_bytes),
              max_memory_bytes=10 * kit.reserved_bytes, max_requests_per_peer=64)
    assert h.rx.device_memory_limit_bytes == int(1.5 * kit.fp32_bytes)
    peers = [HostileClient(h.endpoint) for _ in range(2)]
    try:
        rids = [P.new_request_id() for _ in peers]
        first, second = (open_request(c, kit, rid) for c, rid in zip(peers, rids, strict=True))
        assert first.type == P.MsgType.ACCEPT, refusal(first)
        code, reason = refusal(second)
        assert code == "busy: device memory" and "cuda" in reason, (code, reason)
        assert h.rx.reserved[rids[0]] == kit.wire_bytes  # the host holds the wire bytes only
        assert h.rx.device_reserved[rids[0]] == kit.fp32_bytes
        assert h.rx.requests[rids[0]].device == "cuda"  # where its layers would be decoded
        peers[0].send(P.json_message(P.MsgType.ABORT, rids[0], {"reason": "test"}))
        assert wait_until(lambda: not h.rx.requests, 10), "the aborted request was not freed"
        assert not h.rx.device_reserved  # given back with the request
    finally:
        for c in peers:
            c.close()


def test_chunks_beyond_credit_are_dropped(serve, kit):
    window = 256 << 10
    h = serve(window_bytes=window)
    rid = P.new_request_id()
    with HostileClient(h.endpoint) as c:
        accept = open_request(c, kit, rid)
        assert accept is not None and accept.type == P.MsgType.ACCEPT
        assert accept.body["window_bytes"] == window
        for _ in range(2):  # the whole cache twice over, ignoring every ACK
            for frames in kit.chunk_frames(rid):
                c.send(frames)
        h.settle()
        assert h.rx.refused["beyond credit"] > 0, dict(h.rx.refused)
        c.send(P.json_message(P.MsgType.ABORT, rid, {"reason": "test"}))
    res = h.assert_healthy()
    # a sender that honours the window is never counted beyond it
    assert not any("credit" in k for k in res.row.get("refused_frames") or {}), res.row


def test_large_frame_flood_stays_bounded(serve):
    h = serve()
    # 300 FINs of ~4 MiB (1.2 GB in all) from another process, faster than the receiver
    # takes them in: what it buffers is bounded by its high-water marks, not the flood
    n, size = 300, P.MAX_JSON_BYTES - 64
    before = rss_bytes()
    reset_peak_rss()
    flood = flood_from_process(h.endpoint, n, size, max_s=60)
    h.settle(quiet_s=0.5)
    peak = peak_rss_bytes() - before
    assert flood.sent >= n // 2, flood
    assert peak < 384 * MIB, f"RSS peaked {peak / MIB:.0f} MiB above the start ({flood})"
    h.assert_healthy(before)


def test_unknown_request_flood_is_counted_not_logged(serve):
    h = serve()
    n = 20_000
    before = rss_bytes()
    mark = h.log.mark()
    with HostileClient(h.endpoint) as c:
        flood = c.flood(unknown_fins(n))
        assert flood.sent == n
        # counted while the client is still open: closing it (linger 0) drops what its
        # queue has not yet handed to the receiver, which a loaded host can leave behind
        assert wait_until(lambda: h.rx.refused["unknown request"] >= n, 30), \
            dict(h.rx.refused)
    assert_log_bounded(h.log.since(mark), floods_of=n)
    assert len(h.log.since(mark)) <= LOGGED_PER_CODE
    h.assert_healthy(before)


def test_long_fields_are_not_echoed(serve, kit):
    h = serve()
    long = "m" * 65536
    cases = {"model": (("model",), long), "policy": (("policy",), long),
             "codec": (("preamble", "codec"), long),
             "params key": (("preamble", "params"), {long: 1}),
             "streams": (("preamble", "streams"), [long]),
             "acceptance": (("acceptance",), long)}
    with HostileClient(h.endpoint) as c:
        for name, (path, value) in cases.items():
            rid = P.new_request_id()
            c.send(kit.hello_with(rid, path, value))
            code, reason = refusal(c.wait(rid, REPLIES, 5))
            assert len(reason) <= 256 and long[:300] not in reason, (name, len(reason))
    assert_log_bounded(h.log.lines)
    h.assert_healthy()


# ---- a peer that never reads -----------------------------------------------------------------
def test_slow_reader_does_not_stall_other_senders(serve, kit):
    h = serve()
    with HostileClient(h.endpoint, rcvhwm=1, rcvbuf=4096, send_timeout_s=2) as slow:
        rid = P.new_request_id()
        slow.send(kit.hello_frames(rid))  # a request of its own, then replies it never reads
        # ~30k replies of ~300 bytes: past the ROUTER's per-peer queue and the socket
        # buffers (a few MB on loopback) of a peer that reads nothing
        flood = slow.flood(junk_hellos(30_000, pad=220), max_s=30, drain=False)
        t0 = time.monotonic()
        res = h.good_request(timeout_s=30)
        took = time.monotonic() - t0
        assert res.status == "done", (res.status, res.error, dict(h.rx.refused), flood)
        assert took < 15, f"the good request took {took:.1f} s beside a slow reader"
        assert wait_until(lambda: h.rx.refused["slow reader"] > 0, 10), dict(h.rx.refused)
        assert wait_until(lambda: rid not in h.rx.requests, 10), "the slow peer's request stayed"
    h.assert_healthy()


# ---- time and slots ---------------------------------------------------------------------------
def test_a_never_ending_decode_is_ended_at_its_deadline(serve, kit):
    deadline_s = 2.0
    h = serve(request_deadline_s=deadline_s)
    rid = P.new_request_id()
    with HostileClient(h.endpoint) as c:
        t0 = time.monotonic()
        accept = open_request(c, kit, rid, output_tokens=65536, time_scale=10000.0)
        assert accept is not None and accept.type == P.MsgType.ACCEPT, accept and accept.body
        send_all(c, kit, rid)
        c.send(kit.fin_frames(rid))
        done = c.wait(rid, {P.MsgType.DONE, P.MsgType.ABORT}, timeout_s=deadline_s + 10)
        took = time.monotonic() - t0
    assert done is not None, "the request was never ended"
    row = done.body if done.type == P.MsgType.DONE else {}
    assert row.get("status") != "done" and took < deadline_s + 5, (took, row.get("status"))
    assert "deadline" in json.dumps(done.body), done.body
    assert wait_until(lambda: rid not in h.rx.requests, 5)
    hex_id, dec_id = f"{rid:032x}", str(rid)  # its decode thread stopped between steps
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith(
        "kvsim-decode") and (hex_id in t.name or dec_id in t.name)], 5)
    h.assert_healthy()


def test_one_peer_cannot_hold_every_slot(serve, kit):
    h = serve(max_requests_per_peer=2, max_active_requests=8)
    rids = [P.new_request_id() for _ in range(3)]
    with HostileClient(h.endpoint) as hog:
        replies = [open_request(hog, kit, rid) for rid in rids]
        kinds = [m.type.name if m is not None else None for m in replies]
        assert kinds[:2] == ["ACCEPT", "ACCEPT"], kinds
        assert refusal(replies[2])[0] == "busy: peer"
        # the hog keeps its two alive with heartbeats while another peer is served
        out: list[SendResult] = []
        worker = threading.Thread(target=lambda: out.append(h.good_request()), daemon=True)
        worker.start()
        while worker.is_alive():
            hog.heartbeat()
            hog.pump(0.1)
        assert out and out[0].status == "done", out and (out[0].status, out[0].error)
        assert all(rid in h.rx.requests for rid in rids[:2])  # still held, still alive
        for rid in rids[:2]:
            hog.send(P.json_message(P.MsgType.ABORT, rid, {"reason": "test"}))
        assert wait_until(lambda: not h.rx.requests, 10)
    assert_vocabulary(h.rx)
    assert h.thread.is_alive()

