"""A GGUF model's weights, converted once into a float32 safetensors checkpoint beside the
GGUF, so that later processes load in about 0.5 s instead of re-parsing the GGUF.

Why: transformers reads a GGUF's metadata (the whole 49k-token vocabulary) three times per
load (tokenizer, config, weights) and rebuilds its tensor-name map per tensor: SmolLM2-135M
takes ~17 s to load from its GGUF on this 2-core machine, of which ~2 s is dequantization.
Every `kvsim emulate` transfer starts two processes that load the model (the prefill node
and the decode node), so a calibration or validation spent most of its time loading.

The conversion is exact: the GGUF's tensors are dequantized to float32 (what transformers
does on every load) and written as they are; a model loaded from the conversion has the
same state dict, config (less the GGUF `quantization_config`), tokenizer and logits, bit
for bit (tests/test_model_converted.py). A float16 / bfloat16 load casts the float32
tensors exactly as a GGUF load does.

Layout: <gguf dir>/<gguf stem>.hf-<first 16 hex of the GGUF's sha256>/ with config.json,
generation_config.json, model.safetensors, the tokenizer's files, and `converted.json`
(written last: a directory without it is incomplete): the GGUF's name and sha256, the
safetensors file's sha256, and the transformers version that converted it. A conversion made
by another transformers version, or for another GGUF, is not used (and is rewritten).
Provenance records `converted.json` beside the GGUF itself.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvsim.data_files import record_loaded, sha256_file

FORMAT = 1
MARKER = "converted.json"
WEIGHTS = "model.safetensors"


def converted_dir(gguf: Path, gguf_sha256: str) -> Path:
    """Where the conversion of the GGUF at `gguf` (with that sha256) lives."""
    return gguf.parent / f"{gguf.stem}.hf-{gguf_sha256[:16]}"


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def usable(directory: Path, gguf_sha256: str) -> bool:
    """True when `directory` holds a complete conversion of that GGUF by this transformers."""
    try:
        doc = json.loads((directory / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (isinstance(doc, dict) and doc.get("format") == FORMAT
            and doc.get("gguf_sha256") == gguf_sha256
            and doc.get("transformers_version") == _transformers_version()
            and (directory / WEIGHTS).is_file() and (directory / "config.json").is_file())


def discard(directory: Path) -> None:
    """Remove a damaged conversion (its marker first: a reader never sees it half-removed)."""
    (directory / MARKER).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def load(directory: Path, dtype: Any) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a conversion; its marker goes to provenance."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype,
                                                 attn_implementation="sdpa",
                                                 local_files_only=True)
    record_loaded(directory / MARKER)
    return model.eval(), tokenizer


def write(model: Any, tokenizer: Any, gguf: Path, gguf_sha256: str) -> Path | None:
    """Write the conversion of `model` (loaded from `gguf` in float32) and `tokenizer`;
    return its directory, or None (with a note on stderr) when it cannot be written (a
    read-only cache: loading still works, only slower). Safe against a concurrent writer
    (the prefill and decode processes of one transfer start together): each writes a
    temporary directory beside the target and renames it; the loser discards its own."""
    import torch
    from safetensors.torch import save_model

    target = converted_dir(gguf, gguf_sha256)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("only a float32 load is converted (others cast from it on load)")
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=gguf.parent))
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # the tensors are dequantized
            del config.quantization_config
        config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        save_model(model, str(tmp / WEIGHTS))  # tied embeddings are stored once
        tokenizer.save_pretrained(str(tmp))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of a shared cache
        (tmp / MARKER).write_text(json.dumps({
            "format": FORMAT, "gguf_file": gguf.name, "gguf_sha256": gguf_sha256,
            "weights_sha256": sha256_file(tmp / WEIGHTS), "dtype": "float32",
            "transformers_version": _transformers_version(),
            "what": "the GGUF's tensors dequantized to float32 by transformers' GGUF "
                    "loader, unchanged (kvsim.model.converted)"}, indent=2) + "\n")
        if usable(target, gguf_sha256):  # a concurrent writer finished first
            return target
        if target.exists():  # stale (another transformers / format) or half-written
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not usable(target, gguf_sha256):  # not a concurrent writer's success
                raise
        return target
    except OSError as exc:
        print(f"kvsim: could not write the converted model to {target} ({exc}); loading "
              "from the GGUF each time (slower)", file=sys.stderr)
        return None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
