"""`kvsim calibrate`: measure this machine and its emulated links into profiles the simulator
loads by name (kvsim.calibrate.pipeline says what is written where)."""

from __future__ import annotations

from kvsim.calibrate.pipeline import Config, calibrate

COMMAND = ("calibrate",)
HELP = "measure this machine (real model, codecs, emulated links) into simulator profiles"
CONFIG_NAME = "calibrate"


def run(cfg: Config) -> list[dict]:
    return calibrate(cfg)
