"""CURVE authentication and encryption of the transport (ZeroMQ's own, through pyzmq's
`zmq.auth`: no cryptography here).

A keys directory (written by `kvsim keys dir=DIR`, `write_keys`):

    DIR/server.key          the decode host's public key      (the prefill hosts need it)
    DIR/server.key_secret   the decode host's key pair        (kvsim serve needs it)
    DIR/client.key          a prefill host's public key
    DIR/client.key_secret   a prefill host's key pair         (kvsim send needs it)
    DIR/allowed/*.key       the public keys kvsim serve admits (client.key is copied here)

`kvsim serve` reads server.key_secret and allowed/; `kvsim send` reads client.key_secret (or
the only other `<name>.key_secret` there) and server.key; `kvsim emulate` gives both ends
the same directory. Without keys (transport.keys=""), the transport is plain TCP, allowed
only on loopback (or ipc:// / inproc://) unless transport.insecure=true.

Use (the socket options must be set before bind / connect):

    authenticator = secure_server(ctx, router, keys, insecure, bind, log)  # before bind
    router.bind(bind)
    ...
    router.close(); stop_auth(authenticator); ctx.term()

    secure_client(dealer, keys, insecure, connect, log)                     # before connect

On the server, every message of an authenticated peer carries its identity: `peer_key(frame)`
is the client's public key (z85, 40 characters), "" without CURVE.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.auth import create_certificates, load_certificate, load_certificates
from zmq.auth.thread import ThreadAuthenticator

SERVER = "server"  # the decode host's pair: server.key / server.key_secret
CLIENT = "client"  # the default prefill host's pair: client.key / client.key_secret
ALLOWED_DIR = "allowed"  # the public keys kvsim serve admits
PUBLIC_SUFFIX = ".key"  # pyzmq's certificate names: <name>.key, <name>.key_secret
SECRET_SUFFIX = ".key_secret"
DIR_MODE = 0o700
SECRET_MODE = 0o600
PUBLIC_MODE = 0o644
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_LOOPBACK_NAMES = ("localhost", "localhost.")

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"kvsim: {msg}", file=sys.stderr)


def _make_hint(keys: str | Path) -> str:
    return f"make keys with `kvsim keys dir={keys}`"


# ---- where a socket listens / connects ---------------------------------------------------

def is_loopback(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint stays on this machine: tcp:// on 127.0.0.0/8, ::1 or
    localhost, ipc:// and inproc:// (true); tcp://* , 0.0.0.0, ::, any other host or interface
    name and every other transport (false). Host names are not resolved."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    address = rest.rsplit(";", 1)[-1]  # `tcp://source;peer:port`: where it goes is the peer
    host, colon, _port = address.rpartition(":")
    if not colon:
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # `*`, an interface name, a host name
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def _check_plain(role: str, verb: str, endpoint: str, insecure: bool, log: Log) -> None:
    """No keys: plain TCP is fine on loopback; elsewhere only with insecure=true (warned)."""
    if is_loopback(endpoint):
        return
    if not insecure:
        raise ValueError(f"kvsim {role} would {verb} {endpoint} without authentication: make "
                         "keys with `kvsim keys dir=DIR` and set transport.keys=DIR, or set "
                         "transport.insecure=true")
    log(f"warning: {verb} {endpoint} without authentication or encryption "
        "(transport.insecure=true): anyone who can reach it can read and send frames")


# ---- key files ---------------------------------------------------------------------------

def _load_key(path: Path, keys: str | Path, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys of a key file: a `<name>.key_secret` (secret=True: its
    secret half must be there) or a public `<name>.key`."""
    if not path.is_file():
        what = "the file" if secret else "the decode host's server.key"
        raise ValueError(f"no {path.name} in {keys} (looked for {path}): {_make_hint(keys)} "
                         f"and copy {what} here")
    try:
        public, secret_key = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a CURVE key file ({exc}): {_make_hint(keys)}") from exc
    if secret and not secret_key:
        raise ValueError(f"{path} holds no secret key (a public .key file copied under the "
                         f"secret's name?): {_make_hint(keys)}")
    return public, secret_key


def _client_secret_file(directory: Path, keys: str | Path) -> Path:
    """client.key_secret, else the only `<name>.key_secret` that is not the server's (a
    prefill host given `kvsim keys client=NAME`'s pair)."""
    default = directory / f"{CLIENT}{SECRET_SUFFIX}"
    if default.is_file():
        return default
    others = sorted(p for p in directory.glob(f"*{SECRET_SUFFIX}")
                    if p.name != f"{SERVER}{SECRET_SUFFIX}")
    if len(others) == 1:
        return others[0]
    if others:
        names = ", ".join(p.name for p in others)
        raise ValueError(f"{keys} holds several client key pairs ({names}) and no "
                         f"{default.name}: keep the one this host sends with, or name it "
                         f"{default.name}")
    raise ValueError(f"no {default.name} in {keys}: {_make_hint(keys)} and copy the client "
                     f"pair ({default.name}) and server.key here")


# ---- the two ends ------------------------------------------------------------------------

def secure_server(ctx: zmq.Context, sock: zmq.Socket, keys: str, insecure: bool, endpoint: str,
                  log: Log | None = None) -> ThreadAuthenticator | None:
    """Make `sock` (kvsim serve's ROUTER) a CURVE server that admits the clients whose public
    keys are in `<keys>/allowed/`, or check that plain TCP is allowed on `endpoint`. Call it
    before `sock.bind(endpoint)`.

    keys != "": starts pyzmq's ZAP authenticator on `ctx` (any IP address; one per context)
    and returns it: the caller stops it (`stop_auth`, or its `.stop()`) after closing `sock`.
    keys == "": None; raises ValueError where `endpoint` is not loopback unless `insecure`
    (then logs a warning). Missing or unreadable key files raise ValueError naming the file.
    """
    log = log or _stderr
    if not keys:
        _check_plain("serve", "listen on", endpoint, insecure, log)
        return None
    directory = Path(keys).expanduser()
    public, secret = _load_key(directory / f"{SERVER}{SECRET_SUFFIX}", keys, secret=True)
    allowed = directory / ALLOWED_DIR
    if not allowed.is_dir():
        raise ValueError(f"no {ALLOWED_DIR}/ in {keys} (the public keys of the clients to "
                         f"admit): {_make_hint(keys)} and copy its {ALLOWED_DIR}/ here")
    try:
        admitted = load_certificates(allowed)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{allowed} holds a file that is not a CURVE public key: {exc}") from exc
    if not admitted:
        raise ValueError(f"{allowed} holds no client key (*{PUBLIC_SUFFIX}): every sender would "
                         f"be refused; {_make_hint(keys)} (it puts the client's key there)")
    # pyzmq's ZAP handler in a thread; a refused key is logged (debug) on "zmq.auth"
    authenticator = ThreadAuthenticator(ctx)
    authenticator.start()  # binds inproc://zeromq.zap.01 in ctx: the handler libzmq asks
    try:
        authenticator.configure_curve(domain="*", location=str(allowed))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    except BaseException:
        authenticator.stop()
        raise
    return authenticator


def stop_auth(authenticator: ThreadAuthenticator | None) -> None:
    """Stop what `secure_server` started (None: nothing); after closing its socket."""
    if authenticator is not None:
        authenticator.stop()


def secure_client(sock: zmq.Socket, keys: str, insecure: bool, endpoint: str,
                  log: Log | None = None) -> bool:
    """Make `sock` (kvsim send's DEALER) a CURVE client of the server whose public key is
    `<keys>/server.key`, with the pair in `<keys>/client.key_secret` (or the only other
    `<name>.key_secret` there). Call it before `sock.connect(endpoint)`. Returns whether CURVE
    is on; keys == "": False, and raises ValueError where `endpoint` is not loopback unless
    `insecure` (then logs a warning)."""
    log = log or _stderr
    if not keys:
        _check_plain("send", "connect to", endpoint, insecure, log)
        return False
    directory = Path(keys).expanduser()
    public, secret = _load_key(_client_secret_file(directory, keys), keys, secret=True)
    server_public, _ = _load_key(directory / f"{SERVER}{PUBLIC_SUFFIX}", keys, secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public
    return True


def peer_key(frame: zmq.Frame | bytes) -> str:
    """The authenticated identity of the peer that sent `frame` (a frame of a message the
    server received with copy=False; not the ROUTER's routing-id frame, which libzmq makes
    itself): libzmq's "User-Id" message property, which is the user id the ZAP handler
    returned. With pyzmq's authenticator and CURVE that is the client's public key, z85
    (40 characters, as in its `.key` file). "" when there is none: no CURVE / no ZAP handler
    (libzmq then has no User-Id and pyzmq raises ZMQError EINVAL) or a `bytes` frame."""
    if not isinstance(frame, zmq.Frame):
        return ""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:
        return ""


# ---- making keys -------------------------------------------------------------------------

def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name) or name == SERVER:
        raise ValueError(f"client name must be letters, digits, '_', '.', '-', start with a "
                         f"letter or digit, be at most 64 long and not {SERVER!r}, got {name!r}")


def _install(src: Path, dst: Path, mode: int) -> None:
    os.chmod(src, mode)
    os.replace(src, dst)  # same directory tree: atomic; never a half-written key file


def write_keys(directory: Path, client: str = CLIENT, force: bool = False) -> dict[str, Path]:
    """Write a keys directory (`kvsim keys`): the server pair if absent, the `client` pair
    (`<client>.key`, `<client>.key_secret`), and a copy of the client's public key in
    allowed/. Refuses (ValueError) to replace an existing client pair, or a server.key that
    has no server.key_secret beside it (a prefill host's copy), unless `force`; an existing
    server pair is kept (so several clients share it), and force replaces only the client
    pair. The directory is made with mode 0700, secret files 0600, public ones 0644; a new
    file appears whole (written in a private temporary directory, then renamed).

    Returns the files written: {name relative to `directory` (e.g. "allowed/client.key"):
    path}."""
    _check_name(client)
    directory = Path(directory).expanduser()
    if not directory.exists():
        directory.mkdir(mode=DIR_MODE, parents=True)
        os.chmod(directory, DIR_MODE)  # mkdir's mode is masked by the umask
    elif not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a directory")
    allowed = directory / ALLOWED_DIR
    if not allowed.exists():
        allowed.mkdir(mode=DIR_MODE)
        os.chmod(allowed, DIR_MODE)
    server_public = directory / f"{SERVER}{PUBLIC_SUFFIX}"
    server_secret = directory / f"{SERVER}{SECRET_SUFFIX}"
    client_public = directory / f"{client}{PUBLIC_SUFFIX}"
    client_secret = directory / f"{client}{SECRET_SUFFIX}"
    existing = [p.name for p in (client_public, client_secret) if p.exists()]
    if existing and not force:
        raise ValueError(f"{directory} already holds {' and '.join(existing)}: refusing to "
                         f"replace a key pair (force=true replaces it; senders using the old "
                         f"pair are then refused), or choose another client=NAME")
    if server_public.exists() and not server_secret.exists() and not force:
        raise ValueError(f"{directory} holds {server_public.name} without "
                         f"{server_secret.name} (a prefill host's copy?): refusing to make a "
                         f"new server pair over it (force=true does)")
    written: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix=".kvsim-keys-", dir=directory) as tmp_name:
        tmp = Path(tmp_name)  # mode 0700: nobody else reads a key before its mode is set
        if server_secret.exists():
            if not server_public.exists():  # a decode host's copy: its public half again
                public, _secret = _load_key(server_secret, directory, secret=True)
                (tmp / server_public.name).write_text(
                    f'metadata\ncurve\n    public-key = "{public.decode()}"\n')
                _install(tmp / server_public.name, server_public, PUBLIC_MODE)
                written[server_public.name] = server_public
        else:
            made_public, made_secret = create_certificates(tmp, SERVER)
            _install(Path(made_secret), server_secret, SECRET_MODE)
            _install(Path(made_public), server_public, PUBLIC_MODE)
            written[server_secret.name] = server_secret
            written[server_public.name] = server_public
        made_public, made_secret = create_certificates(tmp, client)
        _install(Path(made_secret), client_secret, SECRET_MODE)
        admitted = allowed / client_public.name
        shutil.copyfile(made_public, tmp / "allowed.key")
        _install(Path(made_public), client_public, PUBLIC_MODE)
        _install(tmp / "allowed.key", admitted, PUBLIC_MODE)
        written[client_secret.name] = client_secret
        written[client_public.name] = client_public
        written[f"{ALLOWED_DIR}/{admitted.name}"] = admitted
    return written
