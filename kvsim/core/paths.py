"""Where kvsim finds its configs (conf/) and its measured data (data/).

Both live in the project checkout, which `make setup` installs in editable mode; set
KVSIM_ROOT to use another checkout (or a copy of conf/ and data/) with an installed kvsim.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(os.environ.get("KVSIM_ROOT") or Path(__file__).resolve().parents[2])
CONF_DIR = ROOT / "conf"
DATA_DIR = ROOT / "data"


def check_root() -> None:
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(
            f"kvsim's configs are not at {CONF_DIR}: install kvsim from its checkout in "
            "editable mode (`make setup`), or set KVSIM_ROOT to a checkout")


def output_dir() -> Path:
    """Where a command writes what it produces by default: the run's Hydra output directory
    (outputs/<date>/<time>/, or multirun/<date>/<time>/<job>/ under -m) when the command runs
    under kvsim's command line, else the current directory. Never the repository's data/ or
    plots/: updating those is an explicit out_dir=/out= of the command."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except ImportError:  # pragma: no cover - hydra is a dependency
        pass
    return Path.cwd()
