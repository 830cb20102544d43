"""The multi-request case's workload (kvsim.fidelity.validation._multi_workload): the
instances it names are ones both engines run, and one prefill instance keeps the keys the
shipped runs were measured with."""

from __future__ import annotations

import json

from kvsim.core.compose import compose
from kvsim.fidelity.validation import MultiConfig, _multi_workload
from kvsim.scenario.config import SimConfig
from kvsim.transport.config import EmulateConfig


def _configs(keys: list[str]) -> tuple[EmulateConfig, SimConfig]:
    base = ["model=smollm2-135m", "hardware=local-cpu", "link=emulated", "codecs=[int8]"]
    ecfg, _ = compose("transport", [*base, *keys], EmulateConfig)
    scfg, _ = compose("sim", [*base, *(k for k in keys if not k.startswith("transport."))],
                      SimConfig)  # (as kvsim.fidelity.runner.sim_overrides keeps them)
    ecfg.validate()
    scfg.validate()
    return ecfg, scfg


def test_two_prefill_instances_share_the_one_link_in_both_engines():
    ecfg, scfg = _configs(_multi_workload(MultiConfig(prefill_nodes=2), 0.5))
    for cfg in (ecfg, scfg):
        assert cfg.workload.prefill_nodes == 2 and cfg.link.sharing == "shared"
        assert (cfg.workload.decode_nodes, cfg.workload.decode_max_batch) == (1, 8)


def test_one_prefill_instance_keeps_the_measured_runs_keys():
    keys = _multi_workload(MultiConfig(), 0.35)
    assert "workload.prefill_nodes=1" in keys and not any("sharing" in k for k in keys)
    ecfg, _ = _configs(keys)
    assert ecfg.link.sharing == "per_prefill"  # one prefill instance: one link either way
    alone = _multi_workload(MultiConfig(max_batch=1, requests=6), 0.35)
    assert {"workload.decode_nodes=6", "workload.decode_max_batch=1"} <= set(alone)


def test_a_grid_refuses_a_key_it_sets_that_was_given_too():
    """grid=quick / heldout set their scenarios: a key of theirs given on the command line
    is refused, not silently replaced; a saved run's config (the grid's values already
    in it) is taken as it is."""
    import pytest

    from kvsim.fidelity.validation import Config

    with pytest.raises(ValueError, match=r"grid=heldout sets contexts itself"):
        Config(model=None, grid="heldout", contexts=[4096]).apply_grid()
    with pytest.raises(ValueError, match=r"grid=quick sets codecs, multi.requests itself"):
        Config(model=None, grid="quick", codecs=["bf16"],
               multi=MultiConfig(requests=3)).apply_grid()
    held = Config(model=None, grid="heldout")
    held.apply_grid()
    held.apply_grid(refuse_given=False)  # (as measured_from= reads it back)
    assert held.contexts == [1536]
    full = Config(model=None, contexts=[4096])
    full.apply_grid()
    assert full.contexts == [4096]


def test_real_decode_batches_the_models_forwards_on_a_live_prefill():
    """multi.decode=real: the emulator decodes with the model on live KV, one batch of up
    to max_batch requests; the simulator's keys are the timing case's."""
    import pytest

    from kvsim.fidelity.validation import Config

    real = _multi_workload(MultiConfig(decode="real"), 0.35)
    assert {"transport.decode=real", "transport.kv_source=live"} <= set(real)
    ecfg, scfg = _configs(real)
    assert (ecfg.transport.decode, ecfg.workload.decode_max_batch) == ("real", 8)
    timing = _multi_workload(MultiConfig(), 0.35)
    assert [k for k in real if not k.startswith("transport.")] == \
        [k for k in timing if not k.startswith("transport.")]
    with pytest.raises(ValueError, match="multi.decode must be one of"):
        Config(model=None, multi=MultiConfig(decode="batched"))


def test_the_calibration_times_what_the_multi_request_case_runs(monkeypatch, tmp_path):
    """validate calibrate=true times every batch size its cases' decode instances can step
    (1 and 2 where none batches), and with the real model's decode the case's own
    prompt length (its emulator prefills it live); with the timing-model decode a context
    between measured ones is left to the fitted curves, and grid=heldout keeps it out."""
    import kvsim.calibrate.pipeline as pipeline
    from kvsim.fidelity.validation import Config, _calibrate

    got = []
    monkeypatch.setattr(pipeline, "calibrate", got.append)
    for multi in (MultiConfig(), MultiConfig(decode="real", max_batch=5)):
        cfg = Config(model=None, multi=multi)
        cfg.apply_grid()
        _calibrate(cfg, tmp_path, "p", ["token_bucket"])
    held = Config(model=None, grid="heldout", multi=MultiConfig(decode="real"))
    held.apply_grid()
    _calibrate(held, tmp_path, "p", ["token_bucket"])
    alone = Config(model=None, multi=MultiConfig(enabled=False))
    alone.apply_grid()
    _calibrate(alone, tmp_path, "p", ["token_bucket"])
    prefix = Config(model=None, multi=MultiConfig(enabled=False, max_batch=2))
    prefix.prefix.enabled, prefix.prefix.max_batch = True, 6
    prefix.apply_grid()
    _calibrate(prefix, tmp_path, "p", ["token_bucket"])
    timing, real, heldout, single, with_prefix = got
    # no batching case: the smallest curve that gives a ratio (every scenario decodes alone)
    assert single.batches == [1, 2]
    assert with_prefix.batches == [1, 2, 3, 4, 5, 6]  # the prefix case's instance batches
    assert timing.batches == list(range(1, 9)) and 512 not in timing.contexts
    assert real.batches == [1, 2, 3, 4, 5] and 512 in real.contexts
    assert held.multi.context_tokens == 768 and 768 not in heldout.contexts
    # the real decode's steps also beside a live prefill of the case's prompt (held out too:
    # the ratio is timed at the nearest calibrated context)
    assert (real.beside_prefill_tokens, heldout.beside_prefill_tokens) == (512, 768)
    assert timing.beside_prefill_tokens == single.beside_prefill_tokens == 0
    # ... and beside the on-arrival worker's jobs of its first codec whose layers decode alone
    assert (real.beside_worker_tokens, heldout.beside_worker_tokens) == (512, 768)
    assert real.beside_worker_codec == "int8"
    assert timing.beside_worker_tokens == single.beside_worker_tokens == 0


def test_the_simulator_mirrors_one_host_where_the_profile_measured_it(tmp_path):
    """multi.decode=real with a profile that timed steps beside a prefill: the simulator
    slows its steps while a prefill runs (workload.colocated_prefill); not otherwise."""
    from pathlib import Path

    from kvsim.fidelity.runner import Profiles
    from kvsim.fidelity.validation import _colocated

    def profiles(doc: dict, dequantize: str = "on_arrival") -> Profiles:
        hw = tmp_path / f"hw{len(list(tmp_path.iterdir()))}.json"
        hw.write_text(json.dumps({"model": "m", **doc}))
        return Profiles(hw, Path("ct.json"), {}, dequantize)

    plain = profiles({})
    beside = profiles({"tpot_beside_prefill": {"batch": [1]}})
    real, timing = MultiConfig(decode="real"), MultiConfig()
    assert _colocated(real, beside) == ["workload.colocated_prefill=true"]
    assert _colocated(real, plain) == [] and _colocated(timing, beside) == []
    both = {"tpot_beside_prefill": {"batch": [1]}, "tpot_beside_worker": {"batch": [1]}}
    assert _colocated(real, profiles(both)) == ["workload.colocated_prefill=true",
                                                "workload.worker_slows_decode=true"]
    assert _colocated(timing, profiles(both)) == []
    # a receiver that dequantizes on demand has no worker to slow the steps
    assert _colocated(real, profiles(both, "on_demand")) == ["workload.colocated_prefill=true"]


def test_the_multi_case_gives_the_override_to_the_simulator_alone(monkeypatch, tmp_path):
    """_multi appends workload.colocated_prefill and worker_slows_decode to the simulator's
    overrides (the emulator's config refuses them)."""
    import contextlib
    from pathlib import Path

    import kvsim.fidelity.runner as runner
    from kvsim.fidelity.runner import Profiles
    from kvsim.fidelity.validation import Config, _multi
    from kvsim.model.presets import load_model_preset

    class Ran(Exception):
        pass

    calls = []

    def run_pair(common, sim, host=None):
        calls.append((common, sim))
        raise Ran

    monkeypatch.setattr(runner, "run_pair", run_pair)
    monkeypatch.setattr(runner, "kept_decode_host", lambda *a, **k: contextlib.nullcontext())
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"model": "smollm2-135m", "tpot_beside_prefill": {"batch": [1]},
                              "tpot_beside_worker": {"batch": [1]}}))
    profiles = Profiles(hw, Path("ct.json"), {"token_bucket": Path("link.json")},
                        "on_arrival")
    for decode, want in (("real", True), ("timing", False)):
        cfg = Config(model=load_model_preset("smollm2-135m"), multi=MultiConfig(decode=decode))
        try:
            _multi(cfg, profiles, 0.0, tmp_path)
        except Ran:
            pass
        common, sim = calls[-1]
        assert ("workload.colocated_prefill=true" in sim) is want
        assert ("workload.worker_slows_decode=true" in sim) is want
        assert not any("colocated" in o or "worker_slows" in o for o in common)
