"""The decode step beside the on-arrival worker (kvsim.calibrate.beside_worker): the
neighbour thread switched on and off, a real measurement on the tiny model, the profile
entry's checks, the timing model's ratio and the calibration's settings."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from kvsim.calibrate.beside_worker import WorkerNeighbour, measure_beside_worker, step_extra
from kvsim.kernels.presets import resolve_codec
from kvsim.model.hardware import HardwareSpec
from kvsim.model.hardware_profile import load_profile
from kvsim.model.presets import load_model_preset
from kvsim.scenario.timing_model import TimingModel

TINY = load_model_preset("tiny-random")
HW = HardwareSpec(name="cpu", hbm_gb_per_s=20, bf16_tflops=0.2, memory_gb=16)


def _kv(tokens: int = 48):
    from kvsim.kv.capture import cache_to_kv, prefill
    from kvsim.model.load import load_lm

    lm = load_lm(TINY, threads=1, seed=0)
    cache, _ = prefill(lm.model, list(range(1, tokens + 1)))
    return lm, cache_to_kv(cache)  # [layers, 2, kv_heads, tokens, head_dim]


def test_the_neighbour_runs_the_workers_jobs_only_while_on():
    _, kv = _kv()
    with WorkerNeighbour(resolve_codec("int8").build(), kv) as neighbour:
        time.sleep(0.1)
        assert neighbour.jobs == 0  # off until switched on
        neighbour.running(True)
        time.sleep(0.2)
        neighbour.running(False)
        done = neighbour.jobs
        assert done > 0
        time.sleep(0.1)
        assert neighbour.jobs == done  # off again: no job after the switch returned


def test_a_failing_job_is_raised_by_the_switch():
    _, kv = _kv()
    neighbour = WorkerNeighbour(resolve_codec("int8").build(), kv)

    def broken(i: int) -> None:
        raise OSError("disk gone")
    with pytest.raises(RuntimeError, match="worker neighbour failed.*disk gone"), neighbour:
        neighbour.job = broken  # type: ignore[method-assign]
        neighbour.running(True)


def test_a_job_that_fails_after_the_last_switch_is_raised_on_exit():
    _, kv = _kv()
    neighbour = WorkerNeighbour(resolve_codec("int8").build(), kv)
    with pytest.raises(RuntimeError, match="worker neighbour failed.*late"), neighbour:
        neighbour.error = OSError("late")  # as the thread leaves it


def test_a_codec_without_layer_jobs_is_refused():
    _, kv = _kv()
    with pytest.raises(ValueError, match="do not decode alone"):
        WorkerNeighbour(resolve_codec("cachegen").build(), kv)


def test_a_real_measurement_on_the_tiny_model(tmp_path):
    lm, kv = _kv()
    said = []
    spec = resolve_codec("lynx")
    entry = measure_beside_worker(lm, spec.build(), kv, [1, 2], 2, said.append,
                                  label=spec.label)
    assert entry["context_tokens"] == 48 and entry["codec"] == "lynx"
    assert entry["batch"] == [1, 2] and len(entry["ratio"]) == len(entry["measured"]) == 2
    assert all(r > 0 for r in entry["measured"]) and all(s > 0 for s in entry["alone_s"])
    fitted = step_extra(entry["measured"], entry["alone_s"])
    assert entry["extra_s"] == fitted["extra_s"] and entry["ratio"] == fitted["ratio"]
    assert "beside the worker, batch [1, 2] at 48 tokens" in said[-1]
    prof = tmp_path / "hw.json"
    prof.write_text(json.dumps({
        "model": TINY.name, "prefill": {"tokens": [64], "s": [0.01]},
        "tpot": {"context_tokens": [64], "s": [0.01]}, "tpot_beside_worker": entry}))
    assert load_profile(str(prof), TINY.name)["tpot_beside_worker"] == entry


def test_the_simulators_extra_is_the_median_of_the_sizes_extras():
    # 2.0 x 80 ms, 1.5 x 150 ms, 1.25 x 280 ms: extras 80, 75, 70 ms -> 75 ms
    fitted = step_extra([2.0, 1.5, 1.25], [0.08, 0.15, 0.28])
    assert fitted["extra_s"] == pytest.approx(0.075)
    assert fitted["fit"]["per_size_extra_s"] == pytest.approx([0.08, 0.075, 0.07])
    assert fitted["ratio"] == pytest.approx([1 + 0.075 / 0.08, 1.5, 1 + 0.075 / 0.28])
    assert fitted["fit"]["residual_max_pct"] == pytest.approx(
        100 * (1 - (1 + 0.075 / 0.08) / 2.0))
    # a worker that made the steps faster (the rounds' scatter) adds nothing
    assert step_extra([0.98, 0.99], [0.1, 0.2])["extra_s"] == 0.0
    with pytest.raises(ValueError, match="one positive step alone per ratio"):
        step_extra([1.1], [0.1, 0.2])


def _profile(tmp_path, beside) -> str:
    p = tmp_path / "hw.json"
    p.write_text(json.dumps({
        "model": TINY.name, "prefill": {"tokens": [64], "s": [0.01]},
        "tpot": {"context_tokens": [64], "s": [0.01]}, "tpot_beside_worker": beside}))
    return str(p)


def test_the_timing_model_gives_the_profiles_extra(tmp_path):
    beside = {"context_tokens": 64, "codec": "int8", "batch": [1, 2, 4],
              "ratio": [1.8, 1.6, 1.4], "extra_s": 0.075}
    tm = TimingModel(TINY, replace(HW, profile=_profile(tmp_path, beside)))
    assert not tm.beside_prefill_measured
    assert tm.beside_worker_extra_s() == 0.075
    with pytest.raises(ValueError, match="no tpot_beside_prefill.*beside_prefill_tokens"):
        tm.beside_prefill_ratio(1)
    roofline = TimingModel(TINY, HW)
    with pytest.raises(ValueError, match="kvsim calibrate beside_worker_tokens"):
        roofline.beside_worker_extra_s()


@pytest.mark.parametrize("change, match", [
    ({"ratio": [1.1, 0.99]}, "tpot_beside_worker: ratio must be >= 1"),
    ({"batch": [2, 1]}, "batch must be sizes >= 1 that increase"),
    ({"context_tokens": 0}, "context_tokens must be an integer >= 1"),
    ({"codec": ""}, "codec must name the codec"),
    ({"codec": None}, "codec must name the codec"),
    ({"extra_s": -0.01}, "extra_s must be a number >= 0"),
    ({"extra_s": float("inf")}, "extra_s must be a number >= 0"),
    ({"extra_s": None}, "extra_s must be a number >= 0"),
])
def test_a_bad_entry_is_refused_by_name(tmp_path, change, match):
    beside = {"context_tokens": 64, "codec": "int8", "batch": [1, 2], "ratio": [1.1, 1.2],
              "extra_s": 0.01, **change}
    with pytest.raises(ValueError, match=match):
        load_profile(_profile(tmp_path, beside), TINY.name)


def test_the_calibration_refuses_bad_settings_before_measuring():
    from kvsim.calibrate.pipeline import Config

    with pytest.raises(ValueError, match="beside_worker_tokens must be 0"):
        Config(model=TINY, beside_worker_tokens=8)
    with pytest.raises(ValueError, match="beside_worker_codec 'cachegen'"):
        Config(model=TINY, beside_worker_tokens=64, beside_worker_codec="cachegen")
    assert Config(model=TINY, beside_worker_tokens=64).beside_worker_codec == "int8"
