"""transport.split_cpus / transport.cpus: the two ends of an emulated transfer on CPUs of
their own (kvsim.transport.cpus)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from test_transport import BASE, config

from kvsim.transport import cpus

needs_pinning = pytest.mark.skipif(
    not cpus.available() or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least 2 CPUs")


def test_cpu_lists_read_and_write_as_taskset_does():
    assert cpus.parse_cpus("0-3,6") == {0, 1, 2, 3, 6}
    assert cpus.parse_cpus(" 1 ") == {1} and cpus.parse_cpus("") == set()
    for text in ("0-3,6", "1", "0,2,4", "0-1,3-5,9"):
        assert cpus.format_cpus(cpus.parse_cpus(text)) == text
    for bad in ("a", "3-1", "-1", "1-b", "1-", "2,4-"):
        with pytest.raises(ValueError, match="CPU list"):
            cpus.parse_cpus(bad)


def test_a_malformed_cpu_list_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="CPU list"):
        config("transport.cpus=zero").validate()


def test_emulate_refuses_a_cpu_list_it_would_drop():
    """emulate places both ends (transport.split_cpus): a list meant for one process is
    refused, not silently ignored."""
    from kvsim.transport.emulate import emulate

    with pytest.raises(ValueError, match="kvsim emulate runs both ends"):
        emulate(config("transport.cpus=0"))


@pytest.mark.parametrize("mine,sender,receiver", [
    ({0, 1}, {0}, {1}), ({0, 1, 2}, {0}, {1, 2}), ({2, 3, 5, 7}, {2, 3}, {5, 7})])
def test_the_sender_gets_the_first_half(monkeypatch, mine, sender, receiver):
    monkeypatch.setattr(cpus, "available", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(mine))
    assert cpus.halves() == (sender, receiver)


def test_one_cpu_cannot_be_split(monkeypatch):
    monkeypatch.setattr(cpus, "available", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        cpus.halves()


@needs_pinning
def test_pin_moves_every_thread_and_puts_them_back():
    started, release = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def older() -> None:  # a thread that exists before the pin (as numba's pool does)
        started.set()
        release.wait(10)
        seen["older"] = os.sched_getaffinity(0)

    t = threading.Thread(target=older)
    t.start()
    started.wait(10)
    one = {min(os.sched_getaffinity(0))}
    before = cpus.pin(one)
    try:
        release.set()
        t.join(10)
        later = threading.Thread(target=lambda: seen.setdefault("later",
                                                                os.sched_getaffinity(0)))
        later.start()
        later.join(10)
        assert seen == {"older": one, "later": one} and os.sched_getaffinity(0) == one
    finally:
        cpus.pin(before)
    assert os.sched_getaffinity(0) == before


@needs_pinning
def test_emulate_runs_each_end_on_its_own_cpus(tmp_path):
    """`kvsim emulate transport.split_cpus=true` end to end (two processes, timing decode):
    every row names the CPUs of the decode host and of the sender, disjoint halves of this
    process's."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kvsim", "emulate", *BASE, "codecs=[int8]",
                           "transport.split_cpus=true", f"report={out}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(out.read_text())["rows"]
    sender, receiver = cpus.halves()
    assert row["status"] == "done"
    assert (cpus.parse_cpus(row["send_cpus"]), cpus.parse_cpus(row["decode_cpus"])) == \
        (sender, receiver)


@needs_pinning
def test_pinned_puts_the_process_back_even_when_the_block_fails():
    before = os.sched_getaffinity(0)
    one = {min(before)}
    with pytest.raises(RuntimeError, match="mid-transfer"):
        with cpus.pinned(cpus.format_cpus(one)):
            assert os.sched_getaffinity(0) == one
            raise RuntimeError("mid-transfer")
    assert os.sched_getaffinity(0) == before
    with cpus.pinned(""):  # nothing asked: nothing changes
        assert os.sched_getaffinity(0) == before
