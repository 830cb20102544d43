"""The decode step beside a live prefill (kvsim.calibrate.beside_prefill): the paired timing on
a fake clock, a real measurement on the tiny model with a real prefilling child process, the
profile entry's checks and the timing model's ratio."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvsim.calibrate.beside_prefill import PrefillNeighbour, measure_beside_prefill
from kvsim.calibrate.paired_steps import paired_ratios, slowdown_line
from kvsim.model.hardware import HardwareSpec
from kvsim.model.hardware_profile import load_profile
from kvsim.model.presets import load_model_preset
from kvsim.scenario.timing_model import TimingModel

TINY = load_model_preset("tiny-random")
HW = HardwareSpec(name="cpu", hbm_gb_per_s=20, bf16_tflops=0.2, memory_gb=16)


class _Host:
    """A fake clock whose steps take base(B) s alone and x slow(B) while the neighbour's
    prefills run; the host 5% slower for every new batch size, and the first step after a
    switch 10x as long (the other kind's caches)."""

    def __init__(self) -> None:
        self.t, self.on, self.drift, self.switches = 0.0, False, 1.0, []
        self.cold = False

    def clock(self) -> float:
        return self.t

    def step_for(self, b: int):
        self.drift *= 1.05

        def step() -> None:
            dt = 0.01 * (1 + b) * self.drift * ({1: 1.5, 3: 1.1}.get(b, 1.2)
                                                if self.on else 1.0)
            self.t += 10 * dt if self.cold else dt
            self.cold = False
        return step

    def beside(self, on: bool) -> None:
        self.on, self.cold = on, True
        self.switches.append(on)


def test_each_size_is_timed_beside_and_alone_in_turn():
    host = _Host()
    ratios = paired_ratios(host.step_for, [1, 2, 3], 3, host.beside, rounds=3,
                           clock=host.clock)
    # exactly the slowdown: the host's speed moved between sizes, and the first step after
    # each switch is not timed
    assert ratios == pytest.approx([1.5, 1.2, 1.1], rel=1e-12)
    assert host.switches == [True, False] * 9  # on and off in every round, ending off
    assert not host.on
    with pytest.raises(ValueError, match="steps and rounds"):
        paired_ratios(host.step_for, [1], 0, host.beside)


def test_rounds_alternate_which_block_comes_first():
    host, kinds = _Host(), []

    def step_for(b):
        inner = host.step_for(b)

        def step():
            kinds.append(host.on)
            inner()
        return step
    paired_ratios(step_for, [1], 2, host.beside, rounds=3, clock=host.clock)
    assert len(kinds) == 6 * 3  # 6 blocks of an untimed step and 2 timed ones
    blocks = [k for i, k in enumerate(kinds) if i % 3 == 0]  # each block's first step
    assert blocks == [False, True, True, False, False, True]  # AB, BA, AB


def test_the_neighbour_is_switched_off_when_a_block_fails():
    host = _Host()

    def step_for(b):
        def step():
            if host.on:
                raise RuntimeError("a step failed")
        return step
    with pytest.raises(RuntimeError, match="a step failed"):
        paired_ratios(step_for, [1], 2, host.beside, clock=host.clock)
    assert host.switches == [True, False] and not host.on

    def failing_off(on: bool) -> None:  # stopping fails too: the step's error is raised
        host.beside(on)
        if not on:
            raise TimeoutError("did not stop")
    with pytest.raises(RuntimeError, match="a step failed"):
        paired_ratios(step_for, [1], 2, failing_off, clock=host.clock)


def test_measured_beside_a_real_prefilling_process_and_loaded_back(tmp_path):
    from kvsim.kv.capture import cache_to_kv, prefill
    from kvsim.model.load import load_lm

    lm = load_lm(TINY, threads=1, seed=0)
    cache, _ = prefill(lm.model, list(range(1, 49)))
    kv = cache_to_kv(cache)  # [layers, 2, kv_heads, 48, head_dim]
    said = []
    entry = measure_beside_prefill(lm, TINY, 1, kv, list(range(1, 65)), [1, 2], 2, said.append)
    assert entry["context_tokens"] == 48 and entry["prefill_tokens"] == 64
    assert entry["batch"] == [1, 2] and len(entry["ratio"]) == len(entry["measured"]) == 2
    assert all(r > 0 for r in entry["measured"])
    assert entry["ratio"] == slowdown_line([1, 2], entry["measured"])["ratio"]
    assert entry["split_cpus"] is False
    assert "beside a prefill, batch [1, 2] at 48 tokens" in said[-1]
    prof = tmp_path / "hw.json"
    prof.write_text(json.dumps({
        "model": TINY.name, "prefill": {"tokens": [64], "s": [0.01]},
        "tpot": {"context_tokens": [64], "s": [0.01]}, "tpot_beside_prefill": entry}))
    assert load_profile(str(prof), TINY.name)["tpot_beside_prefill"] == entry


def test_a_neighbour_that_cannot_load_fails_fast():
    broken = replace(TINY, random_init=False, path="/nonexistent/model.gguf")
    with pytest.raises(RuntimeError, match="prefill neighbour process failed to load"), \
            PrefillNeighbour(broken, 1, list(range(1, 17)), timeout_s=120):
        pass


def test_the_simulators_ratios_are_a_non_decreasing_line_at_least_1():
    rising = slowdown_line([1, 2, 3, 4], [1.02, 1.05, 1.04, 1.09])
    assert rising["ratio"] == pytest.approx([1.02, 1.04, 1.06, 1.08])  # slope 0.1 / 5
    assert rising["fit"]["per_member"] == pytest.approx(0.02)
    # falling: flat at the mean; below 1 (the rounds' scatter): 1, no speed-up
    assert slowdown_line([1, 2, 3], [1.145, 1.029, 0.963])["ratio"] == \
        pytest.approx([1.0457] * 3, rel=1e-4)
    assert slowdown_line([1, 2, 3], [0.99, 0.97, 0.96])["ratio"] == [1.0, 1.0, 1.0]
    assert slowdown_line([1, 2], [0.97, 1.05])["ratio"] == pytest.approx([1.0, 1.05])


def _profile(tmp_path, beside) -> str:
    p = tmp_path / "hw.json"
    p.write_text(json.dumps({
        "model": TINY.name, "prefill": {"tokens": [64], "s": [0.01]},
        "tpot": {"context_tokens": [64], "s": [0.01]}, "tpot_beside_prefill": beside}))
    return str(p)


def test_the_timing_model_interpolates_the_ratio_and_holds_it_beyond(tmp_path):
    beside = {"context_tokens": 64, "prefill_tokens": 64, "batch": [1, 2, 4],
              "ratio": [1.05, 1.1, 1.3]}
    tm = TimingModel(TINY, replace(HW, profile=_profile(tmp_path, beside)))
    assert tm.beside_prefill_measured
    assert [tm.beside_prefill_ratio(b) for b in (1, 2, 3, 4, 8)] == \
        pytest.approx([1.05, 1.1, 1.2, 1.3, 1.3], rel=1e-12)
    roofline = TimingModel(TINY, HW)
    assert not roofline.beside_prefill_measured
    with pytest.raises(ValueError, match="kvsim calibrate beside_prefill_tokens"):
        roofline.beside_prefill_ratio(1)


@pytest.mark.parametrize("change, match", [
    ({"ratio": [1.1, 0.99]}, "ratio must be >= 1"),
    ({"batch": [2, 1]}, "batch must be sizes >= 1 that increase"),
    ({"batch": [0, 1]}, "batch must be sizes >= 1 that increase"),
    ({"ratio": [1.1]}, "lists of finite numbers of one length"),
    ({"ratio": [1.1, float("nan")]}, "lists of finite numbers of one length"),
    ({"prefill_tokens": 0}, "prefill_tokens must be an integer >= 1"),
    ({"context_tokens": 64.5}, "context_tokens must be an integer >= 1"),
])
def test_a_bad_entry_is_refused_by_name(tmp_path, change, match):
    beside = {"context_tokens": 64, "prefill_tokens": 64, "batch": [1, 2], "ratio": [1.1, 1.2],
              **change}
    with pytest.raises(ValueError, match=match):
        load_profile(_profile(tmp_path, beside), TINY.name)
