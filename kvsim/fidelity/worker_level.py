"""Whether the receiver's on-arrival worker ran at the calibrated pace in a validation's
scenarios.

The simulator's worker jobs take the codec timing's time x the link profile's `worker_pace`
(alone x (1 + encoder share x E + ingest share x G): kvsim.calibrate.worker_pace), fitted on
the calibration's transfers. On the 2-core host that pace moves between a calibration and
the scenarios minutes later by far more than the decode step does: over four held-out
runs of 2026-12-07, a scenario's layer jobs took 0.87-1.46 x what the calibrated pace gives
for the same jobs (the scenarios of one run up to 0.5 apart, the codecs of one scenario
mostly within 0.1-0.3; CHANGELOG.md, 2026-12-07), where their decode steps stayed within
2-5% of the calibrated one on average. The worker's pace sets how busy the receiver is while
a split-stream request drafts, so it moves the drafting decisions and the first draft's
step.

A scenario's **worker level** is the sum of its emulated requests' on-arrival layer jobs
over the sum of what the simulator's pace gives for those same jobs (each job's own codec,
stream and shares of encoder and arrivals, from its trace spans): 1.0 where the worker ran
at the calibrated pace. It is measured against the profiles the scenario's simulation ran on
(a step level's rescaled codec timing where it had one).

The check reports the levels (mean and worst |level - 1| against a tolerance; it does not
change the verdict: the worker moves only the on-arrival and split-stream metrics, which the
errors show) and, where they are off, names the re-simulation that runs each scenario's
simulator on its own worker level (`worker_from_scenario=true`: the link profile's
`worker_pace.alone` x the level, written beside the run).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsim.calibrate.worker_pace import FIELDS_MAX, job_samples
from kvsim.core.report import finite_number
from kvsim.model.spec import ModelSpec


def scenario_worker_level(measured: list[dict], codec_timing: Path, link_profile: Path,
                          model: ModelSpec) -> float | None:
    """The worker level of one scenario's emulated rows (each codec's row, its requests in
    `per_request`): their on-arrival layer jobs' measured seconds over the seconds the link
    profile's `worker_pace` gives them on `codec_timing`'s jobs. None where the rows have no
    on-arrival jobs or the link profile no worker pace for this model."""
    from kvsim.scenario.codec_timing import load_codec_timing

    pace = json.loads(Path(link_profile).read_text()).get("worker_pace")
    if not isinstance(pace, dict) or pace.get("model") not in (None, model.name):
        return None
    requests = [q for row in measured
                for q in (row.get("per_request") or [row]) if isinstance(q, dict)]
    table = load_codec_timing("", codec_timing)
    samples = job_samples(requests,
                          lambda r: table.lookup(str(r["codec"]), str(r["codec_name"])),
                          lambda tokens: model.kv_bytes_bf16(tokens) / model.layers)
    if not len(samples.job_s):
        return None
    predicted = samples.base_s * float(pace["alone"]) * (
        1 + float(pace["encoder"]) * samples.encoder_share
        + float(pace["ingest"]) * samples.ingest_share)
    total = float(predicted.sum())
    return float(samples.job_s.sum()) / total if total > 0 else None


def paced_link_profile(link_profile: Path, level: float, out_path: Path,
                       record: dict) -> Path:
    """A copy of `link_profile` at out_path whose worker runs `level` x as slow
    (worker_pace.alone x level, within the profile's bound), `record` (where the level came
    from) kept under `worker_level`."""
    doc = json.loads(Path(link_profile).read_text())
    pace = doc.get("worker_pace")
    if not isinstance(pace, dict):
        raise ValueError(f"{link_profile} has no worker_pace to set a worker level on")
    if not (math.isfinite(level) and level > 0):
        raise ValueError(f"a worker level must be a positive number, got {level}")
    doc["worker_pace"] = {**pace, "alone": min(float(pace["alone"]) * level,
                                               FIELDS_MAX["alone"])}
    doc["worker_level"] = {**record, "level": level, "from_profile": str(link_profile)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    return out_path


@dataclass
class WorkerLevel:
    """The worker level's check over one validation's single-request scenarios."""

    # "<emulation> <rate> Gbps <context>" -> the scenario's level (measured / calibrated)
    levels: dict[str, float] = field(default_factory=dict)
    tolerance_pct: float = 10.0  # validate's worker_level_tolerance_pct
    # the compared simulations ran on each scenario's own level (worker_from_scenario)
    from_scenario: bool = False
    run: str = ""  # the run's directory (or the saved run re-simulated), named in the words
    # the run's scenario files are at hand, so a re-simulation can take each one's level
    resimulable: bool = True

    @property
    def mean_abs_pct(self) -> float:
        """Mean |level - 1| over the scenarios (%; nan without any)."""
        if not self.levels:
            return math.nan
        return 100.0 * sum(abs(v - 1.0) for v in self.levels.values()) / len(self.levels)

    @property
    def max_abs_pct(self) -> float:
        if not self.levels:
            return math.nan
        return 100.0 * max(abs(v - 1.0) for v in self.levels.values())

    @property
    def held(self) -> bool:
        """Every scenario's worker within the tolerance of the calibrated pace (or none to
        check)."""
        return not self.levels or self.max_abs_pct <= self.tolerance_pct

    def words(self) -> str | None:
        """One line for the log and the summary (None: no on-arrival jobs measured)."""
        if not self.levels:
            return None
        low, high = min(self.levels.values()), max(self.levels.values())
        worst = max(self.levels, key=lambda k: abs(self.levels[k] - 1.0))
        took = f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"
        level = (f"the scenarios' on-arrival layer jobs took {took} x what the simulated "
                 "worker's pace gives them (the calibrated pace, at the step level each "
                 f"simulation ran on; mean |difference| {self.mean_abs_pct:.1f}%, worst "
                 f"{self.max_abs_pct:.1f}% at {worst}; tolerance {self.tolerance_pct:g}%)")
        if self.from_scenario:
            return ("worker level taken from each scenario's own jobs "
                    f"(worker_from_scenario): {level}")
        if self.held:
            return f"worker level held: {level}"
        off = (f"worker level not the calibration's: {level}; the drafting and the "
               "split-stream rows measure the worker's minute as much as the model")
        if not self.resimulable:
            return (f"{off} (the run's scenario files, not kept with it, would let a "
                    "re-simulation take each scenario's own level)")
        return (f"{off}. `kvsim validate measured_from={self.run or '<this run>'} "
                "worker_from_scenario=true` runs each scenario's simulator on its own "
                "worker level (seconds, nothing emulated)")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "mean_abs_pct": self.mean_abs_pct,
                "max_abs_pct": self.max_abs_pct, "held": self.held, "words": self.words()}


def worker_level(rows: list[dict], tolerance_pct: float, run: str = "",
                 resimulable: bool = True) -> WorkerLevel:
    """The check from a validation's comparison rows: each single-request scenario's
    `worker_level` (the first of its rows that has one) and whether every one of them was
    simulated on it (`worker_level_from` "scenario"). resimulable: the run's scenario files
    are at hand (a re-simulation can take each one's level)."""
    levels: dict[str, float] = {}
    single = [r for r in rows if r.get("case") == "single"]
    for r in single:
        v = finite_number(r.get("worker_level"))
        if v is not None:
            levels.setdefault(f"{r['emulation']} {r['bandwidth_gbps']:g} Gbps "
                              f"{r['context_tokens']}", v)
    from_scenario = bool(single) and all(r.get("worker_level_from") == "scenario"
                                         for r in single)
    return WorkerLevel(levels, tolerance_pct, from_scenario, run, resimulable)


def level_keys(level: float | None, from_scenario: bool) -> dict[str, Any]:
    """A single-request row's worker-level keys: `worker_level` (None: not measured) and
    `worker_level_from`: "scenario" where its simulation ran on it (from_scenario asked and a
    level measured), else "calibration"."""
    return {"worker_level": level,
            "worker_level_from": "scenario" if from_scenario and level is not None
            else "calibration"}


__all__ = ["WorkerLevel", "level_keys", "paced_link_profile", "scenario_worker_level",
           "worker_level"]
