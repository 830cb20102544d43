"""`kvsim validate`: how far the simulator is from the real transport, measured (the method:
kvsim.fidelity.validation)."""

from __future__ import annotations

from kvsim.fidelity.validation import Config, validate

COMMAND = ("validate",)
HELP = "simulator vs the real transport: relative error per scenario and metric"
CONFIG_NAME = "validate"


def run(cfg: Config) -> dict:
    return validate(cfg)
