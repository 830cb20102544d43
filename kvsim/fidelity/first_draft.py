"""A drafted scenario's first draft step: measured, replayed on the emulator's own worker, and
simulated.

Where the two engines decide a split-stream request's drafting differently
(kvsim.fidelity.drafting), the decision turns on when a draft step ends against when the
full cache is ready, and the first draft step is most of that. Three figures say which part
of the simulator missed it, each the time from the anchor's cache ready to the end of the
first draft step (its drafted token's time, accepted or not; s, the mean over the requests
that drafted; both engines' rows give `first_draft_from_prefill_end_s`, from the decode
timeline):

- measured: the emulator's;
- replayed: the measured time plus the mean miss of the calibrated draft-step model
  (kvsim.calibrate.draft_ingest: busy_ratio, ingest_s_per_byte and the first step's extra,
  from the profiles the simulator ran on) replayed on each emulated request's own worker
  jobs, later-stream arrivals and plain decode step (requests whose spans do not give a
  draft window, or whose first step's end is unrecorded, are left out of the mean miss);
- simulated: the simulator's, the mean over its samples.

replayed - measured is the draft-step model's own miss, given what happened on the receiver;
simulated - replayed is what the simulator projected differently: the worker's jobs and the
later streams' arrivals, its decode step's level and the anchor's cache build. Lynx over
`tc` at 0.6 Gbps and 1,536 tokens, drafted twice by the simulator and once by the emulator in
two held-out runs of 2026-12-07 (CHANGELOG.md): 131 ms measured, 125 replayed, 105 simulated
in one (the simulator's worker projected busy 0.64 of the step, the emulator's 0.76-0.82),
124, 114 and 117 in the other (the model's own miss).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.core.report import finite_number

__all__ = ["KEYS", "DraftModel", "draft_model", "draft_model_of", "first_draft_keys",
           "measured_keys", "simulated_s"]

KEYS = ("first_draft_measured_s", "first_draft_replayed_s", "first_draft_simulated_s")


@dataclass(frozen=True)
class DraftModel:
    """The simulator's draft-step model of one scenario (kvsim.calibrate.draft_ingest)."""

    busy_ratio: float  # a draft step over a decode step while the receiver is fully busy
    ingest_s_per_byte: float  # receiver busy time per later-stream byte (s/B)
    extra_s: float  # the first step's extra on a fresh cache at the scenario's context (s)


def draft_model(hardware: Path | str, link: Path | str | None, model_name: str,
                context_tokens: int) -> DraftModel | None:
    """The draft-step model the simulator applies to a scenario over `link`: the link
    profile's draft step where it describes the run (kvsim.scenario.link_profile
    .draft_step_for), else the hardware profile's; None where it has no busy_ratio (no
    worker beside the drafts was measured: nothing to replay)."""
    from kvsim.scenario.link_profile import draft_step_for, load_link_profile

    doc = json.loads(Path(hardware).read_text())
    draft = draft_step_for(load_link_profile(str(link)), model_name, str(hardware)) \
        if link else None
    if draft is None:
        draft = doc.get("draft_step")
    if not isinstance(draft, dict) or (finite_number(draft.get("busy_ratio")) or 0.0) <= 0:
        return None
    curve = doc.get("first_step_extra")
    extra_s = float(np.interp(context_tokens, curve["context_tokens"], curve["s"])) \
        if isinstance(curve, dict) else 0.0
    return DraftModel(float(draft["busy_ratio"]),
                      float(draft.get("ingest_s_per_byte") or 0.0), extra_s)


def draft_model_of(sim_overrides: list[str], model_name: str,
                   context_tokens: int) -> DraftModel | None:
    """draft_model of the profiles a simulation's overrides name (`hardware.profile=`,
    `link.profile=`: after a step probe's or a drift's rescale, the rescaled copies); None
    where they name no hardware profile file."""
    given = dict(o.split("=", 1) for o in sim_overrides if "=" in o)
    hardware = given.get("hardware.profile", "")
    if not hardware or not Path(hardware).is_file():
        return None
    return draft_model(hardware, given.get("link.profile") or None, model_name,
                       context_tokens)


def _anchor_to_first_draft_s(row: dict) -> float:
    """Anchor cache ready -> the first draft step's end (s) of a row that drafted; nan
    otherwise. An emulated row measured before rows gave first_draft_from_prefill_end_s:
    its first draft step's end from arrival, less its prefill end from arrival."""
    if (finite_number(row.get("proposed_tokens")) or 0.0) <= 0:
        return math.nan
    anchor = row.get("anchor_ready_from_prefill_end_s")
    first = row.get("first_draft_from_prefill_end_s")
    if finite_number(first) is None:
        steps = row.get("draft_steps_from_arrival_s")
        ttft, ttft_pe = row.get("ttft_s"), row.get("ttft_from_prefill_end_s")
        if not (isinstance(steps, list) and steps and None not in
                (finite_number(steps[0]), finite_number(ttft), finite_number(ttft_pe))):
            return math.nan
        first = float(steps[0]) - (float(ttft) - float(ttft_pe))
    if finite_number(anchor) is None:
        return math.nan
    return float(first) - float(anchor)


def _replay_miss_s(row: dict, model: DraftModel) -> float:
    """The model's replayed first-draft-step end minus the measured one (s) on a request's
    own spans (kvsim.calibrate.draft_ingest); nan where its spans give no draft window or
    do not record its first step's end, or are malformed."""
    from kvsim.calibrate.draft_ingest import replay_step_ends_s, windows_from_rows

    try:
        windows = windows_from_rows([row])
        if not windows:
            return math.nan
        w = windows[0]
        if not w.step_ends_s and w.drafts != 1:  # its first step's end unrecorded
            return math.nan
        ends = replay_step_ends_s(w, model.busy_ratio, model.ingest_s_per_byte, model.extra_s)
        return float(ends[0]) - (w.step_ends_s[0] if w.step_ends_s else w.end_s)
    except (ValueError, KeyError, TypeError, IndexError):  # a malformed row: no replay
        return math.nan


def measured_keys(measured: dict, model: DraftModel | None) -> dict:
    """first_draft_measured_s and first_draft_replayed_s of an emulated codec's row (the
    aggregate's `per_request` rows, or the row itself where it is one request's); {} where
    none of its requests drafted, the replay None without a model or a request it could
    replay."""
    rows = measured.get("per_request") or [measured]
    times, misses = [], []
    for row in rows:
        if not isinstance(row, dict) or row.get("status") not in ("done", None):
            continue
        t = _anchor_to_first_draft_s(row)
        if not math.isfinite(t):
            continue
        times.append(t)
        miss = _replay_miss_s(row, model) if model is not None else math.nan
        if math.isfinite(miss):
            misses.append(miss)
    if not times:
        return {}
    mean = sum(times) / len(times)
    return {"first_draft_measured_s": mean,
            "first_draft_replayed_s": mean + sum(misses) / len(misses) if misses else None}


def simulated_s(simulated: dict) -> float | None:
    """first_draft_simulated_s of a simulated codec's row (its means over samples); None
    where it did not draft."""
    t = _anchor_to_first_draft_s(simulated)
    return t if math.isfinite(t) else None


def first_draft_keys(measured: dict, simulated: dict, model: DraftModel | None) -> dict:
    """The three KEYS of one codec's scenario where either engine drafted, else {}."""
    keys = measured_keys(measured, model)
    sim = simulated_s(simulated)
    if not keys and sim is None:
        return {}
    return {"first_draft_measured_s": keys.get("first_draft_measured_s"),
            "first_draft_replayed_s": keys.get("first_draft_replayed_s"),
            "first_draft_simulated_s": sim}
