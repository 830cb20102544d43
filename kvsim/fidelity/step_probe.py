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
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.model.hardware_profile import scaled_curve

# the hardware profile's curves that are times of a decode-sized forward step (scaled)
STEP_CURVES = ("tpot", "tpot_batch", "verify")


@dataclass
class StepProbe:
    """Times the real model's decode step at a context (median of `steps` after the first)."""

    model: Any  # ModelSpec of the validated model
    steps: int = 24
    threads: int = 1  # torch threads, as the transport's processes
    _lm: Any = None
    _kv: dict[int, Any] = field(default_factory=dict)  # context -> bf16 KV of its prompt

    def step_s(self, context_tokens: int) -> float:
        import torch

        from kvsim.calibrate.model_profile import ModelCalibration, _prompt, _steps_s
        from kvsim.kv.capture import cache_to_kv, kv_to_cache, prefill

        if self._lm is None:
            from kvsim.model.load import load_lm

            self._lm = load_lm(self.model, threads=self.threads, seed=0)
            torch.set_num_threads(self.threads)
        lm = self._lm
        if context_tokens not in self._kv:  # the calibration prompts (their own text seed)
            ids = _prompt(lm, context_tokens, ModelCalibration([context_tokens]))
            cache, logits = prefill(lm.model, ids)
            self._kv[context_tokens] = (cache_to_kv(cache).to(torch.bfloat16),
                                        int(torch.argmax(logits)))
        kv, token = self._kv[context_tokens]
        dtype = next(lm.model.parameters()).dtype
        cache = kv_to_cache(kv.float(), lm.model.config, dtype)
        _first, later = _steps_s(lm, cache, token, self.steps)
        return float(statistics.median(later))


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
    for key in STEP_CURVES:
        if key in doc:
            doc[key] = scaled_curve(doc[key], scale)
    doc["step_probe"] = {"from_profile": str(hw_path), "context_tokens": context_tokens,
                         "probe_s": probe_s, "scale": scale,
                         "what": "step curves scaled to a decode-step probe taken just "
                                 "before this scenario (kvsim.fidelity.step_probe)"}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    return scale
