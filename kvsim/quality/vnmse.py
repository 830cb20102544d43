"""Codec error through the real model: attention-output vNMSE per layer (real decode queries
through every layer's attention), next-token top-1 agreement and perplexity on held-out text.

The reference is the model's own (full-precision) cache; the codec encodes that tensor and
each stream prefix is decoded and fed back. vNMSE uses kvsim.kv.attention_error (queries attend
to the context cache only); top-1/perplexity run the whole model on the held-out tokens with
the dequantized cache as past_key_values.

vNMSE table file (version 1), data/vnmse/<name>.json:
  {"version": 1, "name", "model", "context_tokens", "query_tokens", "text", "runs",
   "source": "measured" | "synthetic",
   "rows": [{"codec", "streams_used", "stream", "bits_per_element", "vnmse",
             "vnmse_per_layer": [...], "top1_agreement", "ppl_ref", "ppl", ...}]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsim.core.data_files import record_loaded
from kvsim.core.paths import DATA_DIR
from kvsim.core.report import json_safe
from kvsim.kv.attention_error import attention_vnmse, relative_mse

VNMSE_DIR = DATA_DIR / "vnmse"
VNMSE_VERSION = 1


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(mean NLL): logits [n, vocab] predict targets [n]."""
    nll = torch.nn.functional.cross_entropy(logits.float(), targets.long(), reduction="mean")
    return float(torch.exp(nll))


def top1_agreement(logits_ref: torch.Tensor, logits_hat: torch.Tensor) -> float:
    """Fraction of positions whose argmax token is the same ([n, vocab] each)."""
    return float((logits_ref.argmax(-1) == logits_hat.argmax(-1)).float().mean())


@dataclass
class CacheError:
    """Errors of one reconstructed cache against the reference, on one context."""

    vnmse_per_layer: np.ndarray  # [layers]
    relative_mse: float
    top1_agreement: float
    ppl: float

    @property
    def vnmse(self) -> float:
        return float(np.mean(self.vnmse_per_layer))


def cache_error(model: Any, kv: torch.Tensor, kv_hat: torch.Tensor, queries: torch.Tensor,
                heldout: torch.Tensor, logits_ref: torch.Tensor) -> CacheError:
    """kv, kv_hat: [layers, 2, kv_heads, tokens, head_dim]; queries [layers, q_heads, n,
    head_dim] of the held-out tokens; heldout [n] ids; logits_ref [n, vocab] on kv."""
    from kvsim.kv.capture import forward_with_kv

    kv_hat = kv_hat.to(kv.dtype)
    layers = attention_vnmse(queries, kv, kv_hat)
    _, logits_hat = forward_with_kv(model, kv_hat, heldout)
    return CacheError(layers, relative_mse(kv, kv_hat), top1_agreement(logits_ref, logits_hat),
                      perplexity(logits_hat[:-1], heldout[1:]))


@dataclass
class VNMSETable:
    name: str
    rows: list[dict]
    meta: dict = field(default_factory=dict)
    source: str = "measured"

    def to_dict(self) -> dict:
        return {"version": VNMSE_VERSION, "name": self.name, "source": self.source, **self.meta,
                "rows": self.rows}

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path else VNMSE_DIR / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(self.to_dict()), indent=1) + "\n")
        return path

    def lookup(self, codec: str, streams_used: int | None = None) -> dict:
        """The row of `codec` with `streams_used` streams (default: all of them)."""
        rows = [r for r in self.rows if r["codec"] == codec]
        if not rows:
            raise ValueError(f"vNMSE table {self.name!r} has no codec {codec!r}; has "
                             f"{sorted({r['codec'] for r in self.rows})}")
        if streams_used is None:
            return max(rows, key=lambda r: r["streams_used"])
        for row in rows:
            if row["streams_used"] == streams_used:
                return row
        raise ValueError(f"vNMSE table {self.name!r}: codec {codec!r} has no row with "
                         f"streams_used={streams_used}")


def load_vnmse_table(name_or_path: str) -> VNMSETable:
    """By file name in data/vnmse/ (e.g. 'smollm2-135m-ctx1024') or a path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = VNMSE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in VNMSE_DIR.glob("*.json")) if VNMSE_DIR.is_dir() else []
        raise ValueError(f"unknown vNMSE table {name_or_path!r}; a path or one of {known}")
    doc = json.loads(path.read_text())
    record_loaded(path)
    if doc.get("version") != VNMSE_VERSION or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: not a version-{VNMSE_VERSION} vNMSE table")
    meta = {k: v for k, v in doc.items() if k not in ("version", "name", "source", "rows")}
    return VNMSETable(doc["name"], doc["rows"], meta, doc.get("source", "measured"))
