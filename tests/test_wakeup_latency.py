"""The CPUs held awake while a transfer is timed (kvsim.core.wakeup_latency): the PM QoS
request written and held while the block runs, ended with it; a hold that cannot be taken
reported once, never fatal; the decode host's rows saying what was held."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_transport import BASE

from kvsim.core import wakeup_latency as W
from kvsim.transport.config import TransportConfig


def _fds_on(path) -> int:
    """How many of this process's file descriptors are open on `path`."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:  # (the listing's own descriptor, closed by now)
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_the_request_is_written_and_held_while_the_block_runs(tmp_path):
    qos = tmp_path / "cpu_dma_latency"  # a file stands in for the device: it takes writes
    qos.touch()
    with W.held_wakeup_latency(50, qos) as hold:
        assert hold == W.WakeupHold(50, 50)
        assert qos.read_bytes() == struct.pack("=i", 50)
        assert _fds_on(qos) == 1  # held open: the kernel drops the request on close
    assert _fds_on(qos) == 0


def test_a_hold_that_cannot_be_taken_runs_the_block_and_says_why(tmp_path):
    missing = tmp_path / "no-such-device"
    ran = []
    with W.held_wakeup_latency(0, missing) as hold:
        ran.append(1)
    assert ran and (hold.requested_us, hold.held_us) == (0, None)
    assert str(missing) in hold.why and "No such file" in hold.why


def test_the_blocks_own_error_passes_through_with_its_own_context(tmp_path):
    """An error inside the block leaves it as raised, the file closed; where the hold could
    not be taken, the error does not carry the failed open as its context."""
    qos = tmp_path / "cpu_dma_latency"
    qos.touch()
    for path in (qos, tmp_path / "no-such-device"):
        with pytest.raises(RuntimeError, match="mid-run") as raised, \
                W.held_wakeup_latency(0, path):
            raise RuntimeError("mid-run")
        assert raised.value.__context__ is None
    assert _fds_on(qos) == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_the_device_refuses_is_not_a_hold():
    with W.held_wakeup_latency(0, Path("/dev/full")) as hold:  # every write: ENOSPC
        assert hold.held_us is None and "/dev/full" in hold.why
    assert _fds_on("/dev/full") == 0


def test_leave_requests_nothing_and_bad_latencies_are_refused(tmp_path):
    qos = tmp_path / "cpu_dma_latency"
    qos.touch()
    with W.held_wakeup_latency(W.LEAVE, qos) as hold:
        assert hold == W.WakeupHold(W.LEAVE, None, "not requested (cpu_wakeup_us=-1)")
    assert qos.read_bytes() == b""
    with pytest.raises(ValueError, match=r"0\.\.2147483647 us"), W.held_wakeup_latency(-5, qos):
        pass
    with pytest.raises(ValueError, match=r"0\.\.2147483647 us"), \
            W.held_wakeup_latency(2**31, qos):
        pass
    for bad in (-2, 2**31):
        with pytest.raises(ValueError, match="cpu_wakeup_us must be 0..2147483647"):
            TransportConfig(cpu_wakeup_us=bad).validate()
    TransportConfig(cpu_wakeup_us=-1).validate()
    TransportConfig(cpu_wakeup_us=2**31 - 1).validate()


def test_an_unheld_request_is_reported_once_per_process_and_side(monkeypatch, capsys):
    monkeypatch.setattr(W, "_reported", set())
    unheld = W.WakeupHold(0, None, "/dev/cpu_dma_latency: Permission denied")
    for _ in range(3):  # a validation's sender: once per scenario
        W.report_unheld("kvsim send", unheld)
    W.report_unheld("kvsim serve", unheld)
    W.report_unheld("kvsim serve", W.WakeupHold(0, 0))
    W.report_unheld("kvsim other", W.WakeupHold(W.LEAVE, None, "not requested"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("kvsim send: CPUs not held awake (/dev/cpu_dma_latency: "
                               "Permission denied; transport.cpu_wakeup_us=-1")
    assert lines[1].startswith("kvsim serve: CPUs not held awake")


def _can_hold() -> bool:
    try:
        os.close(os.open(W.PM_QOS_PATH, os.O_WRONLY))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("latency_us", [0, -1])
def test_the_decode_hosts_rows_say_what_was_held(tmp_path, latency_us):
    """`kvsim emulate` end to end (two processes, timing decode): the decode host's row
    carries the latency its CPUs were held to, or null where not held (not requested, or
    this host does not let it: then one line says why)."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kvsim", "emulate", *BASE, "codecs=[int8]",
                           f"transport.cpu_wakeup_us={latency_us}", f"report={out}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["status"] == "done"
    held = latency_us == 0 and _can_hold()
    assert row["cpu_wakeup_held_us"] == (0 if held else None)
    assert ("CPUs not held awake" in proc.stderr) == (latency_us == 0 and not held)


def _scenario(run_dir, name, measured):
    path = run_dir / "scenarios" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"measured": measured, "simulated": []}))


def test_a_validation_says_whether_its_requests_ran_with_the_cpus_held(tmp_path):
    """The validation's summary counts the emulated requests whose decode host held the
    CPUs (a row of repeats counts its requests), and its line says so, or how many ran
    without; rows from before the field say nothing."""
    from kvsim.fidelity.validation import _cpu_wakeup, _cpu_wakeup_line

    _scenario(tmp_path, "single-a", [{"requests": 2, "cpu_wakeup_held_us": 0},
                                     {"requests": 2, "cpu_wakeup_held_us": 0}])
    _scenario(tmp_path, "multi-b", [{"requests": 8, "cpu_wakeup_held_us": 0}])
    held = _cpu_wakeup(tmp_path)
    assert held == {"requests": 12, "held": 12, "held_us": [0], "not_recorded": 0}
    assert _cpu_wakeup_line(held) == \
        "CPUs held awake (wake-up latency 0 us) under all 12 emulated requests"
    _scenario(tmp_path, "single-c", [{"requests": 2, "cpu_wakeup_held_us": None},
                                     {"status": "refused"}])  # a sender's own row
    some = _cpu_wakeup(tmp_path)
    assert some == {"requests": 15, "held": 12, "held_us": [0], "not_recorded": 1}
    assert _cpu_wakeup_line(some).startswith(
        "CPUs not held awake under 2 of 14 emulated requests (transport.cpu_wakeup_us=-1, or")
    old = tmp_path / "old"
    _scenario(old, "single-a", [{"requests": 2}])
    assert _cpu_wakeup_line(_cpu_wakeup(old)) is None
    assert _cpu_wakeup_line(None) is None
