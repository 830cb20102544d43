"""Two-host link emulation on one machine: two network namespaces joined by a veth pair,
shaped with `tc`. One context manager builds the link and always removes it.

    with shaped_link(NetemSpec(rate_gbps=1.0, delay_ms=5.0)) as link:
        server = subprocess.Popen(link.argv_in("receiver", ["python", "serve.py"]))
        subprocess.run(link.argv_in("sender", ["python", "send.py", link.receiver_addr]),
                       timeout=60)

Topology (names are the tag plus one role letter, e.g. tag 'kvs1a2b3c'):

    netns kvs1a2b3cs                                        netns kvs1a2b3cr
    [veth kvs1a2b3cs 169.254.X.Y+1/30] ====== [veth kvs1a2b3cr 169.254.X.Y+2/30]
      egress (data):  netem (delay, jitter, loss) -> tbf (rate)
                                              egress (acks): netem delay only, when
                                              spec.symmetric_delay; otherwise unshaped

The veth ends are created directly inside their namespaces, so nothing is ever added to
the root namespace; deleting the two namespaces removes the veth pair with them. Every
name contains the tag, so `cleanup()` (`kvsim net cleanup`) finds what a run killed with
SIGKILL left behind; each veth end carries its owner's pid as interface alias, so cleanup
leaves links whose owner still runs. Without netem (delay_ms = jitter_ms = loss_pct = 0)
only tbf is installed, so the link works on kernels built without sch_netem. Needs root
(CAP_SYS_ADMIN for `ip netns`, CAP_NET_ADMIN for `tc`) and a kernel with veth and sch_tbf.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

T = TypeVar("T")

DEFAULT_PREFIX = "kvs"
TAG_HEX_CHARS = 6  # random part of a tag: 24 bits
MAX_PREFIX_CHARS = 8  # prefix + 6 hex + 1 role letter <= 15 chars (IFNAMSIZ - 1)
ROLE_LETTERS = "srp"  # sender ns / receiver ns / capability probe ns
CMD_TIMEOUT_S = 10.0  # one `ip` / `tc` invocation; they take ~5 ms when the box is healthy
MTU_BYTES = 1500  # veth default MTU
GSO_MAX_BYTES = 65536  # largest TSO/GSO skb a veth hands to its qdisc (gso_max_size)
# tbf measures a GSO skb as the packets it will become: its bytes plus every further
# segment's copy of the L2/IP/TCP headers (qdisc_pkt_len_init). A 64 KiB skb at a 1500-byte
# MTU is up to 46 segments of 14 + 20 + 32 header bytes: 68,572 bytes to tbf. A bucket
# smaller than that makes tbf cut every such skb into MTU-sized packets (tbf_segment)
GSO_SEGMENT_HEADER_BYTES = 14 + 20 + 32  # Ethernet + IPv4 + TCP with timestamps
GSO_QDISC_BYTES = GSO_MAX_BYTES + math.ceil(
    GSO_MAX_BYTES / (MTU_BYTES - 20 - 32)) * GSO_SEGMENT_HEADER_BYTES
ADDR_PREFIX_LEN = 30  # one /30 per link: network, sender, receiver, broadcast
TBF_U32_MAX = 2**32 - 1  # tbf burst and limit are 32-bit byte counts in the kernel
DEFAULT_LIMIT_CAP_BYTES = 256 * 2**20  # cap on the default tbf queue: 256 MiB of kernel memory
CLONE_NEWNET = 0x40000000  # setns(2)'s namespace type of a network namespace (linux/sched.h)
NETNS_RUN_DIR = "/var/run/netns"  # where `ip netns add` mounts its namespaces


class NetnsError(RuntimeError):
    """An `ip` / `tc` command failed or timed out, or the kernel lacks a needed feature."""


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"NetemSpec.{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class NetemSpec:
    """What shapes the sender->receiver direction, in the units the names say.

    rate_gbps: tbf token rate, 1e9 bit/s of IP packets (L3 bytes incl. IP/TCP headers, so
        TCP goodput tops out ~3 % lower: 1448 payload bytes per 1500-byte packet).
    delay_ms / jitter_ms: netem one-way delay and its uniform +- jitter, milliseconds.
        Jitter reorders packets (netem sorts by send time), which TCP sees as loss hints.
    loss_pct: netem independent random loss, percent of packets in [0, 100].
    burst_bytes / limit_bytes: tbf bucket depth and queue limit, bytes (None: defaults
        below, see `tbf_burst_bytes` / `tbf_limit_bytes`).
    symmetric_delay: also delay the receiver->sender direction (acks) by delay_ms, so the
        round trip is 2 * delay_ms as on a real path; rate, jitter and loss stay one-way.
        False: the ack direction is left entirely unshaped (round trip = delay_ms).
    """

    rate_gbps: float
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    burst_bytes: int | None = None
    limit_bytes: int | None = None
    symmetric_delay: bool = True

    def __post_init__(self) -> None:
        if _finite("rate_gbps", self.rate_gbps) <= 0:
            raise ValueError(f"NetemSpec.rate_gbps must be > 0, got {self.rate_gbps!r}")
        for name in ("delay_ms", "jitter_ms"):
            if _finite(name, getattr(self, name)) < 0:
                raise ValueError(f"NetemSpec.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"NetemSpec.jitter_ms ({self.jitter_ms}) must be <= delay_ms "
                             f"({self.delay_ms}): netem clamps negative delays to 0")
        if not 0.0 <= _finite("loss_pct", self.loss_pct) <= 100.0:
            raise ValueError(f"NetemSpec.loss_pct must be in [0, 100], got {self.loss_pct!r}")
        for name in ("burst_bytes", "limit_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"NetemSpec.{name} must be an int or None, got {value!r}")
            if not MTU_BYTES <= value <= TBF_U32_MAX:
                raise ValueError(f"NetemSpec.{name} must be in [{MTU_BYTES}, {TBF_U32_MAX}] "
                                 f"(at least one {MTU_BYTES}-byte packet), got {value}")

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_gbps * 1e9 / 8

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    @property
    def tbf_burst_bytes(self) -> int:
        """Bucket depth, bytes: what may leave back to back at veth speed after an idle spell.
        Default: 1 ms of traffic at the rate, but at least one 64 KiB GSO packet as tbf
        counts it (GSO_QDISC_BYTES). Below that tbf segments every TSO skb in software and
        the receiver takes the transfer as MTU-sized packets: measured here at 0.3 Gbps, the
        receiving process's I/O threads spent ~4x the CPU per byte of 0.6 Gbps (whose 1 ms
        bucket held a whole skb), and a step drafted beside the transfer took 3x its time;
        above 1 ms a short burst overshoots the rate for longer than a typical switch
        buffer would let it, and a bulk transfer of B bytes gains burst/rate seconds."""
        if self.burst_bytes is not None:
            return self.burst_bytes
        return min(TBF_U32_MAX, max(GSO_QDISC_BYTES, math.ceil(self.rate_bytes_per_s * 1e-3)))

    @property
    def tbf_limit_bytes(self) -> int:
        """Bytes queued waiting for tokens before tbf tail-drops. Default: 20 ms of traffic at
        the rate (a bottleneck buffer of a few ms to tens of ms, like a switch port), but at
        least 4 bucket depths so a TSQ-sized TCP burst is not dropped at low rates; capped
        at 256 MiB of kernel memory. Queueing delay is at most limit / rate."""
        if self.limit_bytes is not None:
            return self.limit_bytes
        twenty_ms = math.ceil(self.rate_bytes_per_s * 20e-3)
        return min(DEFAULT_LIMIT_CAP_BYTES, max(twenty_ms, 4 * self.tbf_burst_bytes))

    @property
    def netem_limit_packets(self) -> int:
        """netem holds every packet for delay (+ jitter) before passing it on, so its packet
        limit must cover the bandwidth-delay product: 2x the BDP in MTU-sized packets (small
        skbs at low rates), and never below netem's own default of 1000."""
        bdp_bytes = self.rate_bytes_per_s * (self.delay_ms + self.jitter_ms) * 1e-3
        return max(1000, math.ceil(2 * bdp_bytes / MTU_BYTES))


@dataclass(frozen=True)
class NetnsLink:
    """A live shaped link. Addresses are plain IPv4 strings (prefix length ADDR_PREFIX_LEN);
    the veth end inside each namespace carries the namespace's name."""

    tag: str
    sender_ns: str
    receiver_ns: str
    sender_addr: str
    receiver_addr: str
    spec: NetemSpec

    @property
    def sender_dev(self) -> str:
        return self.sender_ns

    @property
    def receiver_dev(self) -> str:
        return self.receiver_ns

    def ns(self, side: str) -> str:
        if side == "sender":
            return self.sender_ns
        if side == "receiver":
            return self.receiver_ns
        raise ValueError(f"side must be 'sender' or 'receiver', got {side!r}")

    def argv_in(self, side: str, argv: list[str]) -> list[str]:
        """argv run inside the side's namespace: ['ip', 'netns', 'exec', ns, *argv]."""
        if not argv:
            raise ValueError("argv_in needs a command to run")
        return ["ip", "netns", "exec", self.ns(side), *argv]


# --- names ------------------------------------------------------------------------------


def _check_prefix(prefix: str) -> str:
    if not re.fullmatch(rf"[a-z]{{1,{MAX_PREFIX_CHARS}}}", prefix or ""):
        raise ValueError(f"prefix must be 1-{MAX_PREFIX_CHARS} lowercase letters "
                         f"(names must stay <= 15 chars), got {prefix!r}")
    return prefix


def make_tag(prefix: str = DEFAULT_PREFIX) -> str:
    """A fresh run tag: prefix + 6 random hex chars, e.g. 'kvs1a2b3c'."""
    return _check_prefix(prefix) + secrets.token_hex(TAG_HEX_CHARS // 2)


def _check_tag(tag: str) -> str:
    if not re.fullmatch(rf"[a-z]{{1,{MAX_PREFIX_CHARS}}}[0-9a-f]{{{TAG_HEX_CHARS}}}", tag or ""):
        raise ValueError(f"tag must be 1-{MAX_PREFIX_CHARS} lowercase letters + "
                         f"{TAG_HEX_CHARS} hex chars (see make_tag), got {tag!r}")
    return tag


def link_addresses(tag: str) -> tuple[str, str]:
    """(sender, receiver) IPv4 link-local addresses of a tag's /30, chosen from its hex part.
    169.254.0.x and 169.254.255.x are reserved (RFC 3927), so the third octet is 1..254:
    254 * 64 = 16256 /30 subnets. Each pair of namespaces has its own routing table, so two
    runs that draw the same subnet still do not collide; distinct subnets only keep
    captures and logs unambiguous."""
    index = int(_check_tag(tag)[-TAG_HEX_CHARS:], 16) % (254 * 64)
    third, base = 1 + index // 64, (index % 64) * 4
    return f"169.254.{third}.{base + 1}", f"169.254.{third}.{base + 2}"


def _new_link(spec: NetemSpec, tag: str) -> NetnsLink:
    sender_addr, receiver_addr = link_addresses(tag)
    return NetnsLink(tag=tag, sender_ns=tag + "s", receiver_ns=tag + "r",
                     sender_addr=sender_addr, receiver_addr=receiver_addr, spec=spec)


# --- commands ---------------------------------------------------------------------------


def _run(argv: list[str], timeout_s: float = CMD_TIMEOUT_S) -> str:
    """Run one short command; return its stdout or raise NetnsError naming it and its stderr."""
    cmd = " ".join(argv)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{cmd}` timed out after {timeout_s:g} s") from exc
    except FileNotFoundError as exc:
        raise NetnsError(f"`{cmd}`: {argv[0]} not found (install iproute2)") from exc
    if done.returncode != 0:
        raise NetnsError(f"`{cmd}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _us(ms: float) -> str:
    return f"{round(ms * 1000)}us"  # tc time argument, integer microseconds


def tc_commands(link: NetnsLink) -> list[list[str]]:
    """The `tc` invocations that shape a link (pure: nothing runs). Forward direction:
    netem as root (delay/jitter/loss) with tbf as its child, the netem wiki's order, so the
    tbf byte limit stays in force (under tbf, a netem child would replace tbf's byte queue
    by netem's packet queue)."""
    spec = link.spec
    fwd = ["tc", "-netns", link.sender_ns, "qdisc", "add", "dev", link.sender_dev]
    tbf = ["tbf", "rate", f"{round(spec.rate_gbps * 1e9)}bit",
           "burst", str(spec.tbf_burst_bytes), "limit", str(spec.tbf_limit_bytes)]
    if not spec.needs_netem:
        return [[*fwd, "root", "handle", "1:", *tbf]]
    netem = ["netem", "limit", str(spec.netem_limit_packets), "delay", _us(spec.delay_ms)]
    if spec.jitter_ms > 0:
        netem.append(_us(spec.jitter_ms))
    if spec.loss_pct > 0:
        netem += ["loss", "random", f"{spec.loss_pct!r}%"]
    cmds = [[*fwd, "root", "handle", "1:", *netem], [*fwd, "parent", "1:1", "handle", "10:", *tbf]]
    if _delays_acks(spec):
        cmds.append(["tc", "-netns", link.receiver_ns, "qdisc", "add", "dev", link.receiver_dev,
                     "root", "handle", "1:", "netem", "limit", str(spec.netem_limit_packets),
                     "delay", _us(spec.delay_ms)])
    return cmds


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (/proc/PID/stat field 22), or None
    when it does not exist: with the pid it tells a live owner from a recycled pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after 'pid (comm)' start at 3


def _owner_mark() -> str:
    """Interface alias naming this process as the link's owner: stored by the kernel on the
    veth end, so it disappears with the namespace and needs no file of its own. cleanup()
    leaves namespaces whose owner is alive."""
    pid = os.getpid()
    return f"kvsim owner pid={pid} start={_proc_start_ticks(pid)}"


def _build(link: NetnsLink, created: list[str]) -> None:
    """Namespaces, veth pair created inside them, addresses, links up, qdiscs. Appends each
    namespace to `created` once it exists, so teardown removes exactly those: a name that
    already existed (a tag given twice) belongs to someone else and is never deleted."""
    s, r = link.sender_ns, link.receiver_ns
    for ns in (s, r):
        _run(["ip", "netns", "add", ns])
        created.append(ns)
    _run(["ip", "link", "add", "name", link.sender_dev, "netns", s, "type", "veth",
          "peer", "name", link.receiver_dev, "netns", r])
    for ns, dev, addr in ((s, link.sender_dev, link.sender_addr),
                          (r, link.receiver_dev, link.receiver_addr)):
        _run(["ip", "-n", ns, "link", "set", "dev", dev, "alias", _owner_mark()])
        _run(["ip", "-n", ns, "addr", "add", f"{addr}/{ADDR_PREFIX_LEN}", "dev", dev])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", dev, "up"])
    for cmd in tc_commands(link):
        _run(cmd)


def _netns_names() -> list[str]:
    # lines look like 'kvs1a2b3cs' or 'kvs1a2b3cs (id: 3)'
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs inside ns (started there through argv_in): while a process
    lives in a namespace, `ip netns del` only removes its name and the veth lives on."""
    for word in _run(["ip", "netns", "pids", ns]).split():
        pid = int(word)
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _delete_netns(ns: str) -> None:
    if ns not in _netns_names():
        return  # never created (setup failed early) or already gone
    _kill_inside(ns)
    _run(["ip", "netns", "del", ns])


def _teardown(created: list[str]) -> list[str]:
    """Delete the namespaces (their veth ends and qdiscs go with them); return the errors
    instead of raising, so one failure does not leave the other namespace behind."""
    errors = []
    for ns in created:
        try:
            _delete_netns(ns)
        except NetnsError as exc:
            errors.append(str(exc))
    return errors


# --- signals ----------------------------------------------------------------------------


def _raise_terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the with-block's cleanup; exit 143


def _install_sigterm() -> object:
    """Make SIGTERM raise while the link exists; returns the old handler (or None when not
    on the main thread, where Python cannot install handlers; SIGTERM then keeps its
    old behaviour and `kvsim net cleanup` is the fallback)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


@contextmanager
def _signals_deferred(old_sigterm: object) -> Iterator[None]:
    """Teardown with SIGINT/SIGTERM blocked, then the old SIGTERM handler back, then the
    signals unblocked: one that arrived meanwhile is delivered after the cleanup, to the
    handler that was there before the link."""
    deferred = {signal.SIGINT, signal.SIGTERM}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, deferred)
    try:
        yield
    finally:
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)  # type: ignore[arg-type]
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _teardown_deferred(created: list[str], old_sigterm: object) -> list[str]:
    with _signals_deferred(old_sigterm):
        return _teardown(created)


# --- public entry points ----------------------------------------------------------------


@contextmanager
def shaped_link(spec: NetemSpec, tag: str | None = None) -> Iterator[NetnsLink]:
    """Build a shaped two-namespace link, yield it, and remove everything it made on every
    exit path: normal exit, exception, KeyboardInterrupt, SIGTERM (raised as SystemExit(143)
    while inside). A failed teardown raises NetnsError, or is added as a note to the
    exception already on its way out."""
    if not isinstance(spec, NetemSpec):
        raise ValueError(f"spec must be a NetemSpec, got {type(spec).__name__}")
    link = _new_link(spec, _check_tag(tag) if tag is not None else make_tag())
    if spec.needs_netem:
        ok, why = netem_available()
        if not ok:
            raise NetnsError(f"spec {spec} needs netem: {why}")
    created: list[str] = []
    old_sigterm = _install_sigterm()
    try:
        _build(link, created)
        yield link
    except BaseException as exc:
        errors = _teardown_deferred(created, old_sigterm)
        if errors:
            exc.add_note(f"shaped_link teardown of {link.tag} also failed: {'; '.join(errors)}")
        raise
    errors = _teardown_deferred(created, old_sigterm)
    if errors:
        raise NetnsError(f"teardown of {link.tag} failed: {'; '.join(errors)} "
                         "(run `kvsim net cleanup`)")


def _delays_acks(spec: NetemSpec) -> bool:
    """Whether tc_commands gives the receiver's end a qdisc (the acks' delay)."""
    return spec.needs_netem and spec.symmetric_delay and spec.delay_ms > 0


def reshaped(link: NetnsLink, spec: NetemSpec) -> NetnsLink:
    """The same link shaped by `spec` instead (its qdiscs replaced; namespaces, addresses and
    whatever runs there stay): one pair of namespaces serves runs at several rates. Replace
    while nothing is sent. A new rate, delay or loss of the same shape (tbf alone, or netem
    over tbf) replaces the qdiscs in place, so the link is never unshaped; adding or removing
    netem deletes the sender's root first. A NetnsError may leave the link half-shaped:
    send nothing more on it."""
    if not isinstance(spec, NetemSpec):
        raise ValueError(f"spec must be a NetemSpec, got {type(spec).__name__}")
    if spec.needs_netem:
        ok, why = netem_available()
        if not ok:
            raise NetnsError(f"spec {spec} needs netem: {why}")
    old, new = link.spec, replace(link, spec=spec)
    in_place = old.needs_netem == spec.needs_netem
    if not in_place:  # tbf <-> netem at the root (same handle, another kind): delete, add
        _run(["tc", "-netns", link.sender_ns, "qdisc", "del", "dev", link.sender_dev, "root"])
    for cmd in tc_commands(new):  # ["tc", "-netns", ns, "qdisc", "add", ...]
        on_receiver = cmd[2] == link.receiver_ns
        _run([*cmd[:4], "replace" if in_place or on_receiver else "add", *cmd[5:]])
    if _delays_acks(old) and not _delays_acks(spec):
        _run(["tc", "-netns", link.receiver_ns, "qdisc", "del", "dev", link.receiver_dev,
              "root"])
    return new


def _join_netns(ns: str) -> None:
    """Move the calling thread into network namespace ns (setns(2)): the sockets it opens
    from now on, and those of the threads it starts, are ns's. The process's other threads
    stay where they are."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(os.path.join(NETNS_RUN_DIR, ns), os.O_RDONLY)
    except OSError as exc:
        raise NetnsError(f"network namespace {ns}: {exc.strerror}") from exc
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"setns into network namespace {ns} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def call_in_netns(ns: str, fn: Callable[[], T], timeout_s: float) -> T:
    """fn() on a thread of its own inside network namespace ns (a side of a NetnsLink), its
    result or its exception returned here: this process sends through the link without a
    child process of its own (no interpreter start, no model load). Threads that fn starts
    are ns's too (ZeroMQ's I/O threads, which open the sockets); a pool thread started there
    that outlives fn keeps the namespace itself alive after `ip netns del` until this
    process ends. TimeoutError after timeout_s (the thread is left to end on its own)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _join_netns(ns)
            result.append(fn())
        except BaseException as exc:  # handed to the caller, whatever it is
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"the call in network namespace {ns} did not end within "
                           f"{timeout_s:g} s")
    if failure:
        raise failure[0]
    return result[0]


def _leftover_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{_check_prefix(prefix)}[0-9a-f]{{{TAG_HEX_CHARS}}}[{ROLE_LETTERS}]")


@dataclass(frozen=True)
class Leftover:
    """A namespace named like ours; owner_pid is the process whose shaped_link made it
    (None: no owner mark: a setup killed before the veth existed, or not made by kvsim)."""

    netns: str
    owner_pid: int | None
    owner_alive: bool


def _owner(ns: str) -> tuple[int | None, bool]:
    """(pid, alive) from the owner mark on the veth end named like the namespace."""
    try:
        shown = _run(["ip", "-n", ns, "-o", "link", "show", "dev", ns])
    except NetnsError:
        return None, False  # no such device: setup stopped before the veth existed
    found = re.search(r"alias kvsim owner pid=(\d+) start=(\d+)", shown)
    if found is None:
        return None, False
    pid, start = int(found[1]), int(found[2])
    return pid, _proc_start_ticks(pid) == start


def leftovers(prefix: str = DEFAULT_PREFIX) -> list[Leftover]:
    """Namespaces named <prefix><6 hex><role letter>, with their owner. Only that exact
    pattern matches, so other software's namespaces that merely start with the prefix are
    never touched; note prefix 'kvs' does not match a longer prefix like 'kvst' ('t' is not
    hex) but does match 'kvsa'."""
    pattern = _leftover_pattern(prefix)
    names = sorted(n for n in _netns_names() if pattern.fullmatch(n))
    return [Leftover(n, *_owner(n)) for n in names]


def cleanup(prefix: str = DEFAULT_PREFIX, force: bool = False) -> list[str]:
    """Delete leftover namespaces (their veth ends and qdiscs go with them), killing
    processes still inside; return the names removed. Namespaces whose owner process is
    still alive are a link in use, not a leftover: they are kept unless force."""
    removed = []
    for item in leftovers(prefix):
        if item.owner_alive and not force:
            continue
        _delete_netns(item.netns)
        removed.append(item.netns)
    return removed


@functools.cache
def _probe() -> tuple[bool, str, bool, str]:
    """(netns ok, why, netem ok, why), by building a veth pair with tbf and netem inside a
    throwaway namespace. Cached: the kernel does not change under a running process."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return False, "not Linux (no network namespaces)", False, "no network namespaces"
    if os.geteuid() != 0:
        why = "not root (ip netns needs CAP_SYS_ADMIN, tc needs CAP_NET_ADMIN)"
        return False, why, False, why
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            why = f"`{tool}` not found (install iproute2)"
            return False, why, False, why
    # SIGINT / SIGTERM wait until the probe namespace is gone (a few `ip` / `tc` calls, each
    # with a timeout): a run stopped mid-probe left it behind
    with _signals_deferred(None):
        return _probe_namespace(make_tag() + "p")


def _probe_namespace(ns: str) -> tuple[bool, str, bool, str]:
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "name", ns, "type", "veth", "peer", "name", "b"])
        _run(["ip", "-n", ns, "link", "set", "dev", ns, "alias", _owner_mark()])
        _run(["tc", "-netns", ns, "qdisc", "add", "dev", ns, "root", "tbf", "rate", "1gbit",
              "burst", str(GSO_QDISC_BYTES), "limit", str(4 * GSO_QDISC_BYTES)])
    except NetnsError as exc:
        _cleanup_probe(ns)
        return False, str(exc), False, str(exc)
    try:
        _run(["tc", "-netns", ns, "qdisc", "add", "dev", "b", "root", "netem", "delay", "1ms"])
        netem = (True, "netem available")
    except NetnsError as exc:
        netem = (False, f"kernel has no sch_netem (CONFIG_NET_SCH_NETEM): delay, jitter and "
                        f"loss cannot be emulated ({exc})")
    _cleanup_probe(ns)
    return True, "network namespaces, veth and tbf available", *netem


def _cleanup_probe(ns: str) -> None:
    try:
        _delete_netns(ns)
    except NetnsError:
        pass  # a probe namespace left behind is found by cleanup(): its name has the pattern


def netns_available() -> tuple[bool, str]:
    """(ok, reason): root, iproute2 present, and a namespace with a veth pair and a tbf qdisc
    can actually be made. Tests skip with the reason when not ok."""
    ok, why, _, _ = _probe()
    return ok, why


def netem_available() -> tuple[bool, str]:
    """(ok, reason): as netns_available, plus the kernel has the netem qdisc."""
    _, _, ok, why = _probe()
    return ok, why
