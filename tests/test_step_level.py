"""The decode-step level check of a validation (kvsim.fidelity.step_level): the scenarios'
own steps against the simulated one decide; the host probes before and after say why."""

from __future__ import annotations

import math

import pytest

from kvsim.calibrate.host_probe import Drift
from kvsim.fidelity.step_level import step_level
from kvsim.fidelity.validation import _level_from_scenario


def _drift(factors, contexts=(256, 1024, 2048, 4096), outcome="within"):
    """A saved drift check (Drift.as_dict, as the summary keeps it) of a profile whose
    step is 40 ms at every context, probed `factors` x that."""
    probes = [0.04 * f for f in factors]
    return Drift(factors[0], probes[0], 0.04, "its host's probe", contexts[0], outcome, {}, {},
                 "hw.json", list(contexts), probes, [0.04] * len(factors),
                 list(factors)).as_dict()


def test_a_level_the_scenarios_decoded_at_is_trusted():
    level = step_level(2.0, 10.0, _drift([1.01, 1.0, 0.99, 1.0]),
                       _drift([1.03, 1.02, 1.0, 1.01]))
    assert level.trusted
    assert level.moved_pct == pytest.approx(2.0)  # 1.02 / 1.0 at 1024 tokens
    words = level.words()
    assert words.startswith("step level held") and "held still" in words
    assert level.as_dict()["trusted"] is True


def test_a_probe_that_missed_the_scenarios_spell_is_not_trusted_and_says_why():
    # the 2026-11-29 23:37 case: the probe before x1.16, the scenarios at the profile's
    # speed (step 21% late), the probe after back at the profile's
    level = step_level(21.2, 10.0, _drift([1.16, 1.16, 1.16, 1.16], outcome="rescaled"),
                       _drift([1.0, 1.01, 0.99, 1.0], outcome="measured"))
    assert not level.trusted
    assert level.moved_pct == pytest.approx((1 - 0.99 / 1.16) * 100)  # at 2048 tokens
    words = level.words()
    assert "not the scenarios' host" in words and "the host moved during the run" in words
    assert "measured_from=<this run> step_from_scenario=true" in words  # the model alone
    named = step_level(21.2, 10.0, None, None, run="outputs/x").words()
    assert "measured_from=outputs/x step_from_scenario=true" in named


def test_a_steady_host_whose_probes_both_missed_is_still_not_trusted():
    level = step_level(15.0, 10.0, _drift([1.2, 1.2, 1.2, 1.2]),
                       _drift([1.18, 1.19, 1.2, 1.21]))
    assert not level.trusted and "both missed" in level.words()


def test_calibrated_in_the_run_compares_the_probe_after_with_1():
    level = step_level(3.0, 10.0, None, _drift([1.15, 1.15, 1.12, 1.1]))
    assert level.before == [] and level.moved_pct == pytest.approx(15.0)
    assert "1 (calibrated in this run)" in level.words()
    assert level.trusted  # the scenarios' steps decide, not the probe


def test_the_level_taken_from_the_scenarios_holds_by_construction():
    level = step_level(25.0, 10.0, None, None, from_scenario=True)
    assert level.trusted and "own decode steps" in level.words()
    assert "25.0%" in level.words()  # the calibrated step's own error, reported


def test_without_steps_or_probes_nothing_contradicts_the_level():
    level = step_level(math.nan, 10.0, None, None)
    assert level.trusted and math.isnan(level.moved_pct)
    assert "no decode steps" in level.words()


def test_probes_of_other_contexts_are_not_set_side_by_side():
    level = step_level(2.0, 10.0, _drift([1.0, 1.0], (256, 1024)),
                       _drift([1.3, 1.3, 1.3], (256, 1024, 2048)))
    assert level.after == [] and math.isnan(level.moved_pct)


def test_an_older_drift_record_with_one_factor_is_read():
    old = {k: v for k, v in _drift([1.2], (256,)).items()
           if k not in ("probed_context_tokens", "probes_s", "profiles_s", "factors")}
    level = step_level(2.0, 10.0, old, _drift([1.26], (256,)))
    assert (level.contexts, level.before, level.after) == ([256], [1.2], [1.26])
    assert level.moved_pct == pytest.approx(5.0)


def test_the_level_is_the_scenarios_only_when_every_single_row_took_it():
    single = {"case": "single", "step_level_from": "scenario"}
    assert _level_from_scenario([single, {"case": "multi"}])
    assert not _level_from_scenario([single, {"case": "single", "step_level_from": "probe"}])
    assert not _level_from_scenario([{"case": "single"}])
    assert not _level_from_scenario([{"case": "multi"}])
