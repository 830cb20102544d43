"""Machine-readable reports (JSON) and readable tables: every number traceable to its config."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from kvsim.core.data_files import loaded_files
from kvsim.core.version import VERSION

CODE_DIR = Path(__file__).resolve().parents[1]  # the kvsim package of the checkout that ran


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                             cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def git_state(cwd: Path | None = None) -> dict[str, Any]:
    """The commit the code is at and `git describe --always --dirty` (a "-dirty" suffix: tracked
    files differ from that commit, so the commit alone does not reproduce the run). The code's
    own checkout (cwd None) is asked once per process, at its first report: a sweep's
    worker process writes a report per job. There, KVSIM_SOURCE_COMMIT names the commit of a
    tree copied to another machine (scripts/gpu_checks.sh), whose .git, if one came along,
    need not be that tree's."""
    if cwd is None:
        named = os.environ.get("KVSIM_SOURCE_COMMIT")
        if named:
            return {"git_commit": named, "git_describe": None, "git_dirty": None,
                    "git_from": "KVSIM_SOURCE_COMMIT"}
        return dict(_code_git_state(CODE_DIR))
    describe = _git(["describe", "--always", "--dirty"], cwd)
    return {"git_commit": _git(["rev-parse", "HEAD"], cwd), "git_describe": describe,
            "git_dirty": describe.endswith("-dirty") if describe else None}


@functools.cache
def _code_git_state(code_dir: Path) -> dict[str, Any]:
    return git_state(code_dir)


@functools.cache
def _installed_version(package: str) -> str | None:
    # from the installed metadata (importing torch only for its version costs seconds), read
    # once per process
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance() -> dict[str, Any]:
    """Who made a result and from what: code version and git state, runtime, host, and every
    data file this process loaded (kvsim.core.data_files: path, sha256, size_bytes)."""
    return {
        "kvsim_version": VERSION,
        **git_state(),
        "python": platform.python_version(),
        "torch": _installed_version("torch"),
        "host": platform.node(),
        "created_unix_s": time.time(),
        "data_files": loaded_files(),
    }


def finite_number(v: Any) -> float | None:
    """A report value as a float where it is a finite number (not a bool), else None (a
    NaN comes back from JSON as null)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and \
        math.isfinite(v) else None


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
                 wall_s: float, overrides: list[str] | None = None,
                 extra: dict | None = None) -> None:
    """extra: further top-level keys a command reports (e.g. validate's error summary)."""
    doc = {
        "command": command,
        "overrides": overrides or [],
        "config": config,
        "provenance": provenance(),
        "wall_s": wall_s,
        **(extra or {}),
        "rows": rows,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(doc), indent=1) + "\n")


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec like '.3f' or '') -> fixed-width text table. A
    header may span lines ("drafted\nTT32T"): narrow columns under a long name."""
    heads = [h.split("\n") for _, h, _ in columns]
    depth = max((len(h) for h in heads), default=1)
    head_rows = [[h[i - (depth - len(h))] if i >= depth - len(h) else "" for h in heads]
                 for i in range(depth)]
    cells = []
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
    widths = [max(len(r[i]) for r in head_rows + cells) for i in range(len(columns))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w)
                     for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
           for r in head_rows + cells]
    out.insert(depth, "  ".join("-" * w for w in widths))
    return "\n".join(out)
