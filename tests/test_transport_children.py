"""Children end with the process that started them: `popen` children get SIGTERM when their
parent is SIGKILLed (directly, through `ip netns exec`, and `kvsim emulate`'s `kvsim serve`),
and a child whose parent died before its prctl exits without running its command."""

from __future__ import annotations

import os
import secrets
import signal
import string
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvsim.transport import children
from kvsim.transport.children import popen, stop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux only (popen is Popen elsewhere)")

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
# a parent that starts a sleeper through popen (optionally inside a namespace), then waits
PARENT = textwrap.dedent("""\
    import sys, time
    from kvsim.transport.children import popen
    prefix = sys.argv[2:]  # e.g. ip netns exec NS
    popen([*prefix, sys.executable, "-c", {sleeper!r}, sys.argv[1]])
    time.sleep(600)
    """).format(sleeper=SLEEPER)


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: its reaper may be a PID 1 that never waits)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout_s} s")


def _pid_in(path: Path) -> int | None:
    text = path.read_text().strip() if path.is_file() else ""
    return int(text) if text else None


def _kill_parent_and_check_child(tmp_path: Path, prefix: list[str]) -> None:
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file), *prefix], cwd=ROOT)
    child = None
    try:
        child = _wait_for(lambda: _pid_in(pid_file), 30, "the child wrote its pid")
        assert _alive(child)
        parent.kill()  # SIGKILL: no finally, no atexit, no stop() in the parent
        parent.wait(timeout=10)
        _wait_for(lambda: not _alive(child), 5, f"child {child} gone after its parent's SIGKILL")
    finally:
        stop(parent)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_child_dies_when_its_parent_is_sigkilled(tmp_path):
    _kill_parent_and_check_child(tmp_path, [])


def test_child_is_the_command_itself_with_the_death_signal_set():
    """Same pid as the command (stop() and returncode reach it), PR_GET_PDEATHSIG = SIGTERM,
    argv untouched, and SIGPIPE / SIGXFSZ not left ignored by the shim's Python."""
    code = ("import ctypes, os, sys; libc = ctypes.CDLL(None); s = ctypes.c_int(); "
            "libc.prctl(2, ctypes.byref(s), 0, 0, 0); print(os.getpid(), s.value, sys.argv[1:])")
    proc = popen([sys.executable, "-c", code, "a b", ""], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert out.split(maxsplit=2) == [str(proc.pid), str(int(signal.SIGTERM)), "['a b', '']\n"]

    def ignored(start) -> str:
        with start(["cat", "/proc/self/status"], stdout=subprocess.PIPE, text=True) as p:
            return next(line for line in p.communicate(timeout=30)[0].splitlines()
                        if line.startswith("SigIgn:"))
    assert ignored(popen) == ignored(subprocess.Popen)


def test_child_whose_parent_already_died_exits_without_running(tmp_path):
    """The race: the parent died between fork and prctl, so no signal will ever come; the
    shim sees a parent pid that is not the expected one and exits (128 + SIGTERM)."""
    marker = tmp_path / "ran"
    argv = children._shim_argv([sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                               parent_pid=-1, env=None)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert not marker.exists()


def test_missing_command_fails_in_the_parent_as_popen_does():
    with pytest.raises(FileNotFoundError):
        popen(["kvsim-no-such-command"])
    with pytest.raises(TypeError):
        popen(["true"], shell=True)


@pytest.mark.net
def test_child_inside_a_namespace_dies_with_its_parent(tmp_path):
    """`ip netns exec NS cmd` execs cmd in the same process: the death signal reaches it."""
    from kvsim.transport.netns import NetemSpec, make_tag, netns_available, shaped_link

    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    # 'kvsy' + 4 letters: outside the default 'kvs' + hex pattern and other tests' prefixes
    prefix = "kvsy" + "".join(secrets.choice(string.ascii_lowercase) for _ in range(4))
    with shaped_link(NetemSpec(rate_gbps=1.0), tag=make_tag(prefix)) as link:
        _kill_parent_and_check_child(tmp_path, ["ip", "netns", "exec", link.receiver_ns])


def _children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def test_emulate_sigkilled_leaves_no_serve(tmp_path):
    """`kvsim emulate` SIGKILLed while its `kvsim serve` child starts: the child ends too
    (it gets SIGTERM, the default action ends it at once, without its report)."""
    with open(tmp_path / "err", "w") as err:
        emulate = subprocess.Popen(
            [sys.executable, "-m", "kvsim", "emulate", "transport.kv_source=synthetic",
             "transport.decode=timing", "workload.context_tokens=512",
             "workload.output_tokens=8", "codecs=[int8]", f"report={tmp_path / 'r.json'}"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
    serve = None
    try:
        def serve_child() -> int | None:
            for pid in _children_of(emulate.pid):
                argv = _cmdline(pid)
                if argv[1:4] == ["-m", "kvsim", "serve"]:  # the command, past the shim
                    return pid
            assert emulate.poll() is None, ("kvsim emulate ended before it was killed:\n"
                                            + (tmp_path / "err").read_text()[-3000:])
            return None
        serve = _wait_for(serve_child, 60, "kvsim emulate started kvsim serve")
        emulate.kill()
        emulate.wait(timeout=10)
        _wait_for(lambda: not _alive(serve), 15, f"kvsim serve {serve} gone after emulate's "
                                                 "SIGKILL")
    finally:
        stop(emulate)
        if serve is not None and _alive(serve):
            os.kill(serve, signal.SIGKILL)
