"""Measured profiles that `kvsim sim` loads by name: what `kvsim calibrate` wrote about one
machine (`hardware.profile`: the real model's prefill / decode step / verification times,
and the codec timing of the transport's receiver) and about one link emulation
(`link.profile`: the emulated link's goodput fraction, first-byte latency and per-message
cost).

A profile is named by a path to its JSON file, or by a bare name looked up as
data/profiles/<kind>/<name>.json (the shipped profiles; `kvsim calibrate out_dir=data/profiles`
writes them there).
"""

from __future__ import annotations

from pathlib import Path

from kvsim.core.paths import DATA_DIR

PROFILE_DIR = DATA_DIR / "profiles"
KINDS = ("hardware", "link", "codec_timing")


def profile_path(kind: str, name_or_path: str) -> Path:
    """The file of a profile named by `name_or_path` (a path, or a shipped profile's name)."""
    if kind not in KINDS:
        raise ValueError(f"unknown profile kind {kind!r}; one of {KINDS}")
    given = Path(name_or_path).expanduser()
    if given.suffix == ".json" or given.is_file() or "/" in name_or_path:
        if not given.is_file():
            raise ValueError(f"{kind} profile {name_or_path!r} not found")
        return given
    shipped = PROFILE_DIR / kind / f"{name_or_path}.json"
    if not shipped.is_file():
        have = sorted(p.stem for p in (PROFILE_DIR / kind).glob("*.json"))
        raise ValueError(f"no {kind} profile named {name_or_path!r} (shipped: "
                         f"{', '.join(have) or 'none'}; or give a path to a JSON file that "
                         "`kvsim calibrate` wrote)")
    return shipped
