"""CURVE authentication of the transport (kvsim.transport.auth) on real ZeroMQ sockets over
loopback: a ROUTER made by secure_server, DEALERs as the senders. Every receive is a poll
with a timeout; a refused peer shows as nothing arriving within it."""

from __future__ import annotations

import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from zmq.auth import load_certificate

from kvsim.cli.main import main
from kvsim.transport.auth import (
    is_loopback,
    peer_key,
    secure_client,
    secure_server,
    stop_auth,
    write_keys,
)

LOOPBACK = "tcp://127.0.0.1:*"  # a free port on loopback
ARRIVES_MS = 5000  # what must arrive arrives within this
SILENT_MS = 1000  # what must not arrive: nothing within this


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    write_keys(directory)
    return directory


def public_of(path: Path) -> str:
    return load_certificate(path)[0].decode()


@contextmanager
def router(keys: Path | str, endpoint: str = LOOPBACK,
           insecure: bool = False) -> Iterator[tuple[zmq.Socket, str]]:
    """A ROUTER as kvsim serve makes it: secure_server before bind. Yields (socket, bound
    endpoint)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    authenticator = None
    try:
        authenticator = secure_server(ctx, sock, str(keys), insecure, endpoint, print)
        sock.bind(endpoint)
        yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        sock.close(0)
        stop_auth(authenticator)
        ctx.term()


@contextmanager
def dealer(endpoint: str, keys: Path | str = "") -> Iterator[zmq.Socket]:
    """A DEALER in its own context (another process, as kvsim send), CURVE when keys."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = ARRIVES_MS
    try:
        assert secure_client(sock, str(keys), False, endpoint, print) == bool(keys)
        sock.connect(endpoint)
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def received(sock: zmq.Socket, timeout_ms: int) -> list[zmq.Frame] | None:
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    return sock.recv_multipart(copy=False)


def round_trip(server: zmq.Socket, client: zmq.Socket) -> str:
    """client -> server -> client; returns the peer_key the server saw."""
    client.send(b"hello")
    frames = received(server, ARRIVES_MS)
    assert frames is not None, "the server got nothing"
    routing_id, body = frames
    assert body.bytes == b"hello"
    server.send_multipart([routing_id.bytes, b"welcome"])
    reply = received(client, ARRIVES_MS)
    assert reply is not None and reply[0].bytes == b"welcome"
    return peer_key(body)


def test_an_allowed_client_round_trips_and_is_named_by_its_key(keys):
    with router(keys) as (server, endpoint), dealer(endpoint, keys) as client:
        key = round_trip(server, client)
    assert key == public_of(keys / "client.key")
    assert len(key) == 40  # z85 of a 32-byte Curve25519 key


def test_curve_over_ipc(keys, tmp_path):
    endpoint = f"ipc://{tmp_path / 'serve.sock'}"
    with router(keys, endpoint) as (server, bound), dealer(bound, keys) as client:
        assert round_trip(server, client) == public_of(keys / "client.key")


def test_a_client_whose_key_is_not_allowed_gets_nothing_through(keys, tmp_path):
    stranger = tmp_path / "stranger"
    write_keys(stranger)  # its own pair, unknown to the server's allowed/
    (stranger / "server.key").unlink()
    shutil.copy(keys / "server.key", stranger / "server.key")  # it knows the real server
    with router(keys) as (server, endpoint):
        with dealer(endpoint, stranger) as client:
            client.send(b"let me in", flags=zmq.NOBLOCK)
            assert received(server, SILENT_MS) is None
            assert not client.poll(100, zmq.POLLIN)
        with dealer(endpoint, keys) as allowed:  # the server still serves the allowed key
            assert round_trip(server, allowed) == public_of(keys / "client.key")


def test_a_client_without_curve_gets_nothing_through(keys):
    with router(keys) as (server, endpoint), dealer(endpoint) as plain:
        plain.send(b"plain text", flags=zmq.NOBLOCK)
        assert received(server, SILENT_MS) is None


def test_a_client_with_the_wrong_server_key_gets_nothing_through(keys, tmp_path):
    impostor = tmp_path / "impostor"  # the allowed client pair, another server's public key
    write_keys(impostor)
    shutil.copy(keys / "client.key_secret", impostor / "client.key_secret")
    with router(keys) as (server, endpoint), dealer(endpoint, impostor) as client:
        client.send(b"hello", flags=zmq.NOBLOCK)
        assert received(server, SILENT_MS) is None


def test_two_hosts_copy_only_what_they_need(keys, tmp_path):
    """The decode host holds server.key_secret + allowed/, the prefill host a client pair
    of another name (`kvsim keys client=prefill2`) + server.key."""
    write_keys(keys, client="prefill2")
    decode_host, prefill_host = tmp_path / "decode", tmp_path / "prefill"
    decode_host.mkdir()
    prefill_host.mkdir()
    shutil.copy(keys / "server.key_secret", decode_host)
    shutil.copytree(keys / "allowed", decode_host / "allowed")
    shutil.copy(keys / "prefill2.key_secret", prefill_host)
    shutil.copy(keys / "server.key", prefill_host)
    with router(decode_host) as (server, endpoint), dealer(endpoint, prefill_host) as client:
        assert round_trip(server, client) == public_of(keys / "prefill2.key")


def test_without_curve_the_peer_key_is_empty():
    with router("") as (server, endpoint), dealer(endpoint) as client:
        assert round_trip(server, client) == ""
    assert peer_key(b"not a frame") == ""


@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5557", True), ("tcp://127.1.2.3:5557", True),
    ("tcp://localhost:5557", True), ("tcp://[::1]:5557", True),
    ("tcp://[::ffff:127.0.0.1]:5557", True), ("ipc:///tmp/kvsim.sock", True),
    ("inproc://kvsim", True), ("tcp://127.0.0.1:*", True),
    ("tcp://*:5557", False), ("tcp://0.0.0.0:5557", False), ("tcp://[::]:5557", False),
    ("tcp://10.0.0.2:5557", False), ("tcp://169.254.1.2:5557", False),
    ("tcp://decode-host:5557", False), ("tcp://eth0:5557", False),
    ("tcp://127.0.0.1:0;10.0.0.2:5557", False), ("tcp://10.0.0.1:0;127.0.0.1:5557", True),
    ("udp://127.0.0.1:5557", False), ("127.0.0.1:5557", False),
])
def test_is_loopback(endpoint, loopback):
    assert is_loopback(endpoint) is loopback


@pytest.mark.parametrize("side", ["server", "client"])
def test_no_keys_beyond_loopback_needs_insecure(side):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if side == "server" else zmq.DEALER)

    def secure(endpoint: str, insecure: bool, log) -> object:
        if side == "server":
            return secure_server(ctx, sock, "", insecure, endpoint, log)
        return secure_client(sock, "", insecure, endpoint, log)

    try:
        with pytest.raises(ValueError, match=r"without authentication.*kvsim keys "
                           r"dir=DIR.*transport.insecure=true"):
            secure("tcp://0.0.0.0:5557", False, print)
        said: list[str] = []
        assert not secure("tcp://10.0.0.2:5557", True, said.append)
        assert len(said) == 1 and "warning" in said[0] and "10.0.0.2" in said[0]
        said.clear()
        assert not secure("tcp://127.0.0.1:5557", False, said.append)
        assert not said
    finally:
        sock.close(0)
        ctx.term()


def test_missing_key_files_are_named_with_how_to_make_them(keys, tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(ValueError, match=rf"server.key_secret.*kvsim keys dir={empty}"):
            secure_server(ctx, sock, str(empty), False, LOOPBACK, print)
        with pytest.raises(ValueError, match=rf"client.key_secret.*kvsim keys dir={empty}"):
            secure_client(sock, str(empty), False, LOOPBACK, print)
        shutil.copy(keys / "server.key_secret", empty)
        with pytest.raises(ValueError, match=r"allowed/"):
            secure_server(ctx, sock, str(empty), False, LOOPBACK, print)
        (empty / "allowed").mkdir()
        with pytest.raises(ValueError, match=r"no client key"):
            secure_server(ctx, sock, str(empty), False, LOOPBACK, print)
        shutil.copy(keys / "client.key_secret", empty)
        with pytest.raises(ValueError, match=r"no server.key in"):
            secure_client(sock, str(empty), False, LOOPBACK, print)
        shutil.copy(keys / "client.key", empty / "server.key_secret")  # a public key misnamed
        (empty / "allowed" / "client.key").write_text(
            (keys / "client.key").read_text())
        with pytest.raises(ValueError, match=r"holds no secret key"):
            secure_server(ctx, sock, str(empty), False, LOOPBACK, print)
    finally:
        sock.close(0)
        ctx.term()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_keys_modes_and_refusals(tmp_path):
    directory = tmp_path / "a" / "keys"
    written = write_keys(directory)
    assert set(written) == {"server.key", "server.key_secret", "client.key",
                            "client.key_secret", "allowed/client.key"}
    assert all(path == directory / name for name, path in written.items())
    assert mode(directory) == 0o700
    assert mode(directory / "server.key_secret") == mode(directory / "client.key_secret") == 0o600
    assert mode(directory / "server.key") == mode(directory / "client.key") == 0o644
    assert public_of(directory / "allowed" / "client.key") == public_of(directory / "client.key")
    assert sorted(p.name for p in directory.iterdir()) == [  # no temporary directory left
        "allowed", "client.key", "client.key_secret", "server.key", "server.key_secret"]

    server, client = public_of(directory / "server.key"), public_of(directory / "client.key")
    with pytest.raises(ValueError, match="refusing to replace"):
        write_keys(directory)
    assert public_of(directory / "client.key") == client
    again = write_keys(directory, force=True)  # a new client pair; the server pair is kept
    assert set(again) == {"client.key", "client.key_secret", "allowed/client.key"}
    assert public_of(directory / "server.key") == server
    assert public_of(directory / "client.key") != client
    assert public_of(directory / "allowed" / "client.key") == public_of(directory / "client.key")

    assert set(write_keys(directory, client="prefill2")) == {
        "prefill2.key", "prefill2.key_secret", "allowed/prefill2.key"}
    assert sorted(p.name for p in (directory / "allowed").iterdir()) == [
        "client.key", "prefill2.key"]
    for bad in ("server", "../up", ".hidden", "a/b", ""):
        with pytest.raises(ValueError, match="client name"):
            write_keys(directory, client=bad)

    prefill_copy = tmp_path / "prefill"  # a prefill host's copy: server.key, no secret
    prefill_copy.mkdir()
    shutil.copy(directory / "server.key", prefill_copy)
    with pytest.raises(ValueError, match="without server.key_secret"):
        write_keys(prefill_copy, client="other")


def test_kvsim_keys_command(tmp_path, capsys):
    directory = tmp_path / "keys"
    assert main(["keys", f"dir={directory}"]) == 0
    out = capsys.readouterr().out
    assert f"transport.keys={directory}" in out and "allowed/client.key" in out
    assert mode(directory / "client.key_secret") == 0o600
    assert main(["keys", f"dir={directory}"]) == 1
    assert "refusing to replace" in capsys.readouterr().err
    assert main(["keys", f"dir={directory}", "client=host2"]) == 0
    assert (directory / "allowed" / "host2.key").is_file()
    assert main(["keys", f"dir={directory}", "force=true"]) == 0
    assert main(["keys"]) == 2  # a usage error, before anything runs
    assert "needs dir=DIR" in capsys.readouterr().err
