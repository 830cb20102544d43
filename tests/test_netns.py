"""Two-namespace shaped link (kvsim.transport.netns). Spec validation, names and the tc
command lines run everywhere; tests marked `net` build real namespaces and skip with the
reason from netns_available() where that is impossible (not root, no netns, no tc). All
traffic stays on the veth pair between namespaces these tests create."""

from __future__ import annotations

import json
import math
import os
import secrets
import select
import signal
import string
import subprocess
import sys
import textwrap

import pytest

from kvsim.transport.netns import (
    DEFAULT_PREFIX,
    GSO_QDISC_BYTES,
    Leftover,
    NetemSpec,
    NetnsError,
    call_in_netns,
    cleanup,
    leftovers,
    link_addresses,
    make_tag,
    netem_available,
    netns_available,
    reshaped,
    shaped_link,
    tc_commands,
)
from kvsim.transport.netns import _new_link as new_link

PY = [sys.executable, "-I", "-S"]  # isolated, no site: ~15 ms startup inside a namespace
PROC_TIMEOUT_S = 15.0

# Receiver: listen on (addr, any port), print the port, read to EOF, print bytes and the
# seconds from accept to EOF (the handshake is done when accept returns, so this is the
# data phase only).
SINK = textwrap.dedent("""
    import json, socket, sys, time
    srv = socket.create_server((sys.argv[1], 0)); srv.settimeout(10)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); t0 = time.perf_counter(); conn.settimeout(10)
    n = 0
    while chunk := conn.recv(1 << 20):
        n += len(chunk)
    t1 = time.perf_counter(); conn.close()
    print(json.dumps({"bytes": n, "seconds": t1 - t0}), flush=True)
""")
# Sender: connect, send size bytes of zeros, half-close, wait for the receiver's close.
SOURCE = textwrap.dedent("""
    import socket, sys
    addr, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = socket.create_connection((addr, port), timeout=10)
    buf = memoryview(bytes(1 << 20))
    while size > 0:
        s.sendall(buf[:min(size, len(buf))]); size -= len(buf)
    s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
""")
# Echo server and a client that times n one-byte round trips (TCP_NODELAY), printing them.
ECHO = textwrap.dedent("""
    import socket, sys
    srv = socket.create_server((sys.argv[1], 0)); srv.settimeout(10)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); conn.settimeout(10)
    while b := conn.recv(64):
        conn.sendall(b)
""")
PINGER = textwrap.dedent("""
    import json, socket, sys, time
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(int(sys.argv[3])):
        t0 = time.perf_counter(); s.sendall(b"x"); s.recv(1)
        rtts.append(time.perf_counter() - t0)
    s.close(); print(json.dumps(rtts))
""")


# --- helpers ----------------------------------------------------------------------------


def _server(link, code: str) -> tuple[subprocess.Popen, int]:
    """Start a server inside the receiver namespace; return it and the port it printed."""
    proc = subprocess.Popen(link.argv_in("receiver", [*PY, "-c", code, link.receiver_addr]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], PROC_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line.strip().isdigit():
        proc.kill()
        raise AssertionError(f"server did not start: {line!r} {proc.communicate()[1]}")
    return proc, int(line)


def _client(link, code: str, *args: object) -> str:
    argv = link.argv_in("sender", [*PY, "-c", code, link.receiver_addr, *map(str, args)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=PROC_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return done.stdout


def bulk_transfer(link, size_bytes: int) -> tuple[int, float]:
    """(bytes received, seconds) of one TCP transfer sender -> receiver."""
    sink, port = _server(link, SINK)
    _client(link, SOURCE, port, size_bytes)
    out, err = sink.communicate(timeout=PROC_TIMEOUT_S)
    assert sink.returncode == 0, err
    result = json.loads(out)
    return result["bytes"], result["seconds"]


def round_trips_s(link, n: int) -> list[float]:
    echo, port = _server(link, ECHO)
    rtts = json.loads(_client(link, PINGER, port, n))
    echo.communicate(timeout=PROC_TIMEOUT_S)
    return rtts


def _netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=10, check=True).stdout


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                          timeout=10, check=True).stdout


def assert_removed(tag: str) -> None:
    assert tag not in _netns_list()
    assert tag not in _root_links()


def unique_prefix() -> str:
    """'kvsz' + 4 random letters: disjoint from the default 'kvs' pattern ('z' is not hex)
    and from parallel test runs, so cleanup() here never touches anyone else's links."""
    return "kvsz" + "".join(secrets.choice(string.ascii_lowercase) for _ in range(4))


@pytest.fixture
def need_netns() -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)


@pytest.fixture
def need_netem(need_netns) -> None:
    ok, why = netem_available()
    if not ok:
        pytest.skip(why)


# --- everywhere: specs, names, tc command lines ----------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"rate_gbps": 0}, "rate_gbps"),
    ({"rate_gbps": -1.0}, "rate_gbps"),
    ({"rate_gbps": math.nan}, "rate_gbps"),
    ({"rate_gbps": math.inf}, "rate_gbps"),
    ({"rate_gbps": True}, "rate_gbps"),
    ({"rate_gbps": "1"}, "rate_gbps"),
    ({"rate_gbps": 1, "delay_ms": -1}, "delay_ms"),
    ({"rate_gbps": 1, "delay_ms": math.nan}, "delay_ms"),
    ({"rate_gbps": 1, "delay_ms": 1, "jitter_ms": 2}, "jitter_ms"),
    ({"rate_gbps": 1, "loss_pct": -0.1}, "loss_pct"),
    ({"rate_gbps": 1, "loss_pct": 100.5}, "loss_pct"),
    ({"rate_gbps": 1, "loss_pct": math.nan}, "loss_pct"),
    ({"rate_gbps": 1, "burst_bytes": 1000}, "burst_bytes"),
    ({"rate_gbps": 1, "burst_bytes": 2.5e5}, "burst_bytes"),
    ({"rate_gbps": 1, "limit_bytes": 2**32}, "limit_bytes"),
])
def test_bad_spec_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NetemSpec(**kwargs)


def test_default_burst_and_limit():
    slow = NetemSpec(rate_gbps=0.1)  # 12.5e6 B/s: 1 ms = 12.5 kB < one GSO packet
    assert slow.tbf_burst_bytes == GSO_QDISC_BYTES
    assert slow.tbf_limit_bytes == 4 * GSO_QDISC_BYTES  # 4 bursts > 20 ms at 12.5e6 B/s = 250 kB
    # a whole 64 KiB TSO packet as tbf counts it: 46 segments of at most 1448 payload bytes,
    # each with its 66 header bytes; 0.5 Gbps x 1 ms = 62.5 kB would not hold it
    assert GSO_QDISC_BYTES == 65536 + 46 * 66
    assert NetemSpec(rate_gbps=0.5).tbf_burst_bytes == GSO_QDISC_BYTES
    assert NetemSpec(rate_gbps=0.6).tbf_burst_bytes == 75_000  # 1 ms, above the floor
    fast = NetemSpec(rate_gbps=100)  # 12.5e9 B/s
    assert fast.tbf_burst_bytes == 12_500_000  # 1 ms
    assert fast.tbf_limit_bytes == 250_000_000  # 20 ms, under the 256 MiB cap
    assert NetemSpec(rate_gbps=400).tbf_limit_bytes == 256 * 2**20
    given = NetemSpec(rate_gbps=1, burst_bytes=3000, limit_bytes=9000)
    assert (given.tbf_burst_bytes, given.tbf_limit_bytes) == (3000, 9000)
    # 1 Gbps x 30 ms = 3.75 MB, x2 / 1500 B = 5000 packets held by netem
    assert NetemSpec(rate_gbps=1, delay_ms=20, jitter_ms=10).netem_limit_packets == 5000
    assert NetemSpec(rate_gbps=0.1, delay_ms=1).netem_limit_packets == 1000


def test_tags_names_and_addresses():
    tag = make_tag()
    assert tag.startswith(DEFAULT_PREFIX) and len(tag) == len(DEFAULT_PREFIX) + 6
    assert make_tag() != tag
    link = new_link(NetemSpec(rate_gbps=1), "abcdefgh123456")  # longest tag: 8 + 6 chars
    assert max(len(link.sender_ns), len(link.receiver_ns)) == 15  # IFNAMSIZ - 1
    assert link.argv_in("sender", ["true"]) == ["ip", "netns", "exec", link.sender_ns, "true"]
    assert link.argv_in("receiver", ["true"])[3] == link.receiver_ns
    with pytest.raises(ValueError, match="side"):
        link.argv_in("middle", ["true"])
    for bad in ("KVS123456", "kvs12345", "kvs12345g", "abcdefghi123456", "", "kv-123456"):
        with pytest.raises(ValueError, match="tag"):
            link_addresses(bad)
    with pytest.raises(ValueError, match="prefix"):
        make_tag("kvs1")
    seen = set()
    for hex_part in ("000000", "00003f", "000040", "ffffff", "3f7f00"):
        s, r = link_addresses("kvs" + hex_part)
        s4, r4 = ([int(x) for x in a.split(".")] for a in (s, r))
        assert s4[:3] == r4[:3] and s4[:2] == [169, 254] and 1 <= s4[2] <= 254
        assert s4[3] % 4 == 1 and r4[3] == s4[3] + 1  # host addresses 1 and 2 of a /30
        seen.add(s)
    assert len(seen) == 5


def test_tc_commands_shape_forward_and_optionally_acks():
    only_rate = tc_commands(new_link(NetemSpec(rate_gbps=0.1), "kvs000001"))
    assert only_rate == [["tc", "-netns", "kvs000001s", "qdisc", "add", "dev", "kvs000001s",
                          "root", "handle", "1:", "tbf", "rate", "100000000bit",
                          "burst", "68572", "limit", "274288"]]
    spec = NetemSpec(rate_gbps=1, delay_ms=20, jitter_ms=1.5, loss_pct=0.1)
    # netem limit: 2 x 125e6 B/s x 21.5 ms / 1500 B = 3583.3 -> 3584 packets
    fwd = ["tc", "-netns", "kvs000001s", "qdisc", "add", "dev", "kvs000001s"]
    assert tc_commands(new_link(spec, "kvs000001")) == [
        [*fwd, "root", "handle", "1:", "netem", "limit", "3584", "delay", "20000us", "1500us",
         "loss", "random", "0.1%"],
        [*fwd, "parent", "1:1", "handle", "10:", "tbf", "rate", "1000000000bit",
         "burst", "125000", "limit", "2500000"],
        ["tc", "-netns", "kvs000001r", "qdisc", "add", "dev", "kvs000001r", "root", "handle",
         "1:", "netem", "limit", "3584", "delay", "20000us"],
    ]
    one_way = NetemSpec(rate_gbps=1, delay_ms=20, symmetric_delay=False)
    assert [c[2] for c in tc_commands(new_link(one_way, "kvs000001"))] == ["kvs000001s"] * 2
    loss_only = NetemSpec(rate_gbps=1, loss_pct=1)  # no delay: nothing on the ack side
    cmds = tc_commands(new_link(loss_only, "kvs000001"))
    assert len(cmds) == 2 and cmds[1][7:9] == ["parent", "1:1"]
    assert cmds[0][7:] == ["root", "handle", "1:", "netem", "limit", "1000", "delay", "0us",
                           "loss", "random", "1%"]


def test_not_root_is_reported_not_raised(monkeypatch):
    from kvsim.transport import netns

    netns._probe.cache_clear()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    try:
        ok, why = netns_available()
        assert not ok and "not root" in why
        assert netem_available() == (False, why)
    finally:
        netns._probe.cache_clear()  # the next caller probes the real machine


# --- net: real namespaces -----------------------------------------------------------------


@pytest.mark.net
def test_link_carries_tcp_and_is_removed_after_normal_exit(need_netns):
    prefix = unique_prefix()
    with shaped_link(NetemSpec(rate_gbps=1.0), tag=make_tag(prefix)) as link:
        assert {link.sender_ns, link.receiver_ns} <= set(_netns_list().split())
        assert link.tag not in _root_links()  # the veth ends live only inside the namespaces
        qdisc = subprocess.run(["tc", "-netns", link.sender_ns, "qdisc", "show", "dev",
                                link.sender_dev], capture_output=True, text=True, timeout=10)
        assert "tbf 1: root" in qdisc.stdout and "rate 1Gbit" in qdisc.stdout
        assert bulk_transfer(link, 100_000)[0] == 100_000
        me = os.getpid()
        assert leftovers(prefix) == [Leftover(link.receiver_ns, me, True),
                                     Leftover(link.sender_ns, me, True)]
        assert cleanup(prefix) == []  # a link whose owner is alive is not a leftover
        assert {link.sender_ns, link.receiver_ns} <= set(_netns_list().split())
    assert_removed(link.tag)


@pytest.mark.net
def test_tbf_goodput_matches_rate(need_netns):
    """12 MB at 0.1 Gbps should take 8 * 12e6 / 1e8 = 0.96 s of IP bytes. TCP goodput tops
    out at 1448 / 1500 = 96.5 % of the tbf rate (IP + TCP + timestamp headers are 52 of
    each 1500 bytes); the 64 KiB initial bucket adds 0.5 %; start-up and Python costs are a
    few ms at 12.5 MB/s (measured: 96.1 %). So 85-98 %: a shaper 2 % fast or 12 % slow
    fails, and a missing or wrong-unit one (1 Gbps, 10 Mbps) lands far outside."""
    size_bytes = 12_000_000
    with shaped_link(NetemSpec(rate_gbps=0.1)) as link:
        got, seconds = bulk_transfer(link, size_bytes)
    assert got == size_bytes
    goodput_ratio = 8 * got / seconds / 0.1e9
    assert 0.85 <= goodput_ratio <= 0.98, f"{goodput_ratio:.3f} of 0.1 Gbps in {seconds:.3f} s"


def _qdiscs(ns: str, dev: str) -> str:
    return subprocess.run(["tc", "-netns", ns, "qdisc", "show", "dev", dev],
                          capture_output=True, text=True, timeout=10, check=True).stdout


@pytest.mark.net
def test_reshaped_link_carries_the_new_rate(need_netns):
    """One pair of namespaces, reshaped from 0.1 to 0.3 Gbps: same namespaces and addresses,
    one tbf at the new rate, and a transfer takes the new rate (8 MB at 0.3 Gbps: 0.22 s;
    at the first rate it would take 0.67 s)."""
    with shaped_link(NetemSpec(rate_gbps=0.1)) as link:
        faster = reshaped(link, NetemSpec(rate_gbps=0.3))
        assert (faster.sender_ns, faster.receiver_ns, faster.receiver_addr) == \
            (link.sender_ns, link.receiver_ns, link.receiver_addr)
        assert link.spec.rate_gbps == 0.1  # a new link value; the old one is unchanged
        sent = _qdiscs(link.sender_ns, link.sender_dev)
        assert sent.count("qdisc ") == 1 and "tbf 1: root" in sent and "rate 300Mbit" in sent
        got, seconds = bulk_transfer(faster, 8_000_000)
    assert got == 8_000_000
    assert 0.85 <= 8 * got / seconds / 0.3e9 <= 0.98, seconds
    assert_removed(link.tag)
    with pytest.raises(ValueError, match="NetemSpec"):
        reshaped(link, 0.3)


@pytest.mark.net
def test_reshaped_link_gains_and_loses_its_delay(need_netem):
    """From tbf alone to 20 ms each way (netem on both ends, tbf under the sender's), to 30 ms
    at another rate (in place), and back: each shape's qdiscs are the only ones, and the
    round trip follows."""
    with shaped_link(NetemSpec(rate_gbps=1.0)) as link:
        delayed = reshaped(link, NetemSpec(rate_gbps=1.0, delay_ms=20.0))
        sent = _qdiscs(link.sender_ns, link.sender_dev)
        assert "netem 1: root" in sent and "delay 20ms" in sent and "rate 1Gbit" in sent
        assert "netem 1: root" in _qdiscs(link.receiver_ns, link.receiver_dev)
        assert 0.040 <= min(round_trips_s(delayed, 5)) <= 0.048
        longer = reshaped(delayed, NetemSpec(rate_gbps=0.5, delay_ms=30.0))  # in place
        sent = _qdiscs(link.sender_ns, link.sender_dev)
        assert "delay 30ms" in sent and "rate 500Mbit" in sent and sent.count("qdisc ") == 2
        assert 0.060 <= min(round_trips_s(longer, 5)) <= 0.068
        plain = reshaped(longer, NetemSpec(rate_gbps=1.0))
        assert "netem" not in _qdiscs(link.sender_ns, link.sender_dev)
        assert "netem" not in _qdiscs(link.receiver_ns, link.receiver_dev)
        assert min(round_trips_s(plain, 5)) < 0.010


@pytest.mark.net
def test_call_in_netns_sends_from_the_namespace_and_hands_back_result_and_errors(need_netns):
    """A socket opened by a function called in the sender's namespace reaches the receiver's
    address (unreachable from this thread's namespace) and its result comes back; this
    thread stays where it was; an exception inside is raised here; a call that outlives its
    timeout is a TimeoutError."""
    import socket
    import threading
    import time

    def here() -> str:
        return os.readlink(f"/proc/self/task/{threading.get_native_id()}/ns/net")

    before = here()
    with shaped_link(NetemSpec(rate_gbps=1.0)) as link:
        sink, port = _server(link, SINK)

        def send() -> str:
            with socket.create_connection((link.receiver_addr, port), timeout=10) as s:
                s.sendall(b"x" * 1000)
            return here()

        inside = call_in_netns(link.sender_ns, send, timeout_s=30)
        out, _ = sink.communicate(timeout=PROC_TIMEOUT_S)
        assert json.loads(out)["bytes"] == 1000
        assert inside != before and here() == before
        with pytest.raises(ZeroDivisionError):
            call_in_netns(link.sender_ns, lambda: 1 / 0, timeout_s=30)
        with pytest.raises(TimeoutError, match="within 0.2 s"):
            call_in_netns(link.sender_ns, lambda: time.sleep(2), timeout_s=0.2)
        with pytest.raises(NetnsError, match="No such file"):
            call_in_netns(link.tag + "x", lambda: None, timeout_s=30)
        with socket.socket() as s:  # the receiver's address is not reachable from here
            s.settimeout(1)
            assert s.connect_ex((link.receiver_addr, port)) != 0


@pytest.mark.net
def test_netem_delay_shows_in_round_trip(need_netem):
    """20 ms each way (symmetric_delay): a one-byte TCP round trip takes 40 ms plus
    microseconds; the minimum of 10 round trips is robust to a scheduling hiccup."""
    with shaped_link(NetemSpec(rate_gbps=1.0, delay_ms=20.0)) as link:
        rtt_s = min(round_trips_s(link, 10))
    assert 0.040 <= rtt_s <= 0.048, rtt_s
    with shaped_link(NetemSpec(rate_gbps=1.0, delay_ms=20.0, symmetric_delay=False)) as link:
        rtt_s = min(round_trips_s(link, 10))
    assert 0.020 <= rtt_s <= 0.028, rtt_s


@pytest.mark.net
def test_delay_refused_without_netem(need_netns):
    ok, _ = netem_available()
    if ok:
        pytest.skip("this kernel has netem; the refusal path cannot be taken")
    tag = make_tag(unique_prefix())
    with pytest.raises(NetnsError, match="netem"):
        with shaped_link(NetemSpec(rate_gbps=1.0, delay_ms=5.0), tag=tag):
            pass
    assert_removed(tag)


@pytest.mark.net
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_removed_after_exception_with_process_inside(need_netns, error):
    with pytest.raises(error, match="boom"):
        with shaped_link(NetemSpec(rate_gbps=1.0)) as link:
            sleeper = subprocess.Popen(link.argv_in("receiver", ["sleep", "30"]))
            raise error("boom")
    assert sleeper.wait(timeout=5) == -signal.SIGKILL  # killed so the namespace can go
    assert_removed(link.tag)


@pytest.mark.net
def test_tag_in_use_fails_without_touching_the_other_link(need_netns):
    tag = make_tag(unique_prefix())
    with shaped_link(NetemSpec(rate_gbps=1.0), tag=tag) as first:
        with pytest.raises(NetnsError, match=f"ip netns add {first.sender_ns}"):
            with shaped_link(NetemSpec(rate_gbps=0.5), tag=tag):
                pass
        assert bulk_transfer(first, 10_000)[0] == 10_000  # still there and working
    assert_removed(tag)


@pytest.mark.net
def test_sigterm_inside_unwinds_and_removes(need_netns):
    code = textwrap.dedent("""
        import os, signal, sys, time
        from kvsim.transport.netns import NetemSpec, shaped_link
        before = signal.getsignal(signal.SIGTERM)
        try:
            with shaped_link(NetemSpec(rate_gbps=1.0)) as link:
                print(link.tag, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
        finally:
            print("restored" if signal.getsignal(signal.SIGTERM) is before else "leaked",
                  flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=PROC_TIMEOUT_S)
    tag, restored = done.stdout.split()
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert restored == "restored"
    assert_removed(tag)


@pytest.mark.net
def test_cleanup_removes_a_leaked_namespace_only(need_netns):
    prefix = unique_prefix()
    leaked, other = make_tag(prefix) + "s", prefix + "xyz"  # `other` lacks the hex part
    for ns in (leaked, other):
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    try:
        assert leftovers(prefix) == [Leftover(leaked, None, False)]
        assert cleanup(prefix) == [leaked]
        assert leaked not in _netns_list() and other in _netns_list()
        with shaped_link(NetemSpec(rate_gbps=1.0), tag=make_tag(prefix)) as link:
            assert cleanup(prefix, force=True) == [link.receiver_ns, link.sender_ns]
    finally:
        subprocess.run(["ip", "netns", "del", other], check=True, timeout=10)
    assert_removed(prefix)


@pytest.mark.net
def test_net_cleanup_command(need_netns, capsys):
    from kvsim.cli.main import main

    prefix = unique_prefix()
    leaked = make_tag(prefix) + "r"
    subprocess.run(["ip", "netns", "add", leaked], check=True, timeout=10)
    try:
        assert main(["net", "cleanup", f"prefix={prefix}", "dry_run=true"]) == 0
        assert leaked in capsys.readouterr().out and leaked in _netns_list()
        assert main(["net", "cleanup", f"prefix={prefix}"]) == 0
        assert leaked in capsys.readouterr().out
        assert_removed(leaked)
        assert main(["net", "cleanup", f"prefix={prefix}"]) == 0
        assert "nothing to remove" in capsys.readouterr().out
    finally:
        cleanup(prefix)
