"""Load a real causal LM (and its tokenizer) offline with transformers.

`spec` is one of:
- a model preset (conf/model/<name>.yaml, or its name): its `path` if set, else its fetched .gguf
  (`kvsim model fetch`);
- a local .gguf file;
- a local Hugging Face checkpoint directory (config.json + weights + tokenizer files).

Nothing is downloaded here: HF_HUB_OFFLINE=1 is set before transformers is imported.
A .gguf's first float32 load writes an exact float32 conversion beside it, which later float32
loads read instead (~4 s instead of ~18 s for SmolLM2 on a 2-core host;
kvsim.model.converted).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsim.core.data_files import record_loaded
from kvsim.model import converted
from kvsim.model.fetch import cached_gguf_path
from kvsim.model.presets import load_model_preset, model_preset_names
from kvsim.model.spec import ModelSpec

_DTYPES = {"float32", "bfloat16", "float16"}


@dataclass
class WeightsLocation:
    directory: Path  # what from_pretrained gets
    gguf_file: str | None  # file name inside `directory` for GGUF weights, else None
    name: str  # what reports call the model
    preset: ModelSpec | None = None


@dataclass
class LoadedLM:
    model: Any  # transformers PreTrainedModel (causal LM), eval mode
    tokenizer: Any
    name: str
    location: WeightsLocation | None = None
    load_s: float = 0.0
    meta: dict = field(default_factory=dict)


def _from_path(path: Path, name: str, preset: ModelSpec | None) -> WeightsLocation:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf (or give a checkpoint "
                             "directory)")
        return WeightsLocation(path.parent, path.name, name, preset)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: not a Hugging Face checkpoint directory (no config.json)")
        return WeightsLocation(path, None, name, preset)
    raise FileNotFoundError(f"model path {path} does not exist")


def locate_weights(spec: str | ModelSpec, cache: str | Path | None = None) -> WeightsLocation:
    """Resolve a preset (or its name) or a path to where its weights are on this machine."""
    if isinstance(spec, ModelSpec) or spec in model_preset_names():
        preset = spec if isinstance(spec, ModelSpec) else load_model_preset(spec)
        if preset.path:
            return _from_path(Path(preset.path).expanduser(), preset.name, preset)
        if preset.fetchable:
            gguf = cached_gguf_path(preset, cache)
            if not gguf.is_file():
                raise FileNotFoundError(f"{preset.name}: weights not fetched ({gguf} missing); "
                                        f"run `kvsim model fetch models=[{preset.name}]` first")
            return WeightsLocation(gguf.parent, gguf.name, preset.name, preset)
        if preset.name == "custom":
            raise ValueError("model=custom needs model.path=/path/to/checkpoint-dir-or-file.gguf")
        raise ValueError(f"model preset {preset.name!r} has no weights on this machine "
                         f"(upstream: {preset.hf_id}); set model.path=/path/to/checkpoint-or-gguf "
                         "or pass the path itself as the model")
    path = Path(spec).expanduser()
    if path.exists():
        return _from_path(path, path.stem if path.is_file() else path.name, None)
    raise ValueError(f"model {spec!r} is neither a model preset "
                     f"({', '.join(model_preset_names())}) nor an existing .gguf file / checkpoint "
                     "directory")


def load_lm(spec: str | ModelSpec, cache: str | Path | None = None, dtype: str = "float32",
            threads: int | None = None, seed: int = 0, device: Any = "cpu") -> LoadedLM:
    """Load model + tokenizer offline (a random_init preset: a tiny random Llama), the
    model's weights on `device` (a torch.device or its name)."""
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if threads:
        torch.set_num_threads(int(threads))
    if isinstance(spec, ModelSpec) and spec.random_init:
        from kvsim.model.tiny import ByteTokenizer, tiny_llama

        model = tiny_llama(seed, spec.layers, spec.attention_heads * spec.head_dim,
                           spec.attention_heads, spec.kv_heads).to(device)
        meta = {"model": spec.name, "weights": "random init", "dtype": "float32",
                "layers": spec.layers, "attention_heads": spec.attention_heads,
                "kv_heads": spec.kv_heads, "head_dim": spec.head_dim}
        return LoadedLM(model, ByteTokenizer(), spec.name, None, 0.0, meta)
    loc = locate_weights(spec, cache)
    hf_logging.set_verbosity_error()  # GGUF dequantization logs per tensor otherwise
    started = time.perf_counter()
    def from_pretrained(directory: Path, **kwargs: Any) -> tuple[Any, Any]:
        """(model in eval mode, tokenizer) from a directory, offline."""
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)
        lm = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=getattr(torch, dtype), attn_implementation="sdpa",
            local_files_only=True, **kwargs)
        return lm.eval(), tok

    model = tokenizer = conversion = None
    gguf = loc.directory / loc.gguf_file if loc.gguf_file else None
    # one file (~100 MB for SmolLM2): hashed for provenance; checkpoint directories (many GB
    # of shards) are named in meta["weights"] only
    gguf_sha256 = record_loaded(gguf) if gguf is not None else None
    convertible = gguf_sha256 is not None and dtype == "float32"  # (see kvsim.model.converted)
    if convertible and converted.usable(target := converted.converted_dir(gguf, gguf_sha256),
                                        gguf_sha256):
        conversion = target
        try:
            model, tokenizer = from_pretrained(conversion)
            record_loaded(conversion / converted.MARKER)  # provenance: which conversion
        except Exception as exc:  # noqa: BLE001 - a damaged conversion: the GGUF again
            print(f"kvsim: the converted model {conversion} did not load ({exc}); "
                  "loading the GGUF and converting again", file=sys.stderr)
            converted.discard(conversion)
            model = tokenizer = conversion = None
    if model is None:
        model, tokenizer = from_pretrained(
            loc.directory, **({"gguf_file": loc.gguf_file} if loc.gguf_file else {}))
        if convertible:
            conversion = converted.write(model, tokenizer, gguf, gguf_sha256)
    model = model.to(device)
    load_s = time.perf_counter() - started
    cfg = model.config
    meta = {"model": loc.name, "weights": str(loc.directory / (loc.gguf_file or "")),
            **({"converted": str(conversion)} if conversion is not None else {}),
            "dtype": dtype, "layers": cfg.num_hidden_layers,
            "attention_heads": cfg.num_attention_heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "head_dim": getattr(cfg, "head_dim", None)
            or cfg.hidden_size // cfg.num_attention_heads}
    if loc.preset is not None and loc.preset.known_shape:
        for key in ("layers", "attention_heads", "kv_heads", "head_dim"):
            if getattr(loc.preset, key) != meta[key]:
                raise ValueError(f"{loc.preset.name}: preset says {key}={getattr(loc.preset, key)} "
                                 f"but the weights have {meta[key]}")
    return LoadedLM(model, tokenizer, loc.name, loc, load_s, meta)
