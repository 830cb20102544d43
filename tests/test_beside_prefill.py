"""The decode step beside a live prefill (kvsim.calibrate.beside_prefill): the paired timing on
a fake clock, a real measurement on the tiny model with a real prefilling child process, the
profile entry's checks and the timing model's ratio."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvsim.calibrate.beside_prefill import PrefillNeighbour, measure_beside_prefill, paired_ratios
from kvsim.model.hardware import HardwareSpec
from kvsim.model.hardware_profile import load_profile
from kvsim.model.presets import load_model_preset
from kvsim.scenario.timing_model import TimingModel

TINY = load_model_preset("tiny-random")
HW = HardwareSpec(name="cpu", hbm_gb_per_s=20, bf16_tflops=0.2, memory_gb=16)


class _Host:
    """A fake clock whose steps take base(B) s alone and x slow(B) while the neighbour's
    prefills run, the host 5% slower after every pair of blocks."""

    def __init__(self) -> None:
        self.t, self.on, self.drift, self.switches = 0.0, False, 1.0, []

    def clock(self) -> float:
        return self.t

    def step_for(self, b: int):
        def step() -> None:
            self.t += 0.01 * (1 + b) * self.drift * ({1: 1.5, 3: 1.1}.get(b, 1.2)
                                                      if self.on else 1.0)
        return step

    def beside(self, on: bool) -> None:
        self.on = on
        if not on:
            self.drift *= 1.05
        self.switches.append(on)


def test_each_size_is_timed_beside_and_alone_in_turn():
    host = _Host()
    ratios = paired_ratios(host.step_for, [1, 2, 3], 3, host.beside, rounds=2,
                           clock=host.clock)
    # each round's ratio is of a pair of blocks at one speed: exactly the slowdown, though
    # the host's speed moved between rounds and sizes
    assert ratios == pytest.approx([1.5, 1.2, 1.1], rel=1e-12)
    assert host.switches == [True, False] * 6  # on and off twice per size, ending off
    assert not host.on
    with pytest.raises(ValueError, match="steps and rounds"):
        paired_ratios(host.step_for, [1], 0, host.beside)


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
    # the simulator's ratios: the non-decreasing least-squares line through the medians
    assert entry["ratio"][0] <= entry["ratio"][1]
    assert sum(entry["ratio"]) == pytest.approx(sum(entry["measured"]), rel=1e-9)
    assert entry["fit"]["per_member"] >= 0 and entry["fit"]["residual_rms_pct"] >= 0
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
    ({"ratio": [1.1, 0.0]}, "must be > 0"),
    ({"batch": [2, 1]}, "batch must increase"),
    ({"ratio": [1.1]}, "differ in length"),
    ({"prefill_tokens": 0}, "prefill_tokens an integer >= 1"),
    ({"batch": [0, 1]}, "batch sizes >= 1"),
    ({"context_tokens": float("nan")}, "non-finite"),
])
def test_a_bad_entry_is_refused_by_name(tmp_path, change, match):
    beside = {"context_tokens": 64, "prefill_tokens": 64, "batch": [1, 2], "ratio": [1.1, 1.2],
              **change}
    with pytest.raises(ValueError, match=match):
        load_profile(_profile(tmp_path, beside), TINY.name)
