"""What the running kvsim command was asked for on its command line, read from Hydra's state
(as kvsim.core.paths.output_dir reads its run directory): empty outside kvsim's command line
(a test or a library call composing a config itself)."""

from __future__ import annotations


def hydra_run() -> tuple[str, list[str], dict[str, str]]:
    """(scenario chosen, command-line overrides, group choices); ("none", [], {}) outside
    kvsim's command line."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "none", [], {}
    hc = HydraConfig.get()
    choices = {str(k): str(v) for k, v in hc.runtime.choices.items()}
    return choices.get("scenario") or "none", list(hc.overrides.task), choices
