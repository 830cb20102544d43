"""The decode step's speed now: a probe taken just before a validation scenario runs.

A shared host's decode step drifts, on the project's 2-core host by tens of percent within
minutes and between runs (CHANGELOG.md, "The step probe"). A full validation lasts ~50
minutes, so a step calibrated at its start describes its middle and end no better than that
drift. Before each single-request scenario, the probe times `steps` greedy decode steps of
the real model at the scenario's context, in this process, on a cache built as the receiver
builds it (from the calibration prompts, never from a validation run), and the simulator's
step curves for that scenario are the calibrated ones scaled to the probe: the calibration
keeps the curves' shape (context, batch, verification and draft steps relative to a step),
the probe sets their level.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvsim.model.hardware_profile import STEP_CURVES, scaled_profile


def probed_profile(hw_path: Path, context_tokens: int, probe_s: float, out_path: Path
                   ) -> float:
    """Write the hardware profile at `hw_path` with its step curves scaled so that its step at
    `context_tokens` is `probe_s` (s) to `out_path`; returns the scale (probe over the
    calibrated step there). The scaled profile names its origin and the probe."""
    if not probe_s > 0:
        raise ValueError(f"step probe must be > 0 s, got {probe_s}")
    doc = json.loads(Path(hw_path).read_text())
    tpot = doc["tpot"]
    scale = probe_s / float(np.interp(context_tokens, tpot["context_tokens"], tpot["s"]))
    doc = scaled_profile(doc, STEP_CURVES, scale)
    doc["step_probe"] = {"from_profile": str(hw_path), "context_tokens": context_tokens,
                         "probe_s": probe_s, "scale": scale,
                         "what": "step curves scaled to a decode-step probe taken just "
                                 "before this scenario (kvsim.fidelity.step_probe)"}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    return scale
