"""A GGUF model's weights, converted once into a float32 safetensors checkpoint beside the
GGUF, so that later float32 loads take ~4 s (mostly importing transformers) instead of ~18 s.

Why: transformers reads a GGUF's metadata (the whole 49k-token vocabulary) three times per
load (tokenizer, config, weights) and rebuilds its tensor-name map per tensor: SmolLM2-135M
takes ~17 s to load from its GGUF on a 2-core host, of which ~2 s is dequantization.
Every `kvsim emulate` transfer starts two processes that load the model (the prefill node
and the decode node), so a calibration or validation spent most of its time loading.

The conversion is exact: the GGUF's tensors are dequantized to float32 (what transformers
does on every float32 load) and written as they are; a model loaded from the conversion has
the same state dict, config (less the GGUF `quantization_config`), tokenizer and logits, bit
for bit (tests/test_model_converted.py). Only float32 loads use it (kvsim's default): some
architectures dequantize straight into a float16 / bfloat16 load's dtype, which a cast of
the float32 tensors need not equal.

Layout: <gguf dir>/<gguf stem>.hf-<first 16 hex of the GGUF's sha256>/ with config.json,
generation_config.json, model.safetensors, the tokenizer's files, and `converted.json`
(written last: a directory without it is incomplete): the GGUF's name and sha256, the
safetensors file's sha256 and size, and the transformers version that converted it. A
conversion made by another transformers version, for another GGUF, or whose weights file has
another size, is not used (and is rewritten); one that fails to load is removed (load_lm).
Writing it is optional: any failure leaves a note on stderr and the GGUF-loaded model.
load_lm reads a conversion as any checkpoint directory; provenance records `converted.json`
beside the GGUF itself.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvsim.core.data_files import sha256_file

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
        weights_bytes = (directory / WEIGHTS).stat().st_size
    except (OSError, json.JSONDecodeError):
        return False
    return (isinstance(doc, dict) and doc.get("format") == FORMAT
            and doc.get("gguf_sha256") == gguf_sha256
            and doc.get("transformers_version") == _transformers_version()
            and doc.get("weights_bytes") == weights_bytes
            and (directory / "config.json").is_file())


def _remove(directory: Path) -> None:
    """Remove a conversion: renamed aside first (one step), so that a reader finds either the
    whole directory or none, never a half-removed one."""
    aside = directory.with_name(f".{directory.name}.trash-{os.getpid()}")
    try:
        directory.rename(aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def discard(directory: Path) -> None:
    """Remove a conversion that failed to load; a failure to (a read-only cache) is noted."""
    try:
        _remove(directory)
    except OSError as exc:
        print(f"kvsim: could not remove the converted model {directory} ({exc})",
              file=sys.stderr)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _clear_leftovers(target: Path) -> None:
    """Remove the temporary / set-aside directories of writers that died (a killed process
    skips its cleanup): named .<target>.tmp-<pid>-* / .<target>.trash-<pid>."""
    for p in target.parent.glob(f".{target.name}.*-*"):
        kind, _, rest = p.name[len(target.name) + 2:].partition("-")
        pid = rest.split("-")[0]
        if kind in ("tmp", "trash") and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def write(model: Any, tokenizer: Any, gguf: Path, gguf_sha256: str) -> Path | None:
    """Write the conversion of `model` (loaded from `gguf` in float32) and `tokenizer`;
    return its directory, or None with a note on stderr when it is not written (a read-only
    cache, weights that are not all float32, any failure: loading still works, only slower).
    Safe against a concurrent writer (the prefill and decode processes of one transfer start
    together): each writes a temporary directory beside the target and renames it into
    place; one that finds the other's finished conversion keeps it and drops its own."""
    import torch
    from safetensors.torch import save_model

    target = converted_dir(gguf, gguf_sha256)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        print(f"kvsim: {gguf.name}: not converted (weights not all float32 after loading)",
              file=sys.stderr)
        return None
    tmp: Path | None = None
    try:
        _clear_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-",
                                    dir=gguf.parent))
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # the tensors are dequantized
            del config.quantization_config
        config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        save_model(model, str(tmp / WEIGHTS))  # tied embeddings are stored once
        tokenizer.save_pretrained(str(tmp))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of a shared cache
        weights = tmp / WEIGHTS
        with open(weights, "rb") as f:  # on disk before the rename makes it visible
            os.fsync(f.fileno())
        (tmp / MARKER).write_text(json.dumps({
            "format": FORMAT, "gguf_file": gguf.name, "gguf_sha256": gguf_sha256,
            "weights_sha256": sha256_file(weights),
            "weights_bytes": weights.stat().st_size, "dtype": "float32",
            "transformers_version": _transformers_version(),
            "what": "the GGUF's tensors dequantized to float32 by transformers' GGUF "
                    "loader, unchanged (kvsim.model.converted)"}, indent=2) + "\n")
        if usable(target, gguf_sha256):  # a concurrent writer finished first
            return target
        if target.exists():  # stale (another transformers / format / size)
            _remove(target)
        try:
            tmp.rename(target)
        except OSError:
            if not usable(target, gguf_sha256):  # not a concurrent writer's success
                raise
        return target
    except Exception as exc:  # noqa: BLE001 - optional: the GGUF-loaded model is kept
        print(f"kvsim: could not write the converted model to {target} ({exc}); loading "
              "from the GGUF each time (slower)", file=sys.stderr)
        return None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
