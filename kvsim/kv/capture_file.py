"""KV captures on disk: a real model's prefill KV (and the queries that attended to it), so
the codec bench, the transport and the quality tools can use real KV without re-running
the model.

File: torch.save of a dict
  {"version": 1,
   "kv": tensor [layers, 2, kv_heads, tokens, head_dim] (bf16/fp16/fp32),
   "queries": tensor [layers, q_heads, q_tokens, head_dim] or None  (same RoPE state as K),
   "meta": {"model": str, "rope": "post" | "pre", "text": str, "context_tokens": int, ...}}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvsim.core.data_files import record_loaded
from kvsim.core.layout import KVShape, check_finite
from kvsim.core.paths import DATA_DIR

CAPTURE_VERSION = 1
CAPTURE_DIR = DATA_DIR / "captures"


@dataclass
class Capture:
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]
    queries: torch.Tensor | None = None  # [layers, q_heads, q_tokens, head_dim]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = KVShape.of(self.kv)
        check_finite(self.kv, "captured KV")
        if self.queries is not None:
            q = self.queries
            if q.dim() != 4 or q.shape[0] != shape.layers or q.shape[-1] != shape.head_dim:
                raise ValueError(f"queries must be [layers={shape.layers}, q_heads, q_tokens, "
                                 f"head_dim={shape.head_dim}], got {tuple(q.shape)}")
            if q.shape[1] % shape.kv_heads:
                raise ValueError(f"q_heads {q.shape[1]} not a multiple of kv_heads "
                                 f"{shape.kv_heads} (GQA)")

    @property
    def shape(self) -> KVShape:
        return KVShape.of(self.kv)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"version": CAPTURE_VERSION, "kv": self.kv.contiguous(),
                    "queries": None if self.queries is None else self.queries.contiguous(),
                    "meta": dict(self.meta)}, path)
        return path


def resolve_capture_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = CAPTURE_DIR / f"{name_or_path}.pt"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in CAPTURE_DIR.glob("*.pt")) if CAPTURE_DIR.is_dir() else []
    raise FileNotFoundError(f"no KV capture {str(name_or_path)!r} (a path, or a name in "
                            f"{CAPTURE_DIR}: {known}); make one with `kvsim quality`")


def load_capture(name_or_path: str | Path) -> Capture:
    path = resolve_capture_path(name_or_path)
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
        record_loaded(path)
    except Exception as exc:
        raise ValueError(f"{path}: not a readable KV capture ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("version") != CAPTURE_VERSION or "kv" not in doc:
        raise ValueError(f"{path}: not a version-{CAPTURE_VERSION} kvsim capture")
    return Capture(doc["kv"], doc.get("queries"), dict(doc.get("meta") or {}))
