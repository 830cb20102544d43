"""A measured hardware profile on another host, or on a slower day: probed, then rescaled or
refused (kvsim.model.host, kvsim.calibrate.host_probe), in `kvsim sim` and `kvsim validate`;
and the calibration's step curves fitted over context (kvsim.calibrate.step_fit)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvsim.calibrate import host_probe
from kvsim.calibrate.host_probe import DriftRefused, check_drift, profile_steps
from kvsim.calibrate.step_fit import fit_step_line, fitted_curve
from kvsim.cli.main import main
from kvsim.model.hardware_profile import load_profile
from kvsim.model.host import DriftConfig, fingerprint, other_host, rescaled_profile

MODEL = SimpleNamespace(name="m")  # the profiles below are of model "m"


class FakeProbe:
    """A decode-step probe of a host `factor` x as slow as _profile's at its shortest context
    and `long_factor` x (default: factor) at its longest, linear in context between; it
    records the contexts it was asked."""

    steps = 16

    def __init__(self, factor: float, long_factor: float | None = None) -> None:
        self.factor, self.long = factor, factor if long_factor is None else long_factor
        self.asked: list = []

    def _at(self, c: int) -> float:  # _profile's in-process step: 0.1 s at 100, 0.2 at 300
        return float(np.interp(c, [100, 300], [0.1, 0.2]) *
                     np.interp(c, [100, 300], [self.factor, self.long]))

    def step_s(self, context_tokens: int) -> float:
        self.asked.append(context_tokens)
        return self._at(context_tokens)

    def steps_s(self, contexts: list[int]) -> list[float]:
        self.asked.append(list(contexts))
        return [self._at(c) for c in contexts]


def _profile(tmp_path, host: dict | None, model: str = "m"):
    doc = {"model": model, "name": "hw", "git": {"git_commit": "abc"},
           "measured_utc": "2026-11-29T03:20:00Z",
           "prefill": {"tokens": [100, 300], "s": [1.0, 3.0]},
           "tpot": {"context_tokens": [100, 300], "s": [0.11, 0.22]},
           "tpot_inprocess": {"context_tokens": [100, 300], "s": [0.1, 0.2]},
           "tpot_batch": {"context_tokens": 300, "batch": [1, 2], "s": [0.2, 0.3]},
           "verify": {"context_tokens": [100, 300], "drafted_tokens": [1], "s": [[0.3], [0.4]]},
           "first_step_extra": {"context_tokens": [100, 300], "s": [0.0, 0.01]}}
    if host is not None:
        doc["host"] = host
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    return path, doc


def test_another_host_is_another_cpu_model_or_count():
    here = fingerprint()
    assert other_host({**here}, here) is False
    assert other_host({**here, "cpu_model": "Some Other CPU"}, here) is True
    assert other_host({**here, "logical_cpus": here["logical_cpus"] + 1}, here) is True
    assert other_host(None, here) is None and other_host({}, here) is None
    with pytest.raises(ValueError, match="drift.action"):
        DriftConfig(action="ignore")
    with pytest.raises(ValueError, match="drift.when"):
        DriftConfig(when="sometimes")


def test_rescale_multiplies_every_model_time_and_says_so(tmp_path):
    path, doc = _profile(tmp_path, None)
    out = rescaled_profile(doc, 1.5, {"probe_s": 0.15})
    assert out["prefill"]["s"] == pytest.approx([1.5, 4.5])
    assert out["tpot"]["s"] == pytest.approx([0.165, 0.33])
    assert out["tpot_batch"]["s"] == pytest.approx([0.3, 0.45])
    assert out["verify"]["s"] == [pytest.approx([0.45]), pytest.approx([0.6])]
    assert out["first_step_extra"]["s"] == pytest.approx([0.0, 0.015])
    assert out["drift"]["factor"] == 1.5 and "x 1.5" in out["drift"]["what"]
    assert doc["tpot"]["s"] == [0.11, 0.22]  # the original is left alone
    # checked again, a rescaled profile finds its own level (no second rescale)
    assert profile_steps(out) == ([100, 300], pytest.approx([0.15, 0.3]),
                                  "its in-process step curve")
    probed = rescaled_profile({**doc, "host": {"decode_step_probe": {
        "context_tokens": [100, 300], "s": [0.08, 0.12]}}}, 1.5, {})
    assert profile_steps(probed) == ([100, 300], pytest.approx([0.12, 0.18]),
                                     "its host's probe")


def test_a_link_profiles_transport_times_rescale_and_its_link_terms_stay():
    from kvsim.model.host import rescaled_link_profile

    doc = {"efficiency": 0.99, "latency_s": 3e-5, "message_overhead_bytes": 0.0,
           "handshake_s": 0.002, "draft_step": {"ratio": 1.2, "busy_ratio": 2.0,
                                                "ingest_s_per_byte": 4e-9}}
    out = rescaled_link_profile(doc, 1.5, {})
    assert out["handshake_s"] == pytest.approx(0.003)
    assert out["draft_step"]["ingest_s_per_byte"] == pytest.approx(6e-9)
    assert out["draft_step"]["ratio"] == 1.2 and out["draft_step"]["busy_ratio"] == 2.0
    assert (out["efficiency"], out["latency_s"]) == (0.99, 3e-5)
    assert out["drift"]["what"] == "draft_step.ingest_s_per_byte and handshake_s x 1.5"
    assert doc["handshake_s"] == 0.002  # the original is left alone
    bare = rescaled_link_profile({"efficiency": 1.0}, 2.0, {})
    assert bare["drift"]["what"] == "nothing to rescale"


def test_a_rescale_by_context_moves_the_steps_by_their_context_and_the_prefill_by_the_first(
        tmp_path):
    """Two probed contexts: each step curve x the factor at its context (linear between the
    probed contexts, flat beyond), the prefill x the shortest context's factor."""
    _, doc = _profile(tmp_path, {"decode_step_probe": {"context_tokens": [100, 300],
                                                       "s": [0.1, 0.2]}})
    out = rescaled_profile(doc, [0.8, 0.6], {"probe_s": [0.08, 0.12]}, [100, 300])
    assert out["prefill"]["s"] == pytest.approx([0.8, 2.4])
    assert out["tpot"]["s"] == pytest.approx([0.11 * 0.8, 0.22 * 0.6])
    assert out["tpot_batch"]["s"] == pytest.approx([0.2 * 0.6, 0.3 * 0.6])  # at 300
    assert out["verify"]["s"] == [pytest.approx([0.3 * 0.8]), pytest.approx([0.4 * 0.6])]
    assert out["host"]["decode_step_probe"]["s"] == pytest.approx([0.08, 0.12])
    assert out["drift"]["factor"] == [0.8, 0.6] and out["drift"]["contexts"] == [100, 300]
    assert "x 0.8 / 0.6 at 100 / 300 tokens" in out["drift"]["what"]
    assert profile_steps(out) == ([100, 300], pytest.approx([0.08, 0.12]),
                                  "its host's probe")
    receiver = rescaled_profile({**doc, "cache_build": {"gb_per_s": 2.0},
                                 "draft_step": {"ratio": 1.4, "ingest_s_per_byte": 1e-8}},
                                [0.8, 0.6], {}, [100, 300])
    assert receiver["cache_build"]["gb_per_s"] == pytest.approx(2.0 / 0.8)
    assert receiver["draft_step"] == {"ratio": 1.4, "ingest_s_per_byte": pytest.approx(8e-9)}
    mid = rescaled_profile({**doc, "tpot": {"context_tokens": [50, 200, 400],
                                            "s": [1.0, 1.0, 1.0]}}, [0.8, 0.6], {}, [100, 300])
    assert mid["tpot"]["s"] == pytest.approx([0.8, 0.7, 0.6])
    with pytest.raises(ValueError, match="one factor per probed context"):
        rescaled_profile(doc, [0.8, 0.6], {}, [100])
    with pytest.raises(ValueError, match="must be > 0"):
        rescaled_profile(doc, [0.8, 0.0], {}, [100, 300])


def test_one_way_moves_a_profiles_level(tmp_path):
    """scaled_profile scales the named curves it has and nothing else (the step probe's step
    curves, the drift's every time); write_rescaled_profile writes what rescaled_profile
    gives, into a folder it makes."""
    from kvsim.model.hardware_profile import STEP_CURVES, scaled_profile
    from kvsim.model.host import write_rescaled_profile

    _, doc = _profile(tmp_path, None)
    steps = scaled_profile(doc, STEP_CURVES, 2.0)
    assert steps["tpot"]["s"] == pytest.approx([0.22, 0.44])
    assert steps["verify"]["s"] == [pytest.approx([0.6]), pytest.approx([0.8])]
    assert steps["prefill"] == doc["prefill"]  # not a step: left alone
    assert "absent" not in scaled_profile(doc, ("absent",), 2.0)
    assert doc["tpot"]["s"] == [0.11, 0.22]
    out = write_rescaled_profile(doc, tmp_path / "new" / "hw.json", 1.5, {"from_profile": "x"})
    assert json.loads(out.read_text()) == rescaled_profile(doc, 1.5, {"from_profile": "x"})


def test_the_profiles_steps_are_its_hosts_probe_else_its_in_process_curve(tmp_path):
    _, old = _profile(tmp_path, "a-hostname")  # older profiles name the host only
    assert profile_steps(old) == ([100, 300], [0.1, 0.2], "its in-process step curve")
    _, new = _profile(tmp_path, {"decode_step_probe": {"context_tokens": [256, 4096],
                                                       "s": [0.08, 0.12]}})
    assert profile_steps(new) == ([256, 4096], [0.08, 0.12], "its host's probe")
    # a probe at one context (older profiles): the curve's shape at that level
    _, one = _profile(tmp_path, {"decode_step_probe": {"context_tokens": 200, "s": 0.3}})
    assert profile_steps(one) == ([100, 300], pytest.approx([0.2, 0.4]),
                                  "its host's probe, its in-process step curve's shape")


def test_a_probe_at_more_contexts_takes_its_factors_from_a_line_through_its_steps(tmp_path):
    """A profile whose step curve has four contexts is probed at each; the factors come from
    the least-squares line through the probe's medians (one slow median does not bend the
    rescaled curve at its context); the calibration records such a probe, which a later
    check takes as the profile's steps."""
    from kvsim.calibrate.host_probe import probe_contexts

    doc = {"model": "m", "prefill": {"tokens": [100, 400], "s": [1.0, 4.0]},
           "tpot": {"context_tokens": [100, 200, 300, 400], "s": [0.1, 0.12, 0.14, 0.16]}}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))

    class Probe:
        asked: list = []

        def steps_s(self, contexts):
            self.asked.append(list(contexts))
            # this host: 0.05 + 1e-4 x context, the median at 200 tokens caught a slow spell
            return [0.05 + 1e-4 * c + (0.03 if c == 200 else 0.0) for c in contexts]

    drift = check_drift(path, MODEL, DriftConfig(), tmp_path / "out", Probe(), force=True)
    assert Probe.asked == [[100, 200, 300, 400]]
    line = [0.072, 0.079, 0.086, 0.093]  # least squares through the four medians
    profile = [0.1, 0.12, 0.14, 0.16]
    assert drift.factors == pytest.approx([a / b for a, b in zip(line, profile, strict=True)])
    assert drift.probes_s[1] == pytest.approx(0.1)  # the medians themselves are kept
    assert "(the factors from a line through them)" in drift.words()
    got = load_profile(drift.profile, "m")
    assert got["tpot"]["s"] == pytest.approx(line)
    assert got["prefill"]["s"] == pytest.approx([drift.factors[0], 4 * drift.factors[0]])
    assert probe_contexts([256, 512, 1024, 2048, 4096, 8192, 16384, 32768]) == \
        [256, 512, 2048, 4096, 16384, 32768]  # evenly over the eight, both ends kept


@pytest.mark.parametrize("factor, long_factor, action, outcome", [
    (1.05, 1.05, "rescale", "within"),  # 5 % slower: within 10 %
    (1.05, 0.7, "rescale", "rescaled"),  # as slow at 100 tokens, a third faster at 300
    (2.0, 2.0, "rescale", "rescaled"),  # twice as slow
    (0.5, 0.5, "rescale", "rescaled"),  # twice as fast
    (2.0, 2.0, "refuse", "refused"),
])
def test_check_drift_acts_on_the_probe(tmp_path, factor, long_factor, action, outcome):
    path, doc = _profile(tmp_path, {**fingerprint(), "cpu_model": "Some Other CPU"})
    probe = FakeProbe(factor, long_factor)
    cfg = DriftConfig(action=action)
    if outcome == "refused":
        with pytest.raises(DriftRefused, match=r"200.0 / 400.0 ms at 100 / 300 tokens \(the "
                                               r"factors from a line through them\) vs "
                                               r"100.0 / 200.0 ms.*x 2.000 / 2.000"):
            check_drift(path, MODEL, cfg, tmp_path / "out", probe)
        assert not (tmp_path / "out").exists()
        return
    drift = check_drift(path, MODEL, cfg, tmp_path / "out", probe)
    # the profile's shortest and longest context (no probe recorded), in one interleaved probe
    assert probe.asked == [[100, 300]]
    assert drift.factors == pytest.approx([factor, long_factor]) and drift.outcome == outcome
    assert drift.factor == pytest.approx(factor)
    assert drift.row_keys() == {"hardware_drift": outcome,
                                "hardware_drift_factor": pytest.approx(factor),
                                "hardware_drift_factor_long": pytest.approx(long_factor)}
    if outcome == "within":
        assert drift.profile == str(path) and not (tmp_path / "out").exists()
    else:
        got = load_profile(drift.profile, "m")
        assert got["tpot"]["s"] == pytest.approx([0.11 * factor, 0.22 * long_factor])
        assert got["prefill"]["s"] == pytest.approx([1.0 * factor, 3.0 * factor])
        assert got["drift"]["from_profile"] == str(path)
        assert f"x {factor:.3f} / {long_factor:.3f}" in drift.words()
        assert "step times x the factor at their context" in drift.words()
        assert f"prefill x {factor:.3f}" in drift.words()


def test_the_drift_says_what_ran_beside_the_profiles_calibration(tmp_path):
    busy = {**fingerprint(), "cpu_model": "Some Other CPU",
            "background": {"background_cores": 0.98, "cpus": 2, "wall_s": 300.0}}
    path, _ = _profile(tmp_path, busy)
    drift = check_drift(path, MODEL, DriftConfig(), tmp_path / "out", FakeProbe(2.0))
    assert drift.words().endswith("(the profile was calibrated beside 0.98 of 2 CPUs of "
                                  "other work)")
    (tmp_path / "b").mkdir()
    path, _ = _profile(tmp_path / "b", {**fingerprint(), "cpu_model": "Some Other CPU"})
    assert "calibrated beside" not in check_drift(path, MODEL, DriftConfig(),
                                                  tmp_path / "out2", FakeProbe(2.0)).words()


def test_sim_probes_only_another_host_unless_asked(tmp_path):
    here = fingerprint()
    same, _ = _profile(tmp_path, {**here})
    probe = FakeProbe(5.0)
    assert check_drift(same, MODEL, DriftConfig(), tmp_path / "o", probe) is None
    assert check_drift(same, MODEL, DriftConfig(action="off"), tmp_path / "o", probe,
                       force=True) is None
    assert probe.asked == []
    assert check_drift(same, MODEL, DriftConfig(when="always"), tmp_path / "o", probe) \
        is not None
    unnamed, _ = _profile(tmp_path, None)  # names no host: not probed unless forced
    assert check_drift(unnamed, MODEL, DriftConfig(), tmp_path / "o", probe) is None
    assert check_drift(unnamed, MODEL, DriftConfig(), tmp_path / "o", probe,
                       force=True).outcome == "rescaled"


def _sim(tmp_path, profile, *extra) -> list[str]:
    return ["sim", "scenario=none", "model=tiny-random", "hardware=local-cpu",
            f"hardware.profile={profile}", "codecs=[int8]", "deserializer=on_demand",
            "workload=emulated", "workload.context_tokens=200", "workload.output_tokens=4",
            f"hydra.run.dir={tmp_path}/run", *extra]


def test_kvsim_sim_rescales_a_profile_from_another_host(tmp_path, monkeypatch, capsys):
    """The same profile read on another CPU that decodes twice as slowly: the decode-bound
    times double against drift.action=off, the rows and the table say so; refuse exits
    non-zero with the figures."""
    path, _ = _profile(tmp_path, {**fingerprint(), "cpu_model": "Some Other CPU"},
                       model="tiny-random")
    monkeypatch.setattr(host_probe, "StepProbe", lambda model, steps, threads: FakeProbe(2.0))
    report_off, report_on = tmp_path / "off.json", tmp_path / "on.json"
    assert main(_sim(tmp_path, path, "drift.action=off", f"report={report_off}")) == 0
    capsys.readouterr()
    assert main(_sim(tmp_path, path, f"report={report_on}")) == 0
    out = " ".join(capsys.readouterr().out.split())  # (the line wraps at 120 columns)
    assert "host: decode step here 200.0 / 400.0 ms at 100 / 300 tokens (the factors from a " \
        "line through them) vs 100.0 / 200.0 ms" in out
    assert "x 2.000 / 2.000, step times x the factor at their context" in out
    off, on = (json.loads(p.read_text())["rows"][0] for p in (report_off, report_on))
    assert "hardware_drift" not in off
    assert (on["hardware_drift"], on["hardware_drift_factor"]) == ("rescaled", 2.0)
    assert on["tpot_s"] == pytest.approx(2 * off["tpot_s"])  # each later step twice as long
    assert on["prefill_s"] == pytest.approx(2 * off["prefill_s"])
    assert main(_sim(tmp_path, path, "drift.action=refuse")) != 0
    assert "beyond drift.tolerance_pct=10%" in capsys.readouterr().err


def test_a_step_line_through_noisy_medians():
    # 129 ms at 256, 113 at 1024, 132 at 1536, 199 at 2048 (a calibration on a busy day)
    fit = fit_step_line([256, 1024, 1536, 2048], [0.129, 0.113, 0.132, 0.199])
    assert fit["s_per_token"] > 0
    assert all(b >= a for a, b in zip(fit["s"], fit["s"][1:], strict=False))  # monotone
    assert fit["residual_max_pct"] > 5  # the medians are far from any line: it says so
    exact = fit_step_line([100, 300], [0.1, 0.2])  # two points: the line through them
    assert (exact["fixed_s"], exact["s_per_token"]) == (pytest.approx(0.05),
                                                        pytest.approx(0.0005))
    assert exact["residual_rms_pct"] == pytest.approx(0.0, abs=1e-9)
    falling = fit_step_line([100, 300], [0.2, 0.1])  # a falling step is noise: flat
    assert falling["s_per_token"] == 0.0 and falling["s"] == [pytest.approx(0.15)] * 2
    one = fit_step_line([100], [0.3])
    assert one["s"] == [0.3] and one["s_per_token"] == 0.0
    with pytest.raises(ValueError, match="finite"):
        fit_step_line([1, 2], [0.1, math.nan])


def test_fitted_curves_keep_their_medians():
    curve = fitted_curve({"context_tokens": [100, 200, 300], "s": [0.1, 0.25, 0.3]})
    assert curve["measured"] == [0.1, 0.25, 0.3]
    line = curve["fit"]
    assert curve["s"] == pytest.approx([line["fixed_s"] + line["s_per_token"] * c
                                        for c in (100, 200, 300)])
    verify = fitted_curve({"context_tokens": [100, 300], "drafted_tokens": [1, 2],
                           "s": [[0.3, 0.5], [0.4, 0.4]]})
    assert verify["s"] == [pytest.approx([0.3, 0.45]), pytest.approx([0.4, 0.45])]
    assert len(verify["fit"]) == 2 and verify["measured"] == [[0.3, 0.5], [0.4, 0.4]]
    single = {"context_tokens": 300, "batch": [1, 2], "s": [0.2, 0.3]}
    assert fitted_curve(single) is single


def test_the_receivers_ratio_leaves_the_step_a_non_decreasing_line():
    """The receiver's ratio, interpolated between two noisy medians (1.03 at 1024 tokens,
    0.90 at 2048), would bend the fitted step down between them: the scaled curves are
    fitted again, and the fit scales with any later constant factor."""
    from kvsim.calibrate.receiver_timing import apply_receiver_timing
    from kvsim.model.hardware_profile import scaled_curve

    ctx = [256, 1024, 2048, 4096]
    hw = {"tpot": fitted_curve({"context_tokens": ctx, "s": [0.073, 0.092, 0.111, 0.120]}),
          "first_step_extra": {"context_tokens": ctx, "s": [0.0] * 4},
          "tpot_batch": {"context_tokens": 4096, "batch": [1, 2], "s": [0.11, 0.2]},
          "verify": fitted_curve({"context_tokens": ctx, "drafted_tokens": [1],
                                  "s": [[0.13], [0.14], [0.18], [0.22]]})}
    timing = {"codecs": {"int8": {"decode_gb_per_s": 1.0, "what": "w"}}}
    line = hw["tpot"]["fit"]
    at = {c: line["fixed_s"] + line["s_per_token"] * c for c in (1024, 2048)}
    fit = {"int8": {"decode_gb_per_s": 1.0, "tpot_s": 1.03 * at[1024]}}
    top = {"int8": {"decode_gb_per_s": 1.0, "tpot_s": 0.90 * at[2048]}}
    apply_receiver_timing(top, hw, timing, 2048, fit=fit, fit_context_tokens=1024)
    for key in ("tpot", "verify"):
        s = hw[key]["s"] if key == "tpot" else [row[0] for row in hw[key]["s"]]
        assert all(b >= a for a, b in zip(s, s[1:], strict=False)), (key, s)
    assert hw["tpot"]["measured"] == [0.073, 0.092, 0.111, 0.120]  # the in-process medians
    doubled = scaled_curve(hw["tpot"], 2.0)
    assert doubled["fit"]["s_per_token"] == pytest.approx(2 * hw["tpot"]["fit"]["s_per_token"])


def test_the_heldout_grid_is_off_the_full_grid_and_its_calibration():
    from kvsim.fidelity.validation import Config

    full, held = Config(model=None), Config(model=None, grid="heldout")
    held.apply_grid()
    assert not set(held.contexts) & {256, 1024, 2048, 4096, *full.contexts}
    assert not set(held.rates_gbps) & {0.1, 0.3, 0.5, 0.8, 1.0, *full.rates_gbps}
    assert held.calibration_contexts == full.contexts  # calibrated on the full grid's
    assert held.multi.context_tokens not in held.calibration_contexts


@pytest.mark.parametrize("calibrate,action,probed,recorded", [
    (True, "rescale", False, "calibrated_in_run"),
    (True, "off", False, "off"),
    (False, "rescale", True, "rescaled"),
])
def test_validate_probes_only_profiles_it_did_not_calibrate(tmp_path, monkeypatch, calibrate,
                                                           action, probed, recorded):
    """Profiles calibrated by this very run are not probed (two probes minutes apart differ by
    their own noise, and a rescale by it would move every decode-bound metric); a profile
    from elsewhere is, and a slow probe rescales it; the rows record which."""
    from kvsim.fidelity import validation
    from kvsim.fidelity.runner import Profiles

    path, _ = _profile(tmp_path, {**fingerprint(), "decode_step_probe": {
        "context_tokens": 100, "steps": 16, "s": 0.1}})
    probe = FakeProbe(2.0)
    # (validate probes in a process of its own: SubprocessStepProbe)
    monkeypatch.setattr(host_probe, "SubprocessStepProbe", lambda model, steps, threads: probe)
    cfg = validation.Config(model=MODEL, calibrate=calibrate, drift=DriftConfig(action=action))
    timing, link = _companions(tmp_path, "hw")  # calibrated with it (its name: the file's)
    profiles = Profiles(hardware=path, codec_timing=timing, links={"token_bucket": link})
    used, drift = validation._drift(cfg, profiles, tmp_path / "run")
    assert bool(probe.asked) == probed and (drift is not None) == probed
    assert validation._drift_keys(cfg, drift)["hardware_drift"] == recorded
    out = tmp_path / "run" / "profiles-rescaled"
    assert used.hardware == (out / "hw.json" if probed else path)
    if not probed:
        assert (used.codec_timing, used.links) == (timing, {"token_bucket": link})
        return
    # rescaled with it, by the shortest context's factor (x 2: rates halve, times double)
    got = json.loads(used.codec_timing.read_text())["codecs"]["int8"]
    assert used.codec_timing == out / "codec_timing" / timing.name
    assert (got["encode_gb_per_s"], got["decode_gb_per_s"], got["layer_job_fixed_s"],
            got["threads"]) == (pytest.approx(0.5), pytest.approx(0.25), pytest.approx(0.002), 1)
    assert json.loads(used.links["token_bucket"].read_text())["draft_step"] == \
        {"ratio": 1.5, "ingest_s_per_byte": pytest.approx(4e-8)}
    assert drift.companions == ["codec_timing", "link token_bucket"]


def test_validate_probes_again_after_the_comparisons_and_keeps_the_figures_only(
        tmp_path, monkeypatch):
    """The probe after the comparisons is taken as the one before (in a process of its
    own, against the profile as found) whatever the tolerance or action: its factors go to
    the summary's step-level check (kvsim.fidelity.step_level), nothing is rescaled,
    written or refused (outcome "measured"); none with drift.action=off."""
    from kvsim.fidelity import validation
    from kvsim.fidelity.step_level import step_level

    path, _ = _profile(tmp_path, None)
    probe = FakeProbe(1.5, 1.25)  # far beyond a 10% tolerance
    monkeypatch.setattr(host_probe, "SubprocessStepProbe", lambda model, steps, threads: probe)
    before = set(tmp_path.rglob("*"))
    for action in ("rescale", "refuse"):
        cfg = validation.Config(model=MODEL, drift=DriftConfig(action=action))
        after = validation._probe_after(cfg, path, tmp_path / "run")
        assert after.outcome == "measured" and after.profile == str(path)
        assert after.factors == [pytest.approx(1.5), pytest.approx(1.25)]
        assert "measured only" in after.words()
    assert set(tmp_path.rglob("*")) == before  # nothing written
    assert validation._probe_after(validation.Config(model=MODEL,
                                                     drift=DriftConfig(action="off")),
                                   path, tmp_path / "run") is None
    # against a probe before at the profile's level, the host moved by 50%
    level = step_level(4.0, 10.0, None, after.as_dict())
    assert level.moved_pct == pytest.approx(50.0) and level.trusted


def _companions(folder: Path, hardware: str, source: str = "measured",
                commit: str = "abc") -> tuple[Path, Path]:
    """A codec timing and a link profile as `kvsim calibrate` writes them beside a hardware
    profile named `hardware` (_profile's: that run's commit, minutes after it)."""
    run = {"git": {"git_commit": commit}, "measured_utc": "2026-11-29T03:27:12Z"}
    timing = folder / "codecs.json"
    timing.write_text(json.dumps({**run, "version": 1, "hardware": hardware, "source": source,
                                  "codecs": {"int8": {"encode_gb_per_s": 1.0,
                                                      "decode_gb_per_s": 0.5,
                                                      "layer_job_fixed_s": 0.001,
                                                      "threads": 1}}}))
    link = folder / "link.json"
    link.write_text(json.dumps({**run, "name": f"{hardware}-token-bucket", "efficiency": 0.9,
                                "draft_step": {"ratio": 1.5, "ingest_s_per_byte": 2e-8}}))
    return timing, link


def test_files_not_calibrated_with_the_profile_are_not_rescaled_with_it(tmp_path):
    """A codec timing of another hardware name, a stated assumption or another calibration
    run (another commit), and a link profile of another profile's name or emulation, stay
    as they are: they say nothing of this host's day. A re-simulation's `only` rescales what
    its run did, whatever the files say."""
    from kvsim.calibrate.host_probe import rescale_companions

    path, doc = _profile(tmp_path, {**fingerprint(), "cpu_model": "Some Other CPU"})
    drift = check_drift(path, MODEL, DriftConfig(), tmp_path / "out", FakeProbe(2.0))
    out = tmp_path / "o"
    timing, link = _companions(tmp_path, "another")
    assert rescale_companions(drift, doc, timing, {"token_bucket": link}, out) == \
        (timing, {"token_bucket": link})
    for kind in ({"source": "assumed"}, {"commit": "another run"}):
        timing, link = _companions(tmp_path, "hw", **kind)
        assert rescale_companions(drift, doc, timing, {}, out) == (timing, {})
    _, link = _companions(tmp_path, "hw")
    assert rescale_companions(drift, doc, None, {"tc": link}, out) == (None, {"tc": link})
    assert drift.companions == [] and not out.exists()
    timing, _ = _companions(tmp_path, "hw", commit="another run")
    got, _ = rescale_companions(drift, doc, timing, {}, out, only=["codec_timing"])
    assert got == out / "codec_timing" / "codecs.json" and drift.companions == ["codec_timing"]


def test_a_subprocess_probe_times_the_step_in_a_process_of_its_own():
    """kvsim validate probes in a process of its own (SubprocessStepProbe): the step comes
    back from it; a failing or overlong probe is an error naming why."""
    from kvsim.calibrate.host_probe import SubprocessStepProbe
    from kvsim.model.presets import load_model_preset

    tiny = load_model_preset("tiny-random")
    assert 0 < SubprocessStepProbe(tiny, steps=3).step_s(32) < 5
    short, long = SubprocessStepProbe(tiny, steps=3).steps_s([32, 96])  # interleaved
    assert 0 < short < 5 and 0 < long < 5
    with pytest.raises(RuntimeError, match=r"(?s)probe failed \(exit 1\).*ValueError"):
        SubprocessStepProbe(tiny, steps="x").step_s(32)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="took over 0.01 s"):
        SubprocessStepProbe(tiny, steps=3, timeout_s=0.01).step_s(32)


def test_kvsim_emulate_rescales_a_profile_from_another_host(tmp_path, monkeypatch, capsys):
    """kvsim emulate checks the host as kvsim sim does, probing in a process of its own: the
    modelled prefill of a profile read on a host that decodes twice as slowly takes twice
    as long on both ends, the rows say so; refuse exits before anything is emulated."""
    path, _ = _profile(tmp_path, {**fingerprint(), "cpu_model": "Some Other CPU"},
                       model="tiny-random")
    probe = FakeProbe(2.0)
    monkeypatch.setattr(host_probe, "SubprocessStepProbe", lambda model, steps, threads: probe)
    monkeypatch.setattr(host_probe, "StepProbe", None)  # never in the emulating process

    def emulate(*extra: str) -> dict:
        report = tmp_path / f"{len(extra)}-{extra[-1] if extra else ''}.json"
        assert main(["emulate", "model=tiny-random", "hardware=local-cpu",
                     f"hardware.profile={path}", "codecs=[int8]",
                     "workload.context_tokens=100", "workload.output_tokens=2",
                     "transport.kv_source=synthetic", "transport.decode=timing",
                     f"report={report}", f"hydra.run.dir={tmp_path}/run", *extra]) == 0
        return json.loads(report.read_text())["rows"][0]

    off, on = emulate("drift.action=off"), emulate()
    assert probe.asked == [[100, 300]]  # once, at the profile's probe contexts
    assert "hardware_drift" not in off
    assert (on["hardware_drift"], on["hardware_drift_factor"]) == ("rescaled", 2.0)
    # the modelled prefill: 1.0 s in the profile at 100 tokens, slept for real
    assert off["prefill_s"] == pytest.approx(1.0, abs=0.1)
    assert on["prefill_s"] == pytest.approx(2.0, abs=0.1)
    assert "prefill x 2.000" in " ".join(capsys.readouterr().out.split())
    assert main(["emulate", "model=tiny-random", "hardware=local-cpu",
                 f"hardware.profile={path}", "drift.action=refuse",
                 f"hydra.run.dir={tmp_path}/refused"]) != 0
    assert "beyond drift.tolerance_pct=10%" in capsys.readouterr().err


def test_processes_sharing_checks_probe_once_and_share_the_outcome(tmp_path, monkeypatch):
    """check_host inside shared_checks: the first of several concurrent checks of one
    profile probes, the others read its result (the same factor, the same rescaled copy);
    another profile is checked apart; a refusal is every sharer's."""
    import threading

    from kvsim.calibrate.host_probe import DriftRefused, check_host, shared_checks
    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig

    monkeypatch.chdir(tmp_path)  # a check outside the block writes into the current directory
    path, _ = _profile(tmp_path, {**fingerprint(), "cpu_model": "Some Other CPU"},
                       model="tiny-random")
    probes: list[FakeProbe] = []
    started = threading.Barrier(4, timeout=10)

    def make(model, steps, threads):
        probes.append(FakeProbe(2.0))
        return probes[-1]

    monkeypatch.setattr(host_probe, "StepProbe", make)

    def config(*extra: str) -> SimConfig:
        cfg, _ = compose("sim", ["scenario=none", "model=tiny-random", "hardware=local-cpu",
                                 f"hardware.profile={path}", *extra], SimConfig)
        return cfg

    got: list = []

    def job(cfg: SimConfig) -> None:
        started.wait()
        got.append((check_host(cfg, "test"), cfg.hardware.profile))

    # (the block is this process's: its threads check side by side, each taking the lock
    # through a file of its own, as the sweep's job processes do)
    with shared_checks(tmp_path / "shared"):
        threads = [threading.Thread(target=job, args=(config(),)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(probes) == 1 and len(got) == 4
    assert {(d.outcome, d.factor, profile) for d, profile in got} == \
        {("rescaled", 2.0, got[0][0].profile)}
    assert Path(got[0][1]).is_file() and str(tmp_path / "shared") in got[0][1]
    with shared_checks(tmp_path / "shared"):  # other settings: a check of their own
        assert check_host(config("drift.tolerance_pct=150"), "test").outcome == "within"
        assert len(probes) == 2
        for _ in range(2):
            with pytest.raises(DriftRefused, match="beyond"):
                check_host(config("drift.action=refuse"), "test")
        assert len(probes) == 3
    alone = check_host(config(), "test")  # outside the block: a check of its own again
    assert len(probes) == 4
    assert alone.profile == str(tmp_path / "profiles-rescaled" / "hw.json")


def test_a_sweep_probes_once_for_all_its_points(tmp_path, monkeypatch):
    path, _ = _profile(tmp_path, {**fingerprint(), "cpu_model": "Some Other CPU"},
                       model="tiny-random")
    probes: list[FakeProbe] = []

    def make(model, steps, threads):
        probes.append(FakeProbe(2.0))
        return probes[-1]

    monkeypatch.setattr(host_probe, "StepProbe", make)
    sweep_dir = tmp_path / "sweep"
    assert main(["sweep", *_sim(tmp_path, path)[1:-1], "link.bandwidth_gbps=10,25",
                 "hydra/launcher=basic", f"hydra.sweep.dir={sweep_dir}"]) == 0
    assert len(probes) == 1
    rows = [row for p in sorted((sweep_dir / "points").glob("*.json"))
            for row in json.loads(p.read_text())["rows"]]
    assert len(rows) == 2
    assert {(r["hardware_drift"], r["hardware_drift_factor"]) for r in rows} == \
        {("rescaled", 2.0)}


def test_a_re_simulation_rescales_what_its_run_rescaled(tmp_path):
    """measured_from= applies the saved run's factors again, and rescales the codec timing
    and links its run rescaled with them (the saved `companions`), nothing more; a run that
    rescaled its hardware profile alone (no `companions`) gets that alone."""
    from kvsim.fidelity import validation
    from kvsim.fidelity.runner import Profiles

    path, doc = _profile(tmp_path, {**fingerprint(), "cpu_model": "Some Other CPU"})
    timing, link = _companions(tmp_path, "hw")
    profiles = Profiles(hardware=path, codec_timing=timing, links={"token_bucket": link})
    drift = check_drift(path, MODEL, DriftConfig(), tmp_path / "out", FakeProbe(2.0, 1.5))
    drift.companions = ["codec_timing"]  # what the saved run rescaled
    report = {"fidelity": {"drift": drift.as_dict()}}
    again = validation._saved_drift(report, profiles, tmp_path / "again")
    assert json.loads(again.hardware.read_text())["tpot"]["s"] == \
        pytest.approx([0.11 * 2.0, 0.22 * 1.5])
    codec = json.loads(again.codec_timing.read_text())["codecs"]["int8"]
    assert codec["encode_gb_per_s"] == pytest.approx(0.5)
    assert again.links == {"token_bucket": link}  # not rescaled by that run: not now either
    old = {k: v for k, v in drift.as_dict().items()
           if k not in ("probed_context_tokens", "probes_s", "profiles_s", "factors",
                        "companions")}
    again = validation._saved_drift({"fidelity": {"drift": old}}, profiles, tmp_path / "old")
    assert json.loads(again.hardware.read_text())["tpot"]["s"] == \
        pytest.approx([0.22, 0.44])  # one factor, its shortest context's
    assert (again.codec_timing, again.links) == (timing, {"token_bucket": link})
