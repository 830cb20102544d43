"""Whether a validation's decode-step level describes the host its scenarios ran on.

A validation's simulated times are built on one level of the decode step: the hardware
profile's, rescaled by the host probe taken before anything is compared (kvsim.model.host),
or the calibration's own when it was calibrated in the same run. A probe of ~12 s samples
one spell of a shared host: on 2026-11-29 one landed 16% above the scenarios' speed that
followed, and every decode-bound metric came out ~21% late, with nothing in the report
saying that the errors were the host's minute and not the model's.

Two checks after the comparisons, both cheap:
  - the scenarios' own decode steps (each single-request row's `tpot_measured_s`) against
    the simulated one (`tpot_simulated_s`): their mean |difference| within the tolerance
    (validate's step_level_tolerance_pct, 5%: the mean-error target, as a step off by more
    moves every decode-bound metric by about as much), or the level is not the scenarios'
    host (the verdict);
  - a second probe, as the first was taken, against the profile: its factors beside the
    first probe's (1.0 where the profiles were calibrated in the run) say whether the host
    itself moved during the run or the first probe missed its spell (the reason given).

A level that fails the first check makes the run's verdict "not met" with the reason, and
names the re-simulation that compares the model with each scenario's own step level
(`measured_from=<run> step_from_scenario=true`, seconds, no emulation).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass
class StepLevel:
    """The step level's check over one validation."""

    step_mean_abs_pct: float  # simulated step vs the scenarios' measured steps, mean |%|
    tolerance_pct: float  # validate's step_level_tolerance_pct
    # the probe before the comparisons: its factor (step here / profile's) at each probed
    # context; empty where none was taken (profiles calibrated in the run: level 1.0)
    contexts: list[int] = field(default_factory=list)
    before: list[float] = field(default_factory=list)
    # the probe after them, against the same profile; empty where none was taken
    after: list[float] = field(default_factory=list)
    # the compared simulations took their level from each scenario's own measured steps
    # (step_from_scenario=true): the level holds by construction, and step_mean_abs_pct is
    # the calibrated step's own error, reported only
    from_scenario: bool = False
    run: str = ""  # the run's directory (or the saved run re-simulated), named in the words

    @property
    def trusted(self) -> bool:
        """The scenarios decoded at the simulated level, within the tolerance (a run
        without single-request steps to compare has nothing to contradict it)."""
        return self.from_scenario or not math.isfinite(self.step_mean_abs_pct) or \
            self.step_mean_abs_pct <= self.tolerance_pct

    @property
    def moved_pct(self) -> float:
        """The largest change (%) of the host's step from the probe before to the probe
        after, over the probed contexts (nan without the probe after)."""
        if not self.after:
            return math.nan
        before = self.before or [1.0] * len(self.after)
        return max(abs(a / b - 1.0) * 100.0 for a, b in zip(self.after, before, strict=True))

    def words(self) -> str:
        """One line for the log and the summary."""
        if self.from_scenario:
            level = ("taken from each scenario's own decode steps (step_from_scenario); the "
                     f"calibrated step {self.step_mean_abs_pct:.1f}% from them on average")
        elif not math.isfinite(self.step_mean_abs_pct):
            level = "no decode steps measured in single-request scenarios to check it against"
        else:
            level = (f"the scenarios' decode steps {self.step_mean_abs_pct:.1f}% from the "
                     f"simulated one on average (tolerance {self.tolerance_pct:g}%)")
        probes = ""
        if self.after:
            before = (" / ".join(f"{f:.3f}" for f in self.before) if self.before
                      else "1 (calibrated in this run)")
            moved = self.moved_pct
            probes = (f"; the host probe before the comparisons x {before}, after them x "
                      f"{' / '.join(f'{f:.3f}' for f in self.after)} the profile's at "
                      f"{' / '.join(map(str, self.contexts))} tokens: "
                      + ("the host moved during the run" if moved > self.tolerance_pct else
                         "the host held still by the probes"
                         + ("" if self.trusted else
                            ", and both missed the scenarios' spells")))
        if self.trusted:
            return f"step level held: {level}{probes}"
        return (f"step level not the scenarios' host: {level}{probes}. These errors measure "
                f"the host's minute as much as the model; `kvsim validate measured_from="
                f"{self.run or '<this run>'} step_from_scenario=true` compares the model with "
                "each scenario's own step level (seconds, nothing emulated)")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "trusted": self.trusted,
                "moved_pct": self.moved_pct, "words": self.words()}


def step_level(step_mean_abs_pct: float, tolerance_pct: float, before: dict | None,
               after: dict | None, from_scenario: bool = False, run: str = "") -> StepLevel:
    """The check from the summary's step error and the two probes' saved drift checks
    (Drift.as_dict; before: None where the profiles were calibrated in the run; after: None
    where no second probe was taken). Probes of different contexts are not set side by
    side."""
    from kvsim.calibrate.host_probe import Drift

    contexts, before_f = Drift.from_dict(before).points() if before else ([], [])
    after_contexts, after_f = Drift.from_dict(after).points() if after else ([], [])
    if after_f and before_f and after_contexts != contexts:
        after_f = []
    return StepLevel(step_mean_abs_pct, tolerance_pct, contexts or after_contexts,
                     before_f, after_f, from_scenario, run)


__all__ = ["StepLevel", "step_level"]
