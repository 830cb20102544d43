"""Synthetic request rows whose on-arrival layer jobs follow a known worker pace
(kvsim.calibrate.worker_pace): what the fit must recover, and what a faked calibration
transfer returns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def paced_rows(truth: tuple[float, float, float], base_s: float, requests: int = 4,
               rates_gbps: tuple[float, ...] = (0.3, 0.8), codec: str = "lynx") -> list[dict]:
    """Requests (rates taken in turn) whose 12 layer jobs run wholly beside the encoder while
    bytes arrive (over [0, 0.1] s), wholly while bytes arrive (to 0.6 s), or after both, each
    exactly as long as `truth` (alone, encoder, ingest) makes a job of `base_s` (< 10 ms);
    request r's encoder worked 0.05 x (1 + r) s."""
    alone, encoder, ingest = truth
    starts = [0.0, 0.02, 0.04, 0.06, 0.15, 0.25, 0.35, 0.45, 0.65, 0.7, 0.75, 0.8]
    rows = []
    for r in range(requests):
        spans = [["prefill", "prefill", -1.0, 0.0], ["encode", "prefill", 0.0, 0.1],
                 ["transfer anchor", "link", 0.0, 0.5], ["transfer residual", "link", 0.0, 0.6]]
        for layer, t in enumerate(starts):
            extra = encoder + ingest if t < 0.1 else ingest if t < 0.6 else 0.0
            kind = "stream 0" if layer % 2 else "streams 0-1"
            spans.append([f"dequantize layer {layer} {kind}", "decode", t + 1e-3 * r,
                          t + 1e-3 * r + base_s * alone * (1 + extra)])
        rows.append({"status": "done", "dequantize": "on_arrival", "codec": codec,
                     "codec_name": codec, "streams": 2, "context_tokens": 1024,
                     "transfer": "split_stream", "encode_work_s": 0.05 * (1 + r),
                     "total_bytes": 5e6, "bandwidth_gbps": rates_gbps[r % len(rates_gbps)],
                     "trace_spans": spans})
    return rows


def flat_lynx_timing(path: Path, model: Any, tokens: int = 1024, job_s: float = 0.004) -> Path:
    """A codec timing file at `path` whose every lynx layer job (anchor or not) of `model`
    at `tokens` takes job_s (a fixed part + the layer's bytes at 1 GB/s)."""
    layer_bytes = model.kv_bytes_bf16(tokens) / model.layers
    fixed_s = job_s - layer_bytes / 1e9
    entry = {"encode_gb_per_s": 1.0, "decode_gb_per_s": 1.0, "source": "assumed",
             "assumption": "test", "layer_job_fixed_s": fixed_s, "layer_job_gb_per_s": 1.0,
             "anchor_layer_job_fixed_s": fixed_s, "anchor_layer_job_gb_per_s": 1.0}
    path.write_text(json.dumps({"version": 1, "hardware": f"local-{model.name}",
                                "codecs": {"lynx": entry}}))
    return path
