"""Codec presets: conf/codec/<preset>.yaml = {name: <registered codec>, params: {...}}.

A `codecs` list in any command's config holds entries that are either a preset name
("int4", "lynx") or a mapping {preset: int4, params: {...}} / {name: uniform, params: {...},
label: my-int4} so one invocation can compare several codecs and variants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from kvsim.core.paths import CONF_DIR
from kvsim.kernels.codec import Codec, make_codec

PRESET_DIR = CONF_DIR / "codec"


@dataclass
class CodecSpec:
    label: str  # what reports call it, e.g. "lynx-2+6"
    name: str  # registered codec name, e.g. "lynx"
    params: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Codec:
        return make_codec(self.name, self.params)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(preset: str) -> CodecSpec:
    path = PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        import difflib

        names = preset_names()
        near = difflib.get_close_matches(str(preset), names, n=1, cutoff=0.6)
        raise ValueError(f"unknown codec preset {preset!r}" +
                         (f"; did you mean {near[0]}?" if near else "") +
                         f" ({len(names)} presets: `kvsim list codec`)")
    doc = yaml.safe_load(path.read_text()) or {}
    if "name" not in doc:
        raise ValueError(f"{path}: a codec preset needs a `name` (the registered codec)")
    unknown = set(doc) - {"name", "params"}
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}; expected name, params")
    return CodecSpec(preset, doc["name"], dict(doc.get("params") or {}))


def resolve_codec(entry: str | dict) -> CodecSpec:
    """Turn one `codecs` list entry into a CodecSpec (validated by building the codec)."""
    if isinstance(entry, str):
        spec = load_preset(entry)
    elif isinstance(entry, dict):
        unknown = set(entry) - {"preset", "name", "params", "label"}
        if unknown:
            raise ValueError(f"codec entry {entry}: unknown key(s) {sorted(unknown)}; "
                             "expected preset | name, params, label")
        if "preset" in entry:
            base = load_preset(entry["preset"])
            params = {**base.params, **dict(entry.get("params") or {})}
            label = entry.get("label") or (base.label if not entry.get("params") else
                                           base.label + "(" + ",".join(
                                               f"{k}={v}" for k, v in entry["params"].items())
                                           + ")")
            spec = CodecSpec(label, base.name, params)
        elif "name" in entry:
            spec = CodecSpec(entry.get("label") or entry["name"], entry["name"],
                             dict(entry.get("params") or {}))
        else:
            raise ValueError(f"codec entry {entry}: needs `preset` or `name`")
    else:
        raise ValueError(f"codec entry must be a preset name or a mapping, got {entry!r}")
    spec.build()  # unknown codec / bad params fail here, with the codec's message
    return spec
