"""Model presets by name: conf/model/<name>.yaml read into a ModelSpec (kvsim.model.spec), the one
preset type of the simulator, `kvsim quality`, the transport and `kvsim model fetch`.

Commands get their preset through Hydra's `model=` group; this loader serves code that names a
preset outside a composed config (the transport's `auto` checks, tests, scripts).
"""

from __future__ import annotations

from dataclasses import fields

from omegaconf import OmegaConf

from kvsim.core.paths import CONF_DIR
from kvsim.model.spec import ModelSpec

PRESET_DIR = CONF_DIR / "model"


def model_preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def model_from_doc(doc: dict, where: str = "model preset") -> ModelSpec:
    """A ModelSpec from a plain mapping; unknown keys are an error naming the valid ones."""
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {sorted(known)}")
    try:
        return ModelSpec(**doc)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def load_model_preset(name: str) -> ModelSpec:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; presets in {PRESET_DIR}: "
                         f"{', '.join(model_preset_names())}")
    # OmegaConf's YAML reading, as Hydra composes the group (e.g. 671e9 is a float there, a
    # string to plain YAML 1.1)
    doc = OmegaConf.to_container(OmegaConf.load(path)) or {}
    if doc.get("name") != name:
        raise ValueError(f"{path}: `name` must be {name!r} (the file name), got "
                         f"{doc.get('name')!r}")
    return model_from_doc(doc, str(path))
