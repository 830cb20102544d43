"""The transport with CURVE keys end to end, resume and failure from the command line, and its
Prometheus metrics scraped during a real transfer (loopback; synthetic KV of SmolLM2-135M's
shape, timing-model decode)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import pytest
import zmq.auth
from transport_harness import RunningReceiver

from kvsim.cli.main import main
from kvsim.core.compose import compose
from kvsim.transport import protocol as P
from kvsim.transport import session
from kvsim.transport.auth import write_keys
from kvsim.transport.config import EmulateConfig
from kvsim.transport.metrics import TransportMetrics, scrape
from kvsim.transport.rate_limiter import TokenBucket, Unlimited
from kvsim.transport.receiver import Receiver
from kvsim.transport.sender import Sender

BASE = ["transport.kv_source=synthetic", "transport.decode=timing", "workload.context_tokens=512",
        "workload.output_tokens=8", "transport.timeout_s=3", "transport.heartbeat_s=0.2",
        "speculative.acceptance=geometric:0.9", "codecs=[int8]"]


def config(*overrides: str) -> EmulateConfig:
    cfg, _ = compose("transport", [*BASE, *overrides], EmulateConfig)
    return cfg


def run_sender(cfg: EmulateConfig, endpoint: str, keys: str = "", limiter=None, **kw) -> list:
    session.warm_up(cfg, None)
    [batch] = session.outgoing_requests(cfg, None)
    return Sender(endpoint, limiter or Unlimited(), timeout_s=cfg.transport.timeout_s,
                  heartbeat_s=cfg.transport.heartbeat_s, keys=keys, log=lambda m: None,
                  **kw).run(batch)


def test_curve_admits_an_allowed_key_and_no_other(tmp_path):
    keys = tmp_path / "keys"
    write_keys(keys)
    stranger = tmp_path / "stranger"  # knows the server's public key; its own is not allowed
    stranger.mkdir()
    zmq.auth.create_certificates(stranger, "client")
    shutil.copy(keys / "server.key", stranger / "server.key")
    cfg = config(f"transport.keys={keys}")
    with RunningReceiver(cfg) as rx:
        [ok] = run_sender(cfg, rx.endpoint, str(keys))
        [refused] = run_sender(cfg, rx.endpoint, str(stranger))
        [plain] = run_sender(cfg, rx.endpoint, "")  # no CURVE at all
    assert ok.status == "done", ok.error
    assert ok.row["chunks_received"] == ok.row["chunks_expected"]
    # an unauthenticated peer never reaches the receiver's code: the handshake fails and
    # its sender hears nothing
    for res in (refused, plain):
        assert res.status == "peer_lost", res.error
    assert len(rx.rows) == 1


def test_a_request_is_its_authenticated_peers(tmp_path):
    """With CURVE, a second allowed key that knows a request's id cannot touch it."""
    keys = tmp_path / "keys"
    write_keys(keys)
    write_keys(keys, client="other")
    other = tmp_path / "other"
    other.mkdir()
    for name in ("server.key", "other.key_secret"):
        shutil.copy(keys / name, other / name)
    cfg = config(f"transport.keys={keys}")
    [batch] = session.outgoing_requests(cfg, None)
    with RunningReceiver(cfg) as rx:
        victim = Sender(rx.endpoint, TokenBucket(0.02), timeout_s=5, keys=str(keys),
                        log=lambda m: None)
        done: list = []
        thread = threading.Thread(target=lambda: done.extend(victim.run(batch)))
        thread.start()
        deadline = time.monotonic() + 10
        while batch[0].request_id not in rx.requests and time.monotonic() < deadline:
            time.sleep(0.02)
        [again] = session.outgoing_requests(cfg, None)
        again[0].request_id = batch[0].request_id
        [attack] = Sender(rx.endpoint, Unlimited(), timeout_s=3, keys=str(other),
                          log=lambda m: None).run(again)
        thread.join(30)
    assert attack.status == "refused" and attack.error.startswith("not owner"), attack.error
    assert done[0].status == "done", done[0].error
    assert rx.refused["not owner"] >= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_are_scraped_during_a_transfer():
    cfg = config()
    rx_metrics, tx_metrics = TransportMetrics("serve"), TransportMetrics("send")
    rx_port, tx_port = _free_port(), _free_port()
    rx_metrics.start_server(rx_port)
    tx_metrics.start_server(tx_port)
    total = session.outgoing_requests(cfg, None)[0][0].codec.size_table(
        cfg.model.kv_shape(512)).total_bytes
    try:
        with RunningReceiver(cfg, rx_metrics) as rx:
            out: list = []
            # ~1.6 MB at 0.005 Gbps: about 2.5 s on the wire
            thread = threading.Thread(target=lambda: out.extend(run_sender(
                cfg, rx.endpoint, limiter=TokenBucket(0.005), metrics=tx_metrics)))
            thread.start()
            received = 0.0
            deadline = time.monotonic() + 20
            while not 0 < received < total and time.monotonic() < deadline:
                time.sleep(0.1)
                during = scrape(f"http://127.0.0.1:{rx_port}/metrics", timeout_s=5)
                received = sum(v for k, v in during.items() if k.startswith(
                    "kvsim_transport_bytes_total{") and 'direction="received"' in k)
            sent_during = scrape(f"http://127.0.0.1:{tx_port}/metrics", timeout_s=5)
            thread.join(30)
            after_rx = scrape(f"http://127.0.0.1:{rx_port}/metrics", timeout_s=5)
            after_tx = scrape(f"http://127.0.0.1:{tx_port}/metrics", timeout_s=5)
    finally:
        rx_metrics.close()
        tx_metrics.close()
    assert out[0].status == "done", out[0].error
    assert 0 < received < total  # seen mid-transfer
    assert any(k.startswith("kvsim_transport_in_flight_bytes") for k in sent_during)
    done = 'kvsim_transport_requests_total{outcome="done",role="serve"}'
    assert after_rx[done] == 1
    assert after_tx['kvsim_transport_requests_total{outcome="done",role="send"}'] == 1
    assert after_rx['kvsim_transport_ttft_seconds_count{role="serve"}'] == 1
    rx_bytes = sum(v for k, v in after_rx.items() if k.startswith("kvsim_transport_bytes_total{")
                   and 'direction="received"' in k)
    tx_bytes = sum(v for k, v in after_tx.items() if k.startswith("kvsim_transport_bytes_total{")
                   and 'direction="sent"' in k)
    assert rx_bytes == tx_bytes == out[0].sent_bytes


def test_send_exits_nonzero_on_a_lost_peer_and_resumes_from_its_report(tmp_path):
    """Nothing listens: `kvsim send` fails (exit 1) naming why, and writes a report whose
    unfinished requests `resume=` takes again, with the same ids."""
    port = _free_port()
    report = tmp_path / "send.json"
    args = ["send", *BASE, "transport.timeout_s=1", f"transport.connect=tcp://127.0.0.1:{port}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    assert main([*args, f"report={report}"]) == 1
    [row] = json.loads(report.read_text())["rows"]
    assert row["status"] == "peer_lost" and row["variant"] == 0 and row["seq"] == 0
    assert len(row["request_id"]) == 32 and len(bytes.fromhex(row["sender_id"])) == 16
    cfg = config(f"resume={report}")
    [batch] = session.outgoing_requests(cfg, None)
    assert P.id_hex(batch[0].request_id) == row["request_id"]
    plan = session.resume_plan(str(report))
    assert plan.identities == {0: bytes.fromhex(row["sender_id"])}
    assert plan.ids == {(0, 0): P.parse_id(row["request_id"])}
    again = tmp_path / "again.json"
    assert main([*args, f"resume={report}", f"report={again}"]) == 1
    assert json.loads(again.read_text())["rows"][0]["request_id"] == row["request_id"]


def test_resume_names_what_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="neither a report file nor a request id"):
        session.resume_plan("not-an-id")
    done = tmp_path / "done.json"
    done.write_text(json.dumps({"rows": [{"status": "done", "variant": 0, "seq": 0,
                                          "request_id": "0" * 32}]}))
    with pytest.raises(ValueError, match="no unfinished request"):
        session.resume_plan(str(done))
    assert session.resume_plan("ab" * 16) == session.ResumePlan({(0, 0): int("ab" * 16, 16)},
                                                                {})


def test_a_non_loopback_bind_without_keys_is_refused():
    cfg = config()
    settings = session.receiver_settings(cfg, "tcp://0.0.0.0:0")
    rx = Receiver(settings, session.decoder_factory(cfg, "timing", None),
                  session.row_builder("timing"), log=lambda m: None)
    with pytest.raises(ValueError, match="transport.insecure"):
        rx.serve()
    assert rx.endpoint == ""  # refused before it bound anything


@pytest.mark.net
def test_two_namespaces_with_curve_keys_and_a_stranger_refused(tmp_path):
    """kvsim serve and the sender in two network namespaces (tc), CURVE on: the allowed key's
    requests complete; with its key removed from allowed/ (another in its place) nothing gets
    through and the sender reports the peer lost."""
    from kvsim.transport.emulate import emulate
    from kvsim.transport.netns import netns_available

    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    keys = tmp_path / "keys"
    write_keys(keys)
    cfg = config(f"transport.keys={keys}", "transport.emulation=tc", "link.bandwidth_gbps=0.5",
                 "transport.timeout_s=5")
    [row] = emulate(cfg)
    assert row["status"] == "done" and row["link_emulation"] == "tc", row
    write_keys(keys, client="someone-else")
    (keys / "allowed" / "client.key").unlink()
    [row] = emulate(cfg)
    assert row["status"] == "peer_lost", row


@pytest.mark.parametrize("held", [{"0": [[0, 10**7]]}, {"7": [[0, 1]]}, {"0": [[3, 2]]},
                                  {"0": [[0, 1]] * 5000}, {"0": "all"}])
def test_the_sender_believes_an_accept_only_within_its_own_size_table(held):
    """A receiver's ACCEPT claiming chunks the request does not have (10 million of them,
    another stream, an empty or reversed range, more ranges than chunks) fails the request
    as malformed instead of being believed (10**7 held seqs took ~600 MB before)."""
    import zmq

    cfg = config()
    [batch] = session.outgoing_requests(cfg, None)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    results: list = []
    sender = Sender(f"tcp://127.0.0.1:{port}", Unlimited(), timeout_s=5, log=lambda m: None)
    thread = threading.Thread(target=lambda: results.extend(sender.run(batch)))
    try:
        thread.start()
        hello = None
        deadline = time.monotonic() + 30
        while hello is None or hello.type != P.MsgType.HELLO:  # heartbeats come first
            assert router.poll(max(1, int(1000 * (deadline - time.monotonic())))), "no HELLO"
            peer, *frames = router.recv_multipart()
            hello = P.parse(frames)
        router.send_multipart([peer, *P.json_message(P.MsgType.ACCEPT, hello.request_id, {
            "window_bytes": 1 << 20, "held": held})])
        thread.join(30)
    finally:
        router.close(0)
        ctx.term()
    [res] = results
    assert res.status == "error" and res.error.startswith("malformed ACCEPT"), res.error
    assert res.sent_bytes == 0
