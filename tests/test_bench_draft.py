"""kvsim bench draft (kvsim.fidelity.draft_contention) on the tiny random model: the rows it
measures and its refusals. The ratios themselves are this host's, reported by the bench."""

from __future__ import annotations

import sys

import pytest
import torch

from kvsim.cli import main
from kvsim.config.codecs import resolve_codec
from kvsim.fidelity.draft_contention import LOADS, measure, switch_interval
from kvsim.model.load import load_lm
from kvsim.model.presets import load_model_preset
from kvsim.quality.capture import cache_to_kv, prefill

TINY = load_model_preset("tiny-random")


@pytest.fixture(scope="module")
def tiny():
    lm = load_lm(TINY, threads=1, seed=0)
    with torch.no_grad():
        cache, logits = prefill(lm.model, list(range(1, 49)))
    return lm, cache_to_kv(cache).to(torch.bfloat16), int(torch.argmax(logits))


def test_every_round_has_the_plain_step_and_each_load_against_it(tiny):
    lm, kv, token = tiny
    codec = resolve_codec("lynx").build()
    got = measure(lm, codec, kv, token, ["layer_jobs", "compute", "memory"], steps=2,
                  rounds=2)
    assert [(r.round, r.load) for r in got] == [
        (r, load) for r in range(2) for load in ("none", "layer_jobs", "compute", "memory")]
    for r in got:
        assert r.context_tokens == 48 and r.step_s > 0
        plain = next(p for p in got if p.round == r.round and p.load == "none")
        assert r.plain_step_s == plain.step_s
        assert r.row()["ratio"] == pytest.approx(r.step_s / plain.step_s)
        if r.load == "none":
            assert r.ratio == 1.0 and r.load_ops == 0
        else:  # the load ran while the steps were timed
            assert r.load_ops >= 1 and r.load_op_s > 0


def test_refusals(tiny):
    lm, kv, token = tiny
    lynx = resolve_codec("lynx").build()
    with pytest.raises(ValueError, match="unknown load"):
        measure(lm, lynx, kv, token, ["gpu"], steps=2, rounds=1)
    with pytest.raises(ValueError, match="steps >= 2"):
        measure(lm, lynx, kv, token, ["compute"], steps=1, rounds=1)
    with pytest.raises(ValueError, match="do not decode alone"):
        measure(lm, resolve_codec("cachegen").build(), kv, token, ["layer_jobs"], steps=2,
                rounds=1)
    with pytest.raises(ValueError, match="> 0"):
        switch_interval(0.0)
    assert set(LOADS) == {"layer_jobs", "compute", "memory", "python"}


def test_command_prints_the_ratios_and_restores_the_switch_interval(capsys):
    before = sys.getswitchinterval()
    args = ["bench", "draft", "model=tiny-random", "contexts=[32]", "steps=2", "rounds=1",
            "loads=[compute,python]", "switch_interval_s=0.0005", "progress=false"]
    assert main(args) == 0
    assert sys.getswitchinterval() == before
    out = capsys.readouterr().out
    assert "vs plain (median)" in out and "python" in out and "compute" in out
    assert main(["bench", "draft", "model=tiny-random", "loads=[gpu]"]) != 0
    assert "unknown load" in capsys.readouterr().err
    assert main(["bench", "draft", "model=tiny-random", "steps=1"]) != 0
