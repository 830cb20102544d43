"""Where kvsim finds its configs (conf/) and its measured data (data/).

Both live in the project checkout, which `make setup` installs in editable mode; set
KVSIM_ROOT to use another checkout (or a copy of conf/ and data/) with an installed kvsim.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(os.environ.get("KVSIM_ROOT") or Path(__file__).resolve().parent.parent)
CONF_DIR = ROOT / "conf"
DATA_DIR = ROOT / "data"


def check_root() -> None:
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(
            f"kvsim's configs are not at {CONF_DIR}: install kvsim from its checkout in "
            "editable mode (`make setup`), or set KVSIM_ROOT to a checkout")
