"""A timing model of a real preset for the decode-loop tests: Llama-3.1-8B on an H100 (the
roofline, no measured profile), read as Hydra composes the presets."""

from __future__ import annotations

from omegaconf import OmegaConf

from kvsim.core.paths import CONF_DIR
from kvsim.model.hardware import HardwareSpec
from kvsim.model.presets import load_model_preset
from kvsim.scenario.timing_model import TimingModel


def llama8b_h100_timing() -> TimingModel:
    # OmegaConf's YAML, as the model preset loader reads it (8.03e9 a float, not a string)
    hw = HardwareSpec(**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "hardware" /
                                                              "h100.yaml")))
    return TimingModel(load_model_preset("llama-3.1-8b"), hw)
