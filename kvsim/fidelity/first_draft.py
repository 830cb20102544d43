"""A drafted scenario's first draft step: measured, replayed on the emulator's own worker, and
simulated.

Where the two engines decide a split-stream request's drafting differently
(kvsim.fidelity.drafting), the decision turns on when a draft step ends against when the
full cache is ready, and the first draft step is most of that. Three figures say which part
of the simulator missed it, each the time from the anchor's cache ready to the first drafted
token (s, the mean over the requests that drafted):

- measured: the emulator's;
- replayed: the calibrated draft-step model (kvsim.calibrate.draft_ingest: busy_ratio,
  ingest_s_per_byte and the first step's extra, as the simulator applies them) replayed on
  each emulated request's own worker jobs, later-stream arrivals and plain decode step:
  its measured time plus the replayed minus the measured end of its first draft step
  (requests whose first step's end the row did not record are left out);
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

__all__ = ["KEYS", "DraftModel", "draft_model", "first_draft_keys", "measured_keys",
           "simulated_s"]

KEYS = ("first_draft_measured_s", "first_draft_replayed_s", "first_draft_simulated_s")


@dataclass(frozen=True)
class DraftModel:
    """The simulator's draft-step model of one scenario (kvsim.calibrate.draft_ingest)."""

    busy_ratio: float  # a draft step over a decode step while the receiver is fully busy
    ingest_s_per_byte: float  # receiver busy time per later-stream byte (s/B)
    extra_s: float  # the first step's extra on a fresh cache at the scenario's context (s)


def draft_model(hardware: Path, link: Path | None, model_name: str,
                context_tokens: int) -> DraftModel | None:
    """The draft-step model the simulator applies to a scenario over `link`: the link
    profile's draft step where it describes the run (kvsim.scenario.link_profile
    .draft_step_for), else the hardware profile's; None where it has no busy_ratio (no
    worker beside the drafts was measured: nothing to replay)."""
    from kvsim.scenario.link_profile import draft_step_for, load_link_profile

    doc = json.loads(Path(hardware).read_text())
    draft = draft_step_for(load_link_profile(str(link)), model_name, str(hardware)) \
        if link is not None else None
    if draft is None:
        draft = doc.get("draft_step")
    if not isinstance(draft, dict) or not _positive(draft.get("busy_ratio")):
        return None
    curve = doc.get("first_step_extra")
    extra_s = float(np.interp(context_tokens, curve["context_tokens"], curve["s"])) \
        if isinstance(curve, dict) else 0.0
    return DraftModel(float(draft["busy_ratio"]),
                      float(draft.get("ingest_s_per_byte") or 0.0), extra_s)


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) \
        and x > 0


def _anchor_to_first_draft_s(row: dict) -> float:
    """Anchor cache ready -> first drafted token (s) of a row that drafted; nan otherwise."""
    if not _positive(row.get("proposed_tokens")):
        return math.nan
    ttft, anchor = row.get("ttft_from_prefill_end_s"), row.get("anchor_ready_from_prefill_end_s")
    if not (_positive(ttft) and isinstance(anchor, (int, float)) and math.isfinite(anchor)):
        return math.nan
    return float(ttft) - float(anchor)


def measured_keys(measured: dict, model: DraftModel | None) -> dict:
    """first_draft_measured_s and first_draft_replayed_s of an emulated codec's aggregated
    row (its `per_request` rows); {} where none of its requests drafted, the replay None
    without a model or a request whose first step's end was recorded."""
    from kvsim.calibrate.draft_ingest import replay_step_ends_s, windows_from_rows

    times, replayed = [], []
    for row in measured.get("per_request") or []:
        if row.get("status") not in ("done", None):
            continue
        t = _anchor_to_first_draft_s(row)
        if not math.isfinite(t):
            continue
        times.append(t)
        if model is None:
            continue
        for w in windows_from_rows([row]):
            if not w.step_ends_s and w.drafts != 1:  # its first step's end unrecorded
                continue
            first_end = w.step_ends_s[0] if w.step_ends_s else w.end_s
            ends = replay_step_ends_s(w, model.busy_ratio, model.ingest_s_per_byte,
                                      model.extra_s)
            replayed.append(t + float(ends[0]) - first_end)
    if not times:
        return {}
    return {"first_draft_measured_s": sum(times) / len(times),
            "first_draft_replayed_s": sum(replayed) / len(replayed) if replayed else None}


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
