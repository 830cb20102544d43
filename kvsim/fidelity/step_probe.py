"""The decode step's speed now: a probe taken just before a validation scenario runs.

A shared host's decode step drifts, on the project's 2-core host by tens of percent within
minutes and between runs (CHANGELOG.md, "The step probe"). A full validation lasts ~50
minutes, so a step calibrated at its start describes its middle and end no better than that
drift. Before each single-request scenario, the probe times `steps` greedy decode steps of
the real model at the scenario's context, in this process, on a cache built as the receiver
builds it (from the calibration prompts, never from a validation run), and the simulator's
step curves for that scenario are the calibrated ones scaled to the probe: the calibration
keeps the curves' shape (context, batch, verification and draft steps relative to a step),
the probe sets their level. `kvsim validate step_from_scenario=true` sets the level the same
way from the scenario's own measured steps.

The host's other CPU work moves with its step: the codecs' encode and dequantization, the
receiver's cache build and time per byte taken in, a transfer's handshake are scaled by the
same factor (probed_companions), as a drift rescale scales them (kvsim.model.host): the
on-arrival worker's layer jobs of a full grid's scenarios followed each scenario's step scale
(CHANGELOG.md, 2026-12-06, with what it did to five saved runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvsim.model.hardware_profile import STEP_CURVES, scaled_profile
from kvsim.model.host import receiver_work_scaled


def probed_profile(hw_path: Path, context_tokens: int, probe_s: float, out_path: Path
                   ) -> float:
    """Write the hardware profile at `hw_path` with its step curves scaled so that its step at
    `context_tokens` is `probe_s` (s), and its receiver's work outside the step (cache build,
    s per byte taken in) with them, to `out_path`; returns the scale (probe over the
    calibrated step there). The scaled profile names its origin and the probe."""
    if not probe_s > 0:
        raise ValueError(f"step probe must be > 0 s, got {probe_s}")
    doc = json.loads(Path(hw_path).read_text())
    tpot = doc["tpot"]
    scale = probe_s / float(np.interp(context_tokens, tpot["context_tokens"], tpot["s"]))
    doc = {**scaled_profile(doc, STEP_CURVES, scale), **receiver_work_scaled(doc, scale)}
    doc["step_probe"] = {"from_profile": str(hw_path), "context_tokens": context_tokens,
                         "probe_s": probe_s, "scale": scale,
                         "what": "step curves, cache build and receiver s per byte taken "
                                 "in scaled to a decode-step level taken for this scenario "
                                 "(kvsim.fidelity.step_probe)"}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    return scale


def probed_companions(codec_timing: Path, link: Path, scale: float, out_dir: Path,
                      name: str, record: dict) -> tuple[Path, Path]:
    """(codec timing, link profile) of one scenario on a host `scale` x as slow as the
    calibration's, written to out_dir as <name>-codec-timing.json and <name>-link.json: the
    codecs' rates / scale and fixed times x scale (kvsim.model.host.rescaled_codec_timing),
    the link's handshake and receiver s per byte x scale (rescaled_link_profile; its own
    terms and the ratios to a step or to the codecs' jobs stay). `record` names where the
    level came from; each file keeps it under `step_level` (a drift rescale's `drift` record,
    where the file has one, stays)."""
    from kvsim.model.host import rescaled_codec_timing, rescaled_link_profile

    out_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for path, rescale, suffix in ((codec_timing, rescaled_codec_timing, "codec-timing"),
                                  (link, rescaled_link_profile, "link")):
        scaled = rescale(json.loads(Path(path).read_text()), scale,
                         {**record, "from_profile": str(path)}, key="step_level")
        target = out_dir / f"{name}-{suffix}.json"
        target.write_text(json.dumps(scaled, indent=1) + "\n")
        out.append(target)
    return out[0], out[1]
