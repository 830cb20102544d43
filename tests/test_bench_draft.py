"""kvsim bench draft (kvsim.fidelity.draft_contention) on the tiny random model: the rows it
measures, a load that fails or hangs, and its refusals. The ratios themselves are this
host's, reported by the bench."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import kvsim.fidelity.draft_contention as dc
from kvsim.cli.main import main
from kvsim.kernels.presets import resolve_codec
from kvsim.kv.capture import cache_to_kv, prefill
from kvsim.model.load import load_lm
from kvsim.model.presets import load_model_preset

TINY = load_model_preset("tiny-random")


@pytest.fixture(scope="module")
def tiny():
    lm = load_lm(TINY, threads=1, seed=0)
    with torch.no_grad():
        cache, logits = prefill(lm.model, list(range(1, 49)))
    return lm, cache_to_kv(cache).to(torch.bfloat16), int(torch.argmax(logits))


def _contention_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith("kvsim-draft-contention") and t.is_alive()]


def test_each_round_times_the_plain_step_then_each_load_beside_it(tiny):
    lm, kv, token = tiny
    loads = ["layer_jobs", "layer_jobs_1thread", "compute"]
    got = dc.measure(lm, resolve_codec("lynx").build(), kv, token, loads, steps=2, rounds=2)
    assert [(r.round, r.load) for r in got] == [
        (r, load) for r in range(2) for load in ("none", *loads)]
    assert all(r.context_tokens == 48 and r.step_s > 0 for r in got)
    # every load was running while the steps were timed: it finished operations (a 2-step
    # decode of the tiny model outlasts one layer job), each of a positive length
    assert all(r.load_ops >= 1 and r.load_op_s > 0 for r in got if r.load != "none")
    assert _contention_threads() == []  # every load thread stopped


def test_a_load_that_fails_fails_the_measurement(tiny, monkeypatch):
    lm, kv, token = tiny

    def failing(load, codec, shape, chunks):
        calls = iter(range(10**6))
        def op(i):  # the warm-up call passes, the load's own calls fail
            if next(calls) > 0:
                raise MemoryError("no room for the load")
        return op

    monkeypatch.setattr(dc, "_load_op", failing)
    with pytest.raises(RuntimeError, match="compute load failed: MemoryError"):
        dc.measure(lm, resolve_codec("lynx").build(), kv, token, ["compute"], steps=2,
                   rounds=1)
    assert _contention_threads() == []


def test_refusals(tiny):
    lm, kv, token = tiny
    lynx = resolve_codec("lynx").build()
    with pytest.raises(ValueError, match="unknown load"):
        dc.measure(lm, lynx, kv, token, ["gpu"], steps=2, rounds=1)
    with pytest.raises(ValueError, match="steps >= 2"):
        dc.measure(lm, lynx, kv, token, ["compute"], steps=1, rounds=1)
    with pytest.raises(ValueError, match="do not decode alone"):
        dc.measure(lm, resolve_codec("cachegen").build(), kv, token, ["layer_jobs_1thread"],
                   steps=2, rounds=1)
    with pytest.raises(ValueError, match="> 0"):
        dc.switch_interval(0.0)


def test_command_prints_the_ratios_and_restores_the_switch_interval(capsys, monkeypatch):
    before = sys.getswitchinterval()
    args = ["bench", "draft", "model=tiny-random", "contexts=[32]", "steps=2", "rounds=1",
            "loads=[compute,python]", "switch_interval_s=0.0005", "progress=false"]
    assert main(args) == 0
    assert sys.getswitchinterval() == before
    out = capsys.readouterr().out
    assert "vs plain (median)" in out and "python" in out and "compute" in out

    def broken(*args, **kwargs):
        assert sys.getswitchinterval() == 0.0005  # set while measuring
        raise RuntimeError("measurement failed")

    monkeypatch.setattr(dc, "measure", broken)
    assert main(args) != 0
    assert sys.getswitchinterval() == before  # restored after a failure too
    capsys.readouterr()
    for bad, says in ((["loads=[gpu]"], "loads must be"), (["steps=1"], "steps >= 2"),
                      (["switch_interval_s=0"], "switch_interval_s"),
                      (["job_codec=cachegen"], "do not decode alone")):
        assert main(["bench", "draft", "model=tiny-random", *bad]) != 0
        assert says in capsys.readouterr().err
