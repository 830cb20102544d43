"""Machine-readable reports (JSON) and readable tables: every number traceable to its config."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import kvsim


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def provenance() -> dict[str, Any]:
    import torch

    return {
        "kvsim_version": kvsim.__version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "created_unix_s": time.time(),
    }


def json_safe(obj: Any) -> Any:
    """Make rows JSON-safe: numpy scalars/arrays to Python, NaN/Inf to None."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "tolist"):
        return json_safe(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_report(path: str | Path, command: str, config: dict, rows: list[dict],
                 wall_s: float, overrides: list[str] | None = None) -> None:
    doc = {
        "command": command,
        "overrides": overrides or [],
        "config": config,
        "provenance": provenance(),
        "wall_s": wall_s,
        "rows": rows,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(doc), indent=1) + "\n")


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec like '.3f' or '') -> fixed-width text table."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        line = []
        for key, _, fmt in columns:
            value = row.get(key)
            if value is None:
                line.append("-")
            elif fmt and isinstance(value, (int, float)):
                line.append(format(value, fmt))
            else:
                line.append(str(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w)
                     for i, (c, w) in enumerate(zip(r, widths, strict=True)))
           for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
